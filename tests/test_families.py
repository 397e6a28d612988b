"""The model families (``asps_jax.models``): Llama, OPT, GPT-2, GPT-Neo, Qwen2, Qwen3, Mistral,
Gemma 2 and Gemma 3 ports against transformers' PyTorch models (tiny random checkpoints).

Every expected value comes from transformers: full-sequence logits, sequential decoding of a
tree's root paths, the exact law of the first two sampled tokens, and greedy ``generate``.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_checkpoints import FAMILY_CONFIGS, tiny_family, tiny_llama, write_tiny_family
from test_decode import (
    MAX_NEW,
    PROMPT,
    ROWS,
    SETTINGS,
    VOCAB,
    _chi_square_pvalue,
    _exact_two_token_law,
    _hf_greedy,
)
from test_scoring import hand_tree, prefill, random_validity, root_path, tree_scorer

import asps_jax
from asps_jax.kv_cache import commit, init_cache
from asps_jax.models import (
    FAMILIES,
    LlamaConfig,
    ModelConfig,
    base,
    cards,
    forward_for,
    llama,
    load_model,
    save_checkpoint,
)
from asps_jax.models.rope import RopeScaling
from asps_jax.sharding import ShardingRules

V = 96  # the vocabulary of hf_checkpoints.FAMILY_CONFIGS

CASES = {
    # name: (family, transformers config overrides)
    "opt": ("opt", {}),
    # opt-350m's shape: post-LN (no final layer norm) and a smaller word-embedding dimension.
    "opt_post_ln_proj": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 24}),
    "opt_proj_untied": ("opt", {"word_embed_proj_dim": 16, "tie_word_embeddings": False}),
    "gpt2": ("gpt2", {}),
    "gpt2_untied_layer_scaled": (
        "gpt2",
        {"tie_word_embeddings": False, "scale_attn_by_inverse_layer_idx": True},
    ),
    # Layers global then local with a window of 4: every test sequence is longer than that.
    "gpt_neo": ("gpt_neo", {}),
    # The RoPE decoders (hf_checkpoints.FAMILY_CONFIGS: windows of 4, soft-caps that bind, ...).
    "qwen2": ("qwen2", {}),
    # Qwen2.5-0.5B's tied head, and a window on the layers from max_window_layers (1) on.
    "qwen2_tied_window": (
        "qwen2",
        {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 4,
         "max_window_layers": 1},
    ),
    "qwen3": ("qwen3", {}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
    "gemma2": ("gemma2", {}),  # layer 0 local (window 4), layer 1 global
    "gemma3_text": ("gemma3_text", {}),
}  # fmt: skip

# Llama (tiny_llama's shapes, vocabulary LLAMA_V): one case per RoPE scaling form.
LLAMA_V, E, F, NH = 128, 64, 96, 4
LLAMA_CASES = {
    # name: (kv heads, layers, tied, rope_parameters, max_position_embeddings); the shapes below
    "llama_mha_odd_layers": (4, 3, False, {"rope_type": "default", "rope_theta": 10000.0}, 64),
    "llama_gqa_tied_linear": (
        2,
        2,
        True,
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        64,
    ),
    # max_position_embeddings 8 < 12 tokens, so the dynamic NTK base growth is exercised.
    "llama_mqa_dynamic": (
        1,
        2,
        False,
        {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0},
        8,
    ),
    "llama_gqa_llama3": (
        2,
        1,
        False,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 10000.0,
        },
        64,
    ),
}
CASES.update({name: ("llama", {}) for name in LLAMA_CASES})


def llama_model(case: str, seed: int = 0):
    """A Llama case of :data:`LLAMA_CASES` (every RoPE scaling form, MHA / GQA / MQA)."""
    kvh, layers, tied, rope, max_pos = LLAMA_CASES[case]
    return tiny_llama(
        seed=seed,
        vocab_size=LLAMA_V,
        hidden_size=E,
        intermediate_size=F,
        num_hidden_layers=layers,
        num_attention_heads=NH,
        num_key_value_heads=kvh,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tied,
        rope_parameters=dict(rope),
        rms_norm_eps=1e-5,
        norm_noise=0.1,  # norms start at 1; randomise them so their loading is checked too
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each case written by transformers' save_pretrained once, with its loaded model."""
    out = {}
    for case, (family, overrides) in CASES.items():
        path = tmp_path_factory.mktemp(case)
        if case in LLAMA_CASES:
            hf = llama_model(case)
            hf.save_pretrained(path)
        else:
            hf = write_tiny_family(path, family, seed=0, **overrides)
        out[case] = (hf, load_model(path))
    return out


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def causal(B, T):
    return jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_full_sequence_matches_transformers(saved, case):
    hf, m = saved[case]
    assert m.family is FAMILIES[CASES[case][0]]
    B, T = 2, 12
    vocab = LLAMA_V if case in LLAMA_CASES else V
    tokens = np.random.default_rng(1).integers(0, vocab, (B, T)).astype(np.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, kv = jax.jit(m.forward)(m.params, jnp.asarray(tokens), positions, causal(B, T), None)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)
    if case in LLAMA_CASES:
        kvh, layers, tied = LLAMA_CASES[case][:3]
        assert m.params["embed"].dtype == jnp.float32 and ("lm_head" in m.params) == (not tied)
        assert kv.k.shape == (layers, B, T, kvh, E // NH)
        return
    c = hf.config
    kvh = getattr(c, "num_key_value_heads", None) or 4
    head_dim = getattr(c, "head_dim", None) or 8
    assert kv.k.shape == (2, B, T, kvh, head_dim)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_then_decode_matches_full_forward(saved, case):
    """Prefill 4 tokens into the cache, then decode one at a time == HF full-sequence logits."""
    hf, m = saved[case]
    # Llama: T < max_position_embeddings (8 for the dynamic case): HF's dynamic RoPE is then
    # unscaled (and, being stateful, HF resets frequencies grown by a longer earlier call only
    # below that length).
    B, T, P = (2, 7, 4) if case in LLAMA_CASES else (2, 10, 4)
    vocab = LLAMA_V if case in LLAMA_CASES else V
    tokens = np.random.default_rng(2).integers(0, vocab, (B, T)).astype(np.int32)
    expected = hf_logits(hf, tokens)

    @jax.jit
    def run(cache, chunk, start):
        t = chunk.shape[1]
        pos = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (B, t))
        slots = jnp.arange(T)[None, None, :] < cache.lengths[:, None, None]
        mask = jnp.concatenate([jnp.broadcast_to(slots, (B, t, T)), causal(B, t)], axis=-1)
        logits, kv = m.forward(m.params, chunk, pos, mask, cache)
        nodes = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))
        return logits, commit(cache, kv, nodes, jnp.full((B,), t, jnp.int32))

    logits, cache = run(init_cache(m.config, B, T), jnp.asarray(tokens[:, :P]), 0)
    got = [np.asarray(logits)]
    for i in range(P, T):
        logits, cache = run(cache, jnp.asarray(tokens[:, i : i + 1]), i)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), expected, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [T, T])


# One case per RoPE-decoder family (the window cases where the family has one).
TREE_CASES = ["qwen2_tied_window", "qwen3", "mistral", "gemma2", "gemma3_text"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["opt_post_ln_proj", "gpt2", "gpt_neo", *TREE_CASES])
def test_tree_scoring_equals_sequential_decoding(saved, case):
    """Positions are prefix length + depth; local windows (4) meet the tree mask."""
    hf, m = saved[case]
    rng = np.random.default_rng(3)
    tree = hand_tree()
    B, N = 3, tree.num_nodes
    prompts = [list(rng.integers(0, V, n)) for n in (4, 7, 2)]
    cache, roots = prefill(m, prompts)
    valid = random_validity(tree, rng, B)
    valid[1] = True  # row 1: every node, depth 3 after 6 cached tokens (past the window)
    toks = rng.integers(0, V, (B, N)).astype(np.int32)
    toks[:, 0] = roots
    logits, _ = tree_scorer(m, tree)(m.params, cache, jnp.asarray(toks), jnp.asarray(valid))
    logits = np.asarray(logits)
    assert np.isfinite(logits).all()
    for b in range(B):
        for i in range(N):
            if valid[b, i]:
                seq = prompts[b][:-1] + [int(toks[b, j]) for j in root_path(tree, i)]
                np.testing.assert_allclose(logits[b, i], hf_logits(hf, [seq])[0, -1], atol=1e-4)


FEATURES = [
    # (case, config change that removes one feature, first position it changes): the parity
    # above can fail, the feature is exercised: without it the logits from there on are far off.
    ("gpt_neo", {"window_size": 64}, 4),
    ("mistral", {"sliding_window": 64}, 4),
    ("qwen2_tied_window", {"sliding_window": 64}, 4),
    ("gemma2", {"sliding_window": 64}, 4),
    ("gemma2", {"attn_logit_softcapping": None}, 1),  # position 0: one key, softmax 1
    ("gemma2", {"final_logit_softcapping": None}, 0),
    ("gemma2", {"query_pre_attn_scalar": None}, 1),  # position 0 sees one key: scale-free
    ("gemma3_text", {"sliding_window": 64}, 4),
    ("gemma3_text", {"local_rope_theta": None}, 1),  # RoPE is the identity at position 0
    ("gemma3_text", {"rope_scaling": None}, 1),
    ("gemma3_text", {"final_logit_softcapping": None}, 0),
]


@pytest.mark.parametrize("case, change, start", FEATURES)
def test_feature_matters(saved, case, change, start):
    hf, m = saved[case]
    tokens = np.random.default_rng(4).integers(0, V, (1, 12)).astype(np.int32)
    pos = jnp.arange(12, dtype=jnp.int32)[None]
    other = dataclasses.replace(m.config, **change)
    logits, _ = jax.jit(forward_for(other))(m.params, jnp.asarray(tokens), pos, causal(1, 12), None)
    diff = np.abs(np.asarray(logits) - hf_logits(hf, tokens))[0].max(-1)
    assert diff[:start].max(initial=0) < 1e-4 and diff[start:].min() > 0.02, diff


def test_float16_checkpoint_stays_float16(tmp_path):
    """facebook/opt-* ship float16 weights: they load as float16, logits come out float32."""
    hf = tiny_family("opt", seed=6, do_layer_norm_before=False, word_embed_proj_dim=24)
    tokens = np.random.default_rng(6).integers(0, V, (1, 10)).astype(np.int32)
    expected = hf_logits(hf, tokens)
    hf.to(torch.float16).save_pretrained(tmp_path)
    m = load_model(tmp_path)
    assert all(x.dtype == jnp.float16 for x in jax.tree.leaves(m.params))
    pos = jnp.arange(10, dtype=jnp.int32)[None]
    logits, _ = jax.jit(m.forward)(m.params, jnp.asarray(tokens), pos, causal(1, 10), None)
    assert logits.dtype == jnp.float32
    rel = np.linalg.norm(np.asarray(logits) - expected) / np.linalg.norm(expected)
    assert rel < 1e-2, rel


# --- Llama's own: bfloat16, the writer from init_params, config forms and errors, axes ---


def test_bfloat16_checkpoint_stays_bfloat16(tmp_path, saved):
    model, _ = saved["llama_gqa_tied_linear"]
    tokens = np.random.default_rng(3).integers(0, LLAMA_V, (1, 10)).astype(np.int32)
    expected = hf_logits(model, tokens)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    model.to(torch.float32)
    m = load_model(tmp_path)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(m.params))
    pos = jnp.arange(10, dtype=jnp.int32)[None]
    logits, _ = jax.jit(m.forward)(m.params, jnp.asarray(tokens), pos, causal(1, 10), None)
    assert logits.dtype == jnp.float32
    rel = np.linalg.norm(np.asarray(logits) - expected) / np.linalg.norm(expected)
    assert rel < 3e-2, rel
    up = load_model(tmp_path, dtype="float32")
    assert up.params["embed"].dtype == jnp.float32


@pytest.mark.slow
def test_llama_save_checkpoint_from_init_params_loads_in_transformers(tmp_path):
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
        rope_scaling=RopeScaling("linear", 2.0),
    )  # fmt: skip
    params = llama.init_params(config, jax.random.key(0))
    params["final_norm"] = params["final_norm"] + 0.3  # distinguishable from the default init
    save_checkpoint(tmp_path, config, params)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "llama" and written["architectures"] == ["LlamaForCausalLM"]
    assert written["torch_dtype"] == "float32"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    assert model.config.rope_parameters["rope_type"] == "linear"
    tokens = np.random.default_rng(4).integers(0, 96, (2, 9)).astype(np.int32)
    pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    ours, _ = jax.jit(llama.forward, static_argnums=0)(
        config, params, jnp.asarray(tokens), pos, causal(2, 9), None
    )
    np.testing.assert_allclose(np.asarray(ours), hf_logits(model, tokens), atol=1e-4, rtol=1e-4)
    back = load_model(tmp_path)
    assert back.config == config
    jax.tree.map(np.testing.assert_array_equal, back.params, params)


def test_llama_config_from_both_rope_forms_and_back():
    old = {
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 3072,
        "num_hidden_layers": 2, "num_attention_heads": 12, "rope_theta": 5e5,
        "rope_scaling": {"type": "linear", "factor": 4.0}, "eos_token_id": [2, 7],
    }  # fmt: skip
    new = dict(old, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5})
    del new["rope_theta"], new["rope_scaling"]
    a, b = LlamaConfig.from_hf(old), LlamaConfig.from_hf(new)
    assert a == b and hash(a) == hash(b)
    assert a.rope_scaling == RopeScaling("linear", 4.0) and a.rope_theta == 5e5
    assert a.head_dim == 64 and a.num_key_value_heads == 12 and a.eos_token_id == (2, 7)
    hf = transformers.LlamaConfig(**a.to_hf())
    assert hf.rope_parameters["rope_type"] == "linear" and hf.rope_parameters["factor"] == 4.0
    assert LlamaConfig.from_hf(hf.to_dict()) == a
    assert LlamaConfig.from_hf(dict(old, rope_scaling=None)).rope_scaling is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "unsupported rope_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "opt"}, "model_type"),
        ({"num_attention_heads": 12, "num_key_value_heads": 5}, "multiple of"),
    ],
)
def test_llama_config_errors(change, message):
    base = {"vocab_size": 10, "hidden_size": 120, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 12}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf({**base, **change})


def test_llama_init_params_and_axes():
    config = LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4,
    )  # fmt: skip
    params = llama.init_params(config, jax.random.key(1), jnp.bfloat16)
    axes = llama.param_axes(config)
    assert jax.tree.structure(params) == jax.tree.structure(
        axes, is_leaf=lambda x: isinstance(x, tuple)
    )
    for p, a in zip(
        jax.tree.leaves(params), jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    ):
        assert p.ndim == len(a) and p.dtype == jnp.bfloat16
    assert params["layers"]["wq"].shape == (2, 16, 4, 4) and params["layers"]["wo"].shape == (
        2,
        4,
        4,
        16,
    )
    assert params["lm_head"].shape == (16, 50)
    np.testing.assert_array_equal(np.asarray(params["layers"]["attn_norm"], np.float32), 1.0)
    std = float(jnp.std(params["embed"].astype(jnp.float32)))
    assert 0.015 < std < 0.025
    derived = LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    assert derived.head_dim == 4 and derived == config


def test_llama_forward_rejects_bad_inputs():
    config = LlamaConfig(
        vocab_size=20, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=4,
    )  # fmt: skip
    params = llama.init_params(config, jax.random.key(0))
    fwd = jax.jit(forward_for(config))
    tok = jnp.zeros((1, 3), jnp.int32)
    pos = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="mask"):
        fwd(params, tok, pos, jnp.ones((1, 3, 4), bool), None)
    with pytest.raises(ValueError, match="positions"):
        fwd(params, tok, pos[:, :2], causal(1, 3), None)
    cache = init_cache(config, 1, 5)
    with pytest.raises(ValueError, match="mask"):
        fwd(params, tok, pos, causal(1, 3), cache)
    logits, _ = fwd(params, tok, pos, jnp.ones((1, 3, 8), bool), cache)
    assert logits.shape == (1, 3, 20)


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 24}),
        ("gpt2", {}),
        ("gpt_neo", {"attention_types": [[["local", "global"], 1]], "window_size": 3}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}),
        ("qwen3", {}),
        ("mistral", {}),
        ("gemma2", {}),
        ("gemma3_text", {}),
    ],
)
def test_save_checkpoint_loads_in_transformers(tmp_path, family, overrides):
    """Our writer (split, conv1d, transposes, config.json) read back by transformers."""
    hf = tiny_family(family, seed=5, **overrides)
    hf.save_pretrained(tmp_path / "hf")
    m = load_model(tmp_path / "hf")
    save_checkpoint(tmp_path / "ours", m.config, m.params)
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["model_type"] == family
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    ).eval()
    for (name, p), (_, q) in zip(hf.state_dict().items(), back.state_dict().items(), strict=True):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=name)
    again = load_model(tmp_path / "ours")
    assert again.config == m.config
    jax.tree.map(np.testing.assert_array_equal, again.params, m.params)


@pytest.mark.parametrize("family", ["opt", "gpt2", "gpt_neo"])
def test_params_shard_by_their_logical_axes(family):
    """Every logical axis (learned position tables included) has a sharding rule."""
    config_name, _, defaults = FAMILY_CONFIGS[family]
    extra = {"word_embed_proj_dim": 16} if family == "opt" else {}
    hf_config = getattr(transformers, config_name)(**defaults, **extra)
    config = FAMILIES[family].config_from_hf(hf_config.to_dict())
    assert isinstance(config, ModelConfig) and hash(config) == hash(dataclasses.replace(config))
    shapes = FAMILIES[family].param_shapes(config)
    specs = jax.tree.map(
        lambda s: ShardingRules().partition_spec(s[1], s[0], {"data": 2, "model": 4}),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple),
    )
    assert tuple(specs["positions"]) == (None, None)
    assert tuple(specs["layers"]["wq"]) == (None, None, "model", None)
    params = FAMILIES[family].init_params(config, jax.random.key(0))
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(
        lambda s: s[0], shapes, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2
    )


# --- End to end: sample() with OPT, GPT-2 and GPT-Neo/GPT-2 pairs --------------------------

PAIRS = {
    # name: (target family, draft family, index into test_decode.SETTINGS); one setting per pair
    # halves the rows, and the two settings are each covered by some pair.
    "opt": ("opt", "opt", 1),
    "gpt2": ("gpt2", "gpt2", 0),
    "gpt_neo_gpt2": ("gpt_neo", "gpt2", 1),  # the ASpS paper's cross-family pair, in miniature
    # The two RoPE decoders with the most of their own (soft-caps, windows, q/k norms, two RoPE
    # bases); Qwen2, Qwen3 and Mistral sample through the same decoder (greedy test below).
    "gemma2": ("gemma2", "gemma2", 0),
    "gemma3_text": ("gemma3_text", "gemma3_text", 1),
}
GREEDY_PROMPTS = [PROMPT, [4, 7, 9, 1, 0, 11, 6], [2]]
# Smaller than the parity models (the loop runs ROWS rows); VOCAB (12) tokens for the law.
SMALL = {
    "opt": {"hidden_size": 16, "ffn_dim": 32, "num_attention_heads": 2, "init_std": 0.4},
    "gpt2": {"n_embd": 16, "n_inner": 32, "n_head": 2, "initializer_range": 0.4},
    "gpt_neo": {"hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                "initializer_range": 0.4},
    # Windows of 4 (hf_checkpoints.FAMILY_CONFIGS): prompts of up to 7 tokens + 6 new pass them.
    **{family: {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
                "num_key_value_heads": 1, "initializer_range": 0.4}
       for family in ("qwen3", "mistral", "gemma2", "gemma3_text")},
    "qwen2": {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
              "num_key_value_heads": 1, "initializer_range": 0.4, "tie_word_embeddings": True,
              "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
}  # fmt: skip


def _write_pair(root, target_family, draft_family):
    """Large weights (std 0.4) give peaked laws, so drafts are sometimes rejected."""
    hf_t = write_tiny_family(
        root / "target", target_family, seed=0, vocab_size=VOCAB, **SMALL[target_family]
    )
    draft_kw = dict(noise_from=hf_t) if draft_family == target_family else {}
    write_tiny_family(
        root / "draft", draft_family, seed=1, vocab_size=VOCAB, **SMALL[draft_family], **draft_kw
    )
    return hf_t, load_model(root / "target"), load_model(root / "draft")


@pytest.mark.slow
@pytest.mark.optimized  # the law run outweighs its compile (tests/conftest.py)
@pytest.mark.parametrize("pair", list(PAIRS))
def test_sample_follows_the_target_law_and_greedy_is_generate(tmp_path, pair):
    """One compiled call per pair: ROWS law rows + greedy rows (temperature 0) side by side."""
    target_family, draft_family, which = PAIRS[pair]
    hf_t, target, draft = _write_pair(tmp_path, target_family, draft_family)
    setting, greedy = SETTINGS[which], len(GREEDY_PROMPTS)
    per_row = {
        name: np.concatenate([np.full(ROWS, setting[name]), np.full(greedy, default)])
        for name, default in (("temperature", 0.0), ("draft_temperature", 0.0), ("top_p", 1.0))
    }
    out = asps_jax.sample(
        target,
        draft,
        [PROMPT] * ROWS + GREEDY_PROMPTS,
        method="asps",
        key=jax.random.key(100),
        max_new_tokens=MAX_NEW,
        num_draft_tokens=2,
        eos_token_id=-1,
        top_k=np.concatenate([np.full(ROWS, setting["top_k"]), np.zeros(greedy, int)]),
        **per_row,
    )
    tokens = np.asarray(out.tokens)
    for g, prompt in enumerate(GREEDY_PROMPTS):
        assert tokens[ROWS + g].tolist() == _hf_greedy(hf_t, prompt, MAX_NEW), prompt
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (tokens[:ROWS, 0], tokens[:ROWS, 1]), 1)
    law = _exact_two_token_law(hf_t, setting["temperature"], setting["top_k"], setting["top_p"])
    pvalue = _chi_square_pvalue(counts, law)
    assert pvalue > 1e-3, f"{pair} {setting}: chi-square p-value {pvalue:.2e}"
    tps = np.asarray(out.stats["tokens_per_step"])[:ROWS]
    assert tps.mean() > 1.05  # drafts are accepted: the pair really speculates


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, methods",
    [
        ("qwen2", ("ar", "sps")),
        ("qwen3", ("ar", "sps")),
        ("mistral", ("ar", "sps")),
        # Their speculative greedy rows run beside the law rows (PAIRS above): one compile less.
        ("gemma2", ("ar",)),
        ("gemma3_text", ("ar",)),
    ],
)
def test_greedy_sample_is_generate(tmp_path, family, methods):
    """Temperature 0 through ``sample``, the target alone ("ar") and speculating ("sps" with a
    correlated draft of the same family): both are transformers' greedy ``generate``."""
    hf_t, target, draft = _write_pair(tmp_path, family, family)
    expected = [_hf_greedy(hf_t, prompt, MAX_NEW) for prompt in GREEDY_PROMPTS]
    for method in methods:
        out = asps_jax.sample(
            target,
            draft,
            GREEDY_PROMPTS,
            method=method,
            key=jax.random.key(0),
            max_new_tokens=MAX_NEW,
            num_draft_tokens=2,
            temperature=0.0,
            eos_token_id=-1,
        )
        assert np.asarray(out.tokens).tolist() == expected, method


NEW_CARDS = ["llama-3.1-8b", "llama-3.2-1b", "qwen2.5-7b", "qwen2.5-0.5b", "qwen3-8b",
             "qwen3-0.6b", "gemma-2-9b", "gemma-2-2b", "gemma-3-1b", "gemma-3-270m",
             "mistral-7b"]  # fmt: skip


@pytest.mark.parametrize("alias", NEW_CARDS)
def test_card_numbers_are_what_the_loaded_config_writes(alias):
    """``load_model`` compares a card's architecture with ``config.to_hf()`` of the checkpoint:
    a card key our config does not write back unchanged would refuse the real checkpoint. Pairs
    point at each other and pair by the rule (equal rows, or Qwen2.5's padded ones)."""
    card = json.loads((cards.MODELS_DIR / alias / "card.json").read_text())
    arch = card["architecture"]
    config = FAMILIES[arch["model_type"]].config_from_hf(arch)
    written = config.to_hf()
    assert {k: written[k] for k in arch} == arch
    assert card["fetch_command"] == f"hf download {card['repo_id']}"
    if "pair" in card:
        other = json.loads((cards.MODELS_DIR / card["pair"]["alias"] / "card.json").read_text())
        assert other["pair"] == {"role": card["role"], "alias": alias}
        assert other["architecture"]["model_type"] == arch["model_type"]
        rows = {arch["vocab_size"], other["architecture"]["vocab_size"]}
        assert len(rows) == 1 or rows == {152064, 151936}  # Qwen2.5: padded rows, masked


# Published config.json forms (transformers 4 keys), trimmed to what the ports read.
PUBLISHED = {
    "qwen2": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
              "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "rope_theta": 1000000.0, "sliding_window": 131072,
              "use_sliding_window": False, "max_window_layers": 21, "tie_word_embeddings": True},
    "gemma2": {"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304,
               "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
               "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "hidden_act": "gelu_pytorch_tanh",
               "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 10000.0},
    "gemma3_text": {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 3840,
                    "intermediate_size": 15360, "num_hidden_layers": 48,
                    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                    "query_pre_attn_scalar": 256, "sliding_window": 1024,
                    "sliding_window_pattern": 6, "rope_theta": 1000000.0,
                    "rope_local_base_freq": 10000.0,
                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
}  # fmt: skip


@pytest.mark.parametrize("family", list(PUBLISHED))
def test_published_config_forms_read_like_transformers(family):
    """Windows per layer, RoPE bases and scaling as transformers' own config class reads them."""
    d = PUBLISHED[family]
    ours = FAMILIES[family].config_from_hf(d)
    name = {"qwen2": "Qwen2Config", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig"}
    theirs = getattr(transformers, name[family])(**d)
    windows = [
        theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types
    ]
    assert [ours.window(i) for i in range(ours.num_hidden_layers)] == windows
    rope = getattr(theirs, "rope_parameters", None) or {}
    for i, layer_type in enumerate(theirs.layer_types):
        params = rope.get(layer_type, rope)
        theta, scaling = ours.rope(i)
        assert theta == params["rope_theta"]
        assert (scaling.factor if scaling else 1.0) == params.get("factor", 1.0)


def test_registry_checks_the_family_contract():
    assert list(FAMILIES) == [
        "llama", "opt", "gpt2", "gpt_neo", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text"
    ]  # fmt: skip
    with pytest.raises(TypeError, match=r"model family 'layers' lacks \['MODEL_TYPE'"):
        base._register(["layers"])  # a module of asps_jax.models that is not a family
