"""A learned EAGLE-3 head (``draft="eagle3:PATH"``, asps_jax/drafters/head.py) on a tiny Llama.

References: transformers (the target's hidden states and laws), a float64 NumPy head read from the
EAGLE-3 files on disk (tests/head_reference.py: the draft laws), the float64 outcome laws of
tests/tabular.py and tests/multidraft_reference.py (exact enumeration), controls_reference.py
(a processed target law), Python's ``re`` (a constrained run), and the checkpoint tensors the
test writes itself. The head has random, peaked weights (std 0.5) over a draft vocabulary of
V - 1 tokens (token 3 has draft probability 0: the residual covers it), and reads the target's
layers (0, 2, 1) (out of order: the concatenation order is checked).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
import types

import head_reference
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tabular as tab
import torch
from controls_reference import warped_probs
from hf_checkpoints import char_tokenizer, write_tiny_family, write_tiny_llama
from multidraft_laws import node_law
from multidraft_reference import continuation_error, tree_law
from test_self_draft import PROMPT, VOCAB, N, _cli, _laws, _outcome

import asps_jax
from asps_jax import decode, decode_state, drafters, kv_cache, scoring
from asps_jax.drafters import head
from asps_jax.models.base import forward_for, run_params
from asps_jax.models.cards import MODELS_DIR
from asps_jax.sampler import prepare
from asps_jax.trees import build_chain_tree

LAYERS = (0, 2, 1)
D2T = [0, 1, 2, 4]  # the draft vocabulary: every target token but 3
OUT = 3  # the token outside it


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny 3-layer Llama of test_self_draft (transformers and ours) and one head saved in
    the EAGLE-3 layout, with its NumPy reference read back from the files."""
    root = tmp_path_factory.mktemp("head")
    hf = write_tiny_llama(
        root / "target", seed=3, vocab_size=VOCAB, num_hidden_layers=3, initializer_range=0.5
    )
    target = asps_jax.load_model(str(root / "target"))
    config = head.HeadConfig.for_target(target.config, len(D2T), layers=LAYERS)
    params = head.init_params(config, jax.random.key(1), target.params["embed"], D2T, std=0.5)
    folder = head.save_head(root / "head", config, params)
    embed = hf.model.embed_tokens.weight.detach().double().numpy()
    return types.SimpleNamespace(
        hf=hf,
        target=target,
        config=config,
        params=params,
        folder=folder,
        spec=head.PREFIX + str(folder),
        ref=head_reference.Head(folder, embed),
    )


# --- The target's features ----------------------------------------------------------------------


def _hf_streams(hf, text):
    """transformers' ``hidden_states[0..L-1]`` and the last layer's output before the final norm
    (what index L of our features is), each ``[T, E]`` float64."""
    captured = []
    hook = hf.model.norm.register_forward_pre_hook(lambda _, args: captured.append(args[0]))
    try:
        with torch.no_grad():
            states = hf(torch.tensor([list(text)]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    layers = hf.config.num_hidden_layers
    return [states[i][0].double().numpy() for i in range(layers)] + [
        captured[0][0].double().numpy()
    ]


FAST = {"xla_backend_optimization_level": 0}  # tiny programs: compiling dominates (CI time)
FEATURES = (0, 2, 1, 3)


def _want_features(hf, text, layers=FEATURES):
    streams = _hf_streams(hf, text)
    return np.concatenate([streams[i] for i in layers], axis=-1)


def test_features_of_a_forward_are_transformers_hidden_states(tiny):
    """``forward_for(config, layers)`` (stored layout: a scan over layers; run layout: unrolled)
    returns the streams entering the listed layers, in the listed order, equal to transformers'
    ``hidden_states[i]`` (index L: the last layer's output before the final norm)."""
    hf, target = tiny.hf, tiny.target
    forward = forward_for(target.config, FEATURES)
    text = PROMPT + [0, 3, 4]
    T = len(text)
    mask = jnp.tril(jnp.ones((1, T, T), bool))
    full = jax.jit(
        lambda p, t: forward(p, t, jnp.arange(T)[None], mask, None), compiler_options=FAST
    )
    with torch.no_grad():
        want_logits = hf(torch.tensor([text])).logits[0].numpy()
    for params in (target.params, run_params(target)):
        logits, _, features = full(params, jnp.asarray([text], jnp.int32))
        assert features.shape == (1, T, len(FEATURES) * target.config.hidden_size)
        want = _want_features(hf, text)
        np.testing.assert_allclose(np.asarray(features[0]), want, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.asarray(logits[0]), want_logits, atol=1e-4)


@pytest.mark.parametrize(
    "family", ["gpt2", "opt", "gpt_neo", "qwen2", "qwen3", "gemma2", "mistral"]
)
def test_every_family_returns_transformers_hidden_states(tmp_path, family):
    """Every family's forward (the stacked scans of GPT-2, OPT and GPT-Neo; the per-layer
    ``decoder.py`` families) returns transformers' ``hidden_states[i]`` as its features (i < L:
    transformers' last entry is after the final norm), and the logits are unchanged."""
    hf = write_tiny_family(tmp_path, family, seed=1)
    model = asps_jax.load_model(str(tmp_path))
    layers = (1, 0, 1)
    forward = forward_for(model.config, layers)
    text = [3, 1, 4, 1, 5, 9]
    T = len(text)
    mask = jnp.tril(jnp.ones((1, T, T), bool))
    logits, _, features = jax.jit(
        lambda p, t: forward(p, t, jnp.arange(T)[None], mask, None), compiler_options=FAST
    )(run_params(model), jnp.asarray([text], jnp.int32))
    with torch.no_grad():
        out = hf(torch.tensor([text]), output_hidden_states=True)
    want = np.concatenate([out.hidden_states[i][0].numpy() for i in layers], axis=-1)
    np.testing.assert_allclose(np.asarray(features[0]), want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits[0]), out.logits[0].numpy(), atol=1e-4)


@pytest.mark.slow
def test_a_head_drafts_for_a_gpt2_target(tmp_path):
    """A head made for a GPT-2 target (no RoPE, no RMS norm of its own: the head brings its
    own), saved and loaded in the EAGLE-3 layout, drafts greedily the tokens of transformers'
    greedy generate."""
    hf = write_tiny_family(tmp_path / "gpt2", "gpt2", seed=0)
    target = asps_jax.load_model(str(tmp_path / "gpt2"))
    config = head.HeadConfig.for_target(target.config)
    params = head.init_params(
        config, jax.random.key(0), target.params["embed"], np.arange(config.vocab_size)
    )
    head.save_head(tmp_path / "head", config, params)
    prompt = [3, 1, 4, 1, 5]
    out = asps_jax.sample(
        target, f"eagle3:{tmp_path / 'head'}", [prompt], seed=0, max_new_tokens=6,
        method="asps", num_draft_tokens=3, temperature=0.0, eos_token_id=-1,
    )  # fmt: skip
    with torch.no_grad():
        want = hf.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0
        )[0, len(prompt) :]
    assert np.asarray(out.tokens)[0].tolist() == want.tolist()


def test_features_of_a_cached_tree_scoring(tiny):
    """A prefilled cache (ragged prompts: the prefill's features) then a tree scoring pass (two
    chains of two): every node's features are those of its root path's full forward."""
    hf, target = tiny.hf, tiny.target
    forward = forward_for(target.config, FEATURES)
    tree = build_chain_tree(2, 2)
    prompts = [PROMPT, [2, 0]]
    paths = [[[0, 3], [4, 1]], [[3, 3], [1, 2]]]  # per row, per chain
    prompts_BP = jnp.asarray([PROMPT, [2, 0, 0]], jnp.int32)
    committed = jnp.asarray([len(p) - 1 for p in prompts], jnp.int32)
    tokens_BN = np.asarray([[p[-1]] + sum(c, []) for p, c in zip(prompts, paths)], np.int32)

    @functools.partial(jax.jit, compiler_options=FAST)
    def cached(params, prompts_BP, committed, tokens_BN):
        cache = kv_cache.init_cache(target.config, 2, 16, per_layer=True)
        cache, prompt_features = scoring.prefill_cache(
            forward, params, cache, prompts_BP, committed
        )
        valid = jnp.ones(tokens_BN.shape, bool)
        _, _, features = scoring.score_tree(forward, params, cache, tokens_BN, tree, valid)
        return prompt_features, features

    prompt_features, features = cached(
        run_params(target), prompts_BP, committed, jnp.asarray(tokens_BN)
    )
    for b, prompt in enumerate(prompts):
        m = len(prompt) - 1
        want = _want_features(hf, prompt[:m])
        np.testing.assert_allclose(prompt_features[b, :m], want, rtol=1e-5, atol=1e-4)
        for node in range(tree.num_nodes):
            path = [int(tokens_BN[b, j]) for j in np.flatnonzero(tree.ancestors[node])]
            want = _want_features(hf, prompt[:m] + path)[-1]
            np.testing.assert_allclose(features[b, node], want, rtol=1e-5, atol=1e-4)


def test_head_forward_is_the_numpy_head(tiny):
    """One head forward over a chain of entries (the prompt's fused features, then a hidden
    vector of the head's own) gives the NumPy head's draft logits and output hidden vectors; the
    draft law placed on the target's vocabulary is 0 outside the draft vocabulary."""
    ref, params = tiny.ref, tiny.params
    features = head_reference.hf_features(tiny.hf, PROMPT, ref.layers)
    own = np.random.default_rng(0).normal(size=(1, 16))
    hiddens = np.concatenate([ref.fused(features), own])
    tokens = PROMPT[1:] + [0, 3]
    want_logits, want_hidden = ref.entries(list(hiddens), tokens)
    T = len(tokens)

    @functools.partial(jax.jit, compiler_options=FAST)
    def run(params, features, own, tokens):
        fused = head.fuse(params, features[None])
        hidden = jnp.concatenate([fused, own[None].astype(fused.dtype)], axis=1)
        mask = jnp.tril(jnp.ones((1, T, T), bool))
        step = head.forward(
            tiny.config, params, hidden, tokens[None], jnp.arange(T)[None], mask, None
        )
        logits, out = step.logits, step.features
        return logits[0], out[0], head.target_logits(params, logits, VOCAB)[0]

    logits, out, placed = run(
        params, jnp.asarray(features, jnp.float32), jnp.asarray(own), jnp.asarray(tokens)
    )
    np.testing.assert_allclose(np.asarray(logits), want_logits, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(out), want_hidden, rtol=1e-5, atol=1e-4)
    laws = np.asarray(jax.nn.softmax(placed, axis=-1))
    want = np.stack([ref.law(row) for row in want_logits])
    np.testing.assert_allclose(laws, want, atol=1e-6)
    assert np.all(laws[:, OUT] == 0) and np.abs(want - 1 / VOCAB).max() > 0.3  # peaked


# --- The head's draft laws ----------------------------------------------------------------------

STEPS = 3


@functools.partial(jax.jit, static_argnums=0)
def _run(dec, target_params, draft_params, sampling, prompts, lengths, keys):
    """Prefill and STEPS steps in one program: each step's draft laws and tokens by root path
    (``_draft``, as the step draws them), then the emitted tokens and counts after the step."""
    state = decode_state.prefill(dec, target_params, draft_params, prompts, lengths, keys)
    nodes = dec.spec.tree.layout.chain_nodes

    def body(state, _):
        drafts = decode._draft(dec, draft_params, sampling, state)
        laws, drawn = drafts.logprobs_BNV[:, nodes], drafts.tokens_BN[:, nodes]
        before = state.num_generated
        state = decode._step(dec, target_params, draft_params, sampling, state)
        return state, (laws, drawn, before)

    state, out = jax.lax.scan(body, state, None, length=STEPS)
    return out, state.tokens, state.num_generated


LAW_PROMPTS = [PROMPT, PROMPT[:2], [3], [2, 2, 0, 1]] * 2
LAW_METHODS = {
    "chains": ("specinfer", dict(num_drafts=2, num_draft_tokens=N)),
    "tree": ("tv", dict(tree=(2, 2))),
}


@pytest.fixture(scope="module")
def law_runs(tiny):
    """``run(name)``: the laws, drawn tokens and counts of :func:`_run` for LAW_METHODS[name],
    and every checked law against the NumPy head (``[(row, step, text, got, want)]``); each run
    once for the module."""
    cache = {}

    def run(name):
        if name in cache:
            return cache[name]
        method, kw = LAW_METHODS[name]
        call = prepare(
            tiny.target, tiny.spec, LAW_PROMPTS, key=jax.random.key(5), max_new_tokens=12,
            method=method, eos_token_id=-1, **kw,
        )  # fmt: skip
        args = call.inputs.kwargs()
        names = ("target_params", "draft_params", "sampling", "prompts_BP", "prompt_lengths_B")
        (laws, drawn, before), tokens, count = _run(
            call.decoder, *(args[k] for k in names), args["row_keys_B"]
        )
        laws, drawn, before = np.exp(np.asarray(laws)), np.asarray(drawn), np.asarray(before)
        tokens, ref, checks = np.asarray(tokens), tiny.ref, []
        for b, prompt in enumerate(LAW_PROMPTS):
            for s in range(STEPS):
                text = prompt + tokens[b, : before[s, b]].tolist()
                features = head_reference.hf_features(tiny.hf, text, ref.layers)
                want = ref.draft_law(features, text)
                for k in range(laws.shape[2]):  # depth 0, then depth 1 after the path's token
                    deeper = ref.draft_law(features, text, [int(drawn[s, b, k, 0])])
                    checks.append((b, s, text, laws[s, b, k, :2], np.stack([want, deeper])))
        emitted = np.diff(np.concatenate([before, np.asarray(count)[None]]), axis=0)
        cache[name] = laws, emitted, checks
        return cache[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", LAW_METHODS)
def test_draft_laws_are_the_numpy_head(law_runs, name):
    """Step by step (ragged prompts), every root path's draft law at depths 0 and 1 is the
    NumPy head's law after the committed text (its features from transformers) and the path's
    first token: after the prompt's prefill, then after steps that accepted some draft tokens and
    rejected others (the accepted path's features from the scoring pass become the head's next
    entries). A one-token prompt's first law reads zero features (nothing is committed yet)."""
    laws, emitted, checks = law_runs(name)
    checked = 0
    for b, s, text, got, want in checks:
        if len(LAW_PROMPTS[b]) == 1 and s > 0:
            continue  # test_a_one_token_prompt_leaves_no_placeholder_entry
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"row {b} step {s} {text}")
        checked += 1
    assert checked >= 40
    assert np.all(laws[..., OUT] == 0)  # outside the draft vocabulary
    assert np.any(emitted == 1) and np.any(emitted == N + 1)  # rejected and fully accepted steps


@pytest.mark.slow
def test_a_one_token_prompt_leaves_no_placeholder_entry(law_runs):
    """After the first step of a one-token prompt, the head's laws are those after the
    committed text, as for any prompt (the zero-feature entry only stood in for the first law)."""
    _, _, checks = law_runs("chains")
    later = [(b, s, got, want) for b, s, _, got, want in checks if len(LAW_PROMPTS[b]) == 1 and s]
    assert later
    for b, s, got, want in later:
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"row {b} step {s}")


# --- Exactness ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_exact_enumeration_with_the_head(tiny):
    """The head's laws (the NumPy reference over every draft prefix) verified by SpS, ASpS and
    SpecInfer with two chains: the emitted string continued by the target has exactly the
    target's law, the token outside the draft vocabulary included."""
    target = _laws(tiny.hf, N + 1)
    draft = head_reference.tabular_laws(tiny.ref, tiny.hf, PROMPT, N)
    assert max(np.abs(t - d).max() for t, d in zip(target, draft)) > 0.2  # not the target
    assert all(np.all(d[..., OUT] == 0) for d in draft) and target[1][:, OUT].max() > 0.2
    want = tab.joint(target, N + 1)
    drafts, weight, q_rows, p_rows = tab.draft_enumeration(target, draft, N)
    for method in ("sps", "asps"):
        stop, full = _outcome(method, drafts, q_rows, p_rows, N)
        emitted = tab.emitted_law(stop, full, weight, drafts, p_rows[:, N], N)
        got = tab.continue_with_target(emitted, target)
        np.testing.assert_allclose(got, want, atol=1e-10, err_msg=method)
    law, _ = tree_law(node_law("specinfer", VOCAB), target, [draft, draft], N)
    assert continuation_error(law, target, N) <= 1e-10


ROWS = 6000
STAT_CASES = [
    ("sps", dict(num_draft_tokens=N)),
    ("asps", dict(num_draft_tokens=N)),
    ("specinfer", dict(num_drafts=2, num_draft_tokens=N)),
    ("is", dict(num_drafts=2, num_draft_tokens=N)),
    ("tv", dict(tree=(2, 2))),
    ("is_bv", dict(tree=(2, 2))),
    ("asps", dict(num_draft_tokens=N, temperature=0.7, top_k=3)),
]
STAT_IDS = [m for m, _ in STAT_CASES[:-1]] + ["asps-controls"]
WARP = ("temperature", "top_k")


def _processed_laws(hf, depth, warp) -> list[np.ndarray]:
    """``_laws`` through controls_reference.warped_probs (temperature, top-k)."""
    if not warp:
        return _laws(hf, depth)
    out = []
    for i in range(depth):
        prefixes = list(np.ndindex(*(VOCAB,) * i))
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(x) for x in prefixes])).logits[:, -1]
        laws = [warped_probs(row, **warp) for row in logits.double().numpy()]
        out.append(np.stack(laws).reshape((VOCAB,) * i + (VOCAB,)))
    return out


@pytest.mark.slow
@pytest.mark.optimized  # the law run outweighs its compile (tests/conftest.py)
@pytest.mark.parametrize("method, kw", STAT_CASES, ids=STAT_IDS)
def test_statistical_law(tiny, method, kw):
    """ROWS rows (one jitted loop) drafted by the head: the first three tokens against
    transformers' exact (processed) law (chi-square), and the draft was used."""
    out = asps_jax.sample(
        tiny.target,
        tiny.spec,
        [PROMPT] * ROWS,
        key=jax.random.key(11),
        max_new_tokens=3,
        method=method,
        eos_token_id=-1,
        **kw,
    )
    tokens = np.asarray(out.tokens)
    assert np.all(np.asarray(out.lengths) == 3)
    index = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
    warp = {k: v for k, v in kw.items() if k in WARP}
    law = tab.joint(_processed_laws(tiny.hf, 3, warp), 3)
    pvalue = tab.chi_square_pvalue(index, VOCAB**3, law)
    assert pvalue > 1e-3, f"{method} {kw}: chi-square p-value {pvalue:.2e}"
    assert np.any(tokens == OUT)  # the residual emits the token the head never drafts
    assert np.mean(np.asarray(out.stats["tokens_per_step"])) > 1.3  # measured 1.55 to 1.9


# --- Checkpoints --------------------------------------------------------------------------------


def test_save_then_load_gives_the_same_head(tiny, tmp_path):
    """save_head -> load_head: every parameter, the vocabulary map and the config back as they
    were (the embedding the target's, or the head's own when saved with it); the files are the
    EAGLE-3 layout (d2t as int64 offsets, t2d the draft vocabulary's mask)."""
    from safetensors.numpy import load_file

    loaded = head.load_head(tiny.folder, tiny.target)
    assert loaded.config == tiny.config
    assert set(loaded.params) == set(tiny.params)
    for name, a in tiny.params.items():
        np.testing.assert_array_equal(np.asarray(loaded.params[name]), np.asarray(a), name)
    files = load_file(tiny.folder / head.WEIGHTS_FILE)
    np.testing.assert_array_equal(files["d2t"], np.asarray(D2T) - np.arange(len(D2T)))
    assert files["d2t"].dtype == np.int64
    np.testing.assert_array_equal(files["t2d"], np.isin(np.arange(VOCAB), D2T))
    assert "embed_tokens.weight" not in files
    raw = json.loads((tiny.folder / head.CONFIG_FILE).read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 4
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    # With its own embedding (a head trained with one).
    own = dict(tiny.params, embed=tiny.params["embed"] * 2.0)
    folder = head.save_head(tmp_path / "own", tiny.config, own, embed=True)
    again = head.load_head(folder, tiny.target)
    np.testing.assert_array_equal(np.asarray(again.params["embed"]), np.asarray(own["embed"]))
    assert drafters.draft_model(tiny.target, tiny.spec) is drafters.draft_model(
        tiny.target, tiny.spec
    )  # loaded once per target and path


def _eagle3_files(folder, tensors: dict, config: dict) -> None:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))


def _eagle3_checkpoint(rng, *, draft_vocab=3, layers=(0, 1, 2)):
    """The tensors and config.json of an EAGLE-3 head for the tiny Llama, written out here from
    the layout (SpecForge / the EAGLE repository), not through asps_jax."""
    E, F, NH, KVH, H = 16, 32, 4, 2, 4
    shapes = {
        "fc.weight": (E, len(layers) * E),
        "midlayer.input_layernorm.weight": (E,),
        "midlayer.hidden_norm.weight": (E,),
        "midlayer.self_attn.q_proj.weight": (NH * H, 2 * E),
        "midlayer.self_attn.k_proj.weight": (KVH * H, 2 * E),
        "midlayer.self_attn.v_proj.weight": (KVH * H, 2 * E),
        "midlayer.self_attn.o_proj.weight": (E, NH * H),
        "midlayer.post_attention_layernorm.weight": (E,),
        "midlayer.mlp.gate_proj.weight": (F, E),
        "midlayer.mlp.up_proj.weight": (F, E),
        "midlayer.mlp.down_proj.weight": (E, F),
        "norm.weight": (E,),
        "lm_head.weight": (draft_vocab, E),
    }
    tensors = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
    ids = np.array([0, 2, 4][:draft_vocab])
    tensors["d2t"] = (ids - np.arange(draft_vocab)).astype(np.int64)
    tensors["t2d"] = np.isin(np.arange(VOCAB), ids)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": E,
        "intermediate_size": F,
        "num_attention_heads": NH,
        "num_key_value_heads": KVH,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 5000.0,
        "max_position_embeddings": 64,
        "vocab_size": VOCAB,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": E,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)},
    }
    return tensors, config, ids


def test_an_eagle3_checkpoint_written_here_loads(tiny, tmp_path):
    """A head in the EAGLE-3 layout written by the test (safetensors + config.json): its
    parameters are the tensors written, d2t's offsets decode to absolute target ids, the config
    reads the layers, norms' eps, RoPE theta and head_dim (hidden / heads when absent)."""
    tensors, config, ids = _eagle3_checkpoint(np.random.default_rng(0), layers=(2, 0, 1))
    _eagle3_files(tmp_path / "ckpt", tensors, config)
    loaded = head.load_head(tmp_path / "ckpt", tiny.target)
    c = loaded.config
    assert c.feature_layers == (2, 0, 1) and c.draft_vocab_size == 3 and c.vocab_size == VOCAB
    assert (c.rms_norm_eps, c.rope_theta, c.head_dim) == (1e-5, 5000.0, 4)
    np.testing.assert_array_equal(np.asarray(loaded.params["d2t"]), ids)
    for ours, name in head_reference.NAMES.items():
        np.testing.assert_array_equal(np.asarray(loaded.params[ours]), tensors[name], ours)
    embed = np.asarray(tiny.target.params["embed"])
    np.testing.assert_array_equal(np.asarray(loaded.params["embed"]), embed)
    # No eagle_config: EAGLE-3's default layers (low, middle, high) of a 3-layer target.
    del config["eagle_config"]
    tensors["fc.weight"] = tensors["fc.weight"][:, :48]
    _eagle3_files(tmp_path / "default", tensors, config)
    assert head.load_head(tmp_path / "default", tiny.target).config.feature_layers == (1, 1, 2)


@pytest.mark.parametrize("kind", ["bf16 safetensors", "pytorch_model.bin"])
def test_bf16_and_bin_checkpoints_load(tiny, tmp_path, kind):
    """EAGLE-3 heads as they are published: bfloat16 safetensors written by torch (SpecForge) and
    the EAGLE repository's ``pytorch_model.bin``, with int64 ``d2t`` and bool ``t2d``."""
    tensors, config, ids = _eagle3_checkpoint(np.random.default_rng(1))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    as_torch = {name: torch.from_numpy(np.asarray(a)) for name, a in tensors.items()}
    if kind == "bf16 safetensors":
        from safetensors.torch import save_file

        as_torch = {n: t.bfloat16() if t.is_floating_point() else t for n, t in as_torch.items()}
        save_file(as_torch, str(folder / "model.safetensors"))
    else:
        torch.save(as_torch, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(config))
    loaded = head.load_head(folder, tiny.target, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(loaded.params["d2t"]), ids)
    for ours, name in head_reference.NAMES.items():
        want = as_torch[name].float().numpy()
        np.testing.assert_array_equal(np.asarray(loaded.params[ours]), want, ours)


def test_default_feature_layers():
    """EAGLE-3's (vLLM / SpecForge) defaults: (2, L // 2, L - 3) from 8 layers up."""
    assert head.default_feature_layers(32) == (2, 16, 29)
    assert head.default_feature_layers(8) == (2, 4, 5)
    assert head.default_feature_layers(3) == (1, 1, 2)


# --- One-line errors ----------------------------------------------------------------------------


def _variant(tiny, tmp_path, *, tensors=None, config=None, drop=(), raw=None):
    """A copy of the fixture's head with tensors / config entries replaced (None: removed)."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "variant"
    shutil.copytree(tiny.folder, folder)
    weights = load_file(folder / head.WEIGHTS_FILE)
    cfg = json.loads((folder / head.CONFIG_FILE).read_text())
    if tensors or drop:
        weights = {k: v for k, v in {**weights, **(tensors or {})}.items() if k not in drop}
        save_file(weights, str(folder / head.WEIGHTS_FILE))
    if config:
        cfg.update(config)
        (folder / head.CONFIG_FILE).write_text(json.dumps(cfg))
    for name, data in (raw or {}).items():
        (folder / name).write_bytes(data)
    return folder


def _offsets(ids):
    return np.asarray(ids, np.int64) - np.arange(len(ids))


def _field(name, got, low=1):
    return rf"config.json: field '{name}' must be an integer >= {low}, got {re.escape(str(got))}$"


FOR_ANOTHER = "it was trained for another target"
D2T_RANGE = r"'d2t' must map each of the 4 draft ids to a target id in \[0, 5\)"
BAD_HEADS = [
    (
        "no_folder",
        {},
        r"model.safetensors \(or pytorch_model.bin\), found no such folder",
    ),
    ("no_weights", {}, r"expected an EAGLE-3 head folder .*found \['config.json'\]"),
    ("not_json", dict(raw={"config.json": b"{'hidden_size': 16"}), "config.json is not valid JSON"),
    pytest.param(
        "json_list",
        dict(raw={"config.json": b"[16, 32]"}),
        "config.json.*(object|EAGLE-3)",
    ),
    (
        "architecture",
        dict(config={"architectures": ["LlamaForCausalLM"]}),
        r"config.json: not an EAGLE-3 head \(architectures \['LlamaForCausalLM'\]\); expected "
        "'LlamaForCausalLMEagle3'",
    ),
    ("two_layers", dict(config={"num_hidden_layers": 2}), "an EAGLE-3 head has one layer, got 2"),
    ("no_vocab", dict(config={"vocab_size": None}), "config.json: not a valid EAGLE-3 head config"),
    (
        "missing_tensor",
        dict(drop=("midlayer.self_attn.k_proj.weight",)),
        "the weights lack tensor 'midlayer.self_attn.k_proj.weight'",
    ),
    (
        "shape",
        dict(tensors={"fc.weight": np.zeros((16, 32), np.float32)}),
        r"tensor 'fc.weight' has shape \[16, 32\], the config says \[16, 48\]",
    ),
    (
        "corrupt",
        dict(raw={"model.safetensors": np.random.default_rng(0).bytes(300)}),
        "model.safetensors is (truncated|corrupt)",
    ),
    ("no_d2t", dict(drop=("d2t",)), r"lack 'd2t' \(the draft-to-target map\)"),
    ("d2t_outside", dict(tensors={"d2t": _offsets([0, 1, 2, 5])}), D2T_RANGE),
    ("d2t_negative", dict(tensors={"d2t": _offsets([-1, 1, 2, 4])}), D2T_RANGE),
    ("d2t_twice", dict(tensors={"d2t": _offsets([0, 1, 1, 4])}), "maps two draft ids to one"),
    pytest.param(
        "d2t_length",
        dict(tensors={"d2t": _offsets([0, 1, 2])}),
        r"'d2t' must be 4 integer offsets",
    ),
    (
        "embed_shape",
        dict(tensors={"embed_tokens.weight": np.zeros((6, 16), np.float32)}),
        r"'embed_tokens.weight' has shape \[6, 16\], the target's embedding \[5, 16\]",
    ),
    (
        "width",
        dict(config={"target_hidden_size": 32}),
        f"reads features of width 32, the target .* has hidden size 16; {FOR_ANOTHER}",
    ),
    (
        "vocab",
        dict(config={"vocab_size": 6}),
        f"maps to a vocabulary of 6 tokens, the target .* has 5; {FOR_ANOTHER}",
    ),
    (
        "layers",
        dict(config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}}),
        r"reads target layers \[0, 1, 3\], the target has 3 \(ids 0 .. 2\)",
    ),
    # Issue 66: wrong-typed config fields, t2d, integer weights (asps_jax/models/eagle3_checks.py).
    ("zero_heads", dict(config={"num_attention_heads": 0}), _field("num_attention_heads", 0)),
    ("str_hidden", dict(config={"hidden_size": "16"}), _field("hidden_size", "'16'")),
    ("bool_kv", dict(config={"num_key_value_heads": True}), _field("num_key_value_heads", True)),
    ("draft_vocab_0", dict(config={"draft_vocab_size": 0}), _field("draft_vocab_size", 0)),
    ("draft_vocab_neg", dict(config={"draft_vocab_size": -5}), _field("draft_vocab_size", -5)),
    (
        "context_0",
        dict(config={"max_position_embeddings": 0}),
        _field("max_position_embeddings", 0),
    ),
    (
        "kv_heads",
        dict(config={"num_key_value_heads": 3}),
        r"config.json: field 'num_attention_heads' \(4\) must be a multiple of 'num_key_value_",
    ),
    (
        "rope_list",
        dict(config={"rope_scaling": [1, 2]}),
        r"config.json: field 'rope_scaling' must be an object or null, got \[1, 2\]",
    ),
    (
        "rope_no_factor",
        dict(config={"rope_scaling": {"rope_type": "linear"}}),
        r"config.json: field 'rope_scaling': rope_scaling of type 'linear' needs a 'factor'",
    ),
    (
        "eps",
        dict(config={"rms_norm_eps": "tiny"}),
        r"config.json: field 'rms_norm_eps' must be a number > 0, got 'tiny'",
    ),
    (
        "layer_ids",
        dict(config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, "x", 1]}}),
        r"field 'eagle_config.eagle_aux_hidden_state_layer_ids' must be an integer >= 0, got 'x'",
    ),
    (
        "t2d_contradicts",
        dict(tensors={"t2d": np.array([1, 1, 1, 1, 0], bool)}),
        r"'t2d' contradicts 'd2t' at target id 3 \('t2d' says True, 'd2t' does not map",
    ),
    (
        "t2d_length",
        dict(tensors={"t2d": np.ones(4, bool)}),
        r"'t2d' must be 5 booleans \(one per target id\), got bool of shape \[4\]",
    ),
    (
        "int32_weight",
        dict(tensors={"fc.weight": np.ones((16, 48), np.int32)}),
        r"tensor 'fc.weight' is int32; a head's weights must be floating point",
    ),
]


@pytest.mark.parametrize(
    "case, change, match", BAD_HEADS, ids=[getattr(c, "values", c)[0] for c in BAD_HEADS]
)
def test_bad_head_is_a_one_line_error(tiny, tmp_path, case, change, match):
    if case == "no_folder":
        folder = tmp_path / "nothing here"
    elif case == "no_weights":
        folder = tmp_path / "config only"
        folder.mkdir()
        shutil.copy(tiny.folder / head.CONFIG_FILE, folder)
    else:
        folder = _variant(tiny, tmp_path, **change)
    with pytest.raises(ValueError, match=match) as err:
        asps_jax.sample(tiny.target, head.PREFIX + str(folder), [PROMPT], seed=0, max_new_tokens=2)
    assert "\n" not in str(err.value) and str(folder) in str(err.value)


def test_a_head_capping_the_context_is_named(tiny, tmp_path):
    """A head whose config.json allows 8 positions: the call past them names the head's file and
    field, not only 'the model context' (issue 66)."""
    folder = _variant(tiny, tmp_path, config={"max_position_embeddings": 8})
    match = (
        r"exceeds the model context of 8 positions \(the draft's, draft='eagle3:.*': "
        r"config.json max_position_embeddings\)"
    )
    with pytest.raises(ValueError, match=match):
        asps_jax.sample(tiny.target, head.PREFIX + str(folder), [PROMPT], seed=0, max_new_tokens=6)


@pytest.mark.slow  # one compile of the head's sampling loop (both cases share it)
@pytest.mark.parametrize("tensor", ["fc.weight", "norm.weight"])
def test_a_non_finite_head_raises_as_a_draft_model_does(tiny, tmp_path, tensor):
    """One NaN in ``fc`` (every draft logit NaN) or an inf norm scale: NonFiniteLogitsError at
    the first token, as a NaN draft model gives, not drafts silently switched off (issue 66)."""
    from safetensors.numpy import load_file

    weights = load_file(tiny.folder / head.WEIGHTS_FILE)
    bad = weights[tensor].copy()
    bad.flat[0] = np.nan if tensor == "fc.weight" else np.inf
    folder = _variant(tiny, tmp_path, tensors={tensor: bad})
    with pytest.raises(asps_jax.NonFiniteLogitsError, match=r"positions \[0\]") as err:
        asps_jax.sample(tiny.target, head.PREFIX + str(folder), [PROMPT], seed=0, max_new_tokens=2)
    assert int(err.value.output.lengths[0]) == 0


def test_bad_use_of_a_head_is_a_one_line_error(tiny):
    """'eagle3:' without a path, draft_stop (a draft model's option), and a target that is not a
    decoder (no hidden states to read)."""
    calls = [
        (dict(draft="eagle3:"), r"draft='eagle3:': give the head's folder"),
        (dict(draft_stop="confidence:0.5"), r"draft_stop: the confidence stop is an option of"),
    ]
    for kw, match in calls:
        kw = {"draft": tiny.spec, **kw}
        draft = kw.pop("draft")
        with pytest.raises(ValueError, match=match) as err:
            asps_jax.sample(tiny.target, draft, [PROMPT], seed=0, max_new_tokens=2, **kw)
        assert "\n" not in str(err.value), kw
    own = asps_jax.models.own_model(
        lambda *a: None, {"w": jnp.ones((4, 4))}, vocab_size=VOCAB, num_hidden_layers=3,
        num_key_value_heads=1, head_dim=4, max_position_embeddings=64,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"a learned head needs a decoder target, got OwnConfig"):
        asps_jax.sample(own, tiny.spec, [PROMPT], seed=0, max_new_tokens=2)


# --- Composition --------------------------------------------------------------------------------

KW = dict(max_new_tokens=5, method="asps", num_draft_tokens=N, eos_token_id=-1)
RAGGED = [PROMPT, [3], [2, 2, 0, 1]]


@pytest.mark.slow
def test_n_samples_are_rows_of_their_own(tiny):
    """n = 2 (one prefill forward per prompt, its features shared by the prompt's rows) gives the
    rows of the same prompts repeated, each with its sample's key fold_in(k_p, i)."""
    keys = jax.random.split(jax.random.key(3), 2)
    out = asps_jax.sample(tiny.target, tiny.spec, RAGGED[1:], n=2, key=keys, **KW)
    rows = jnp.stack([jax.random.fold_in(k, i) for k in keys for i in range(2)])
    repeated = [p for p in RAGGED[1:] for _ in range(2)]
    want = asps_jax.sample(tiny.target, tiny.spec, repeated, key=rows, **KW)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))
    assert len({tuple(r) for r in np.asarray(out.tokens).tolist()}) > 2


@pytest.mark.slow
def test_continuous_batching_gives_the_one_batch_tokens(tiny):
    """batch_size=2 over three ragged prompts (refills with the prompts' features) gives each
    prompt the tokens of the one-batch call (the slots' contract, test_slots.py)."""
    key = jax.random.key(4)
    want = asps_jax.sample(tiny.target, tiny.spec, RAGGED, key=key, **KW)
    got = asps_jax.sample(tiny.target, tiny.spec, RAGGED, key=key, batch_size=2, **KW)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))


def _constrained(tiny, pattern):
    target = dataclasses.replace(tiny.target, tokenizer=char_tokenizer("abcd"))
    out = asps_jax.sample(
        target, tiny.spec, [PROMPT] * 16, key=jax.random.key(2), regex=pattern, **KW
    )
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    assert np.all(lengths == KW["max_new_tokens"])
    for row in tokens:
        assert re.fullmatch(pattern, "".join("_abcd"[t] for t in row)), row
    assert np.mean(np.asarray(out.stats["tokens_per_step"])) > 1.0  # the draft was used
    return tokens


@pytest.mark.slow
def test_regex_constrained_rows_match(tiny):
    """A regex through the head's drafts (its laws constrained like every drafter's): every row
    matches it."""
    tokens = _constrained(tiny, r"[ab][abd]*")
    assert len({tuple(row) for row in tokens.tolist()}) > 1


@pytest.mark.slow
def test_a_constraint_allowing_only_tokens_the_head_never_drafts(tiny):
    """The regex forces 'c' (token 3, outside the draft vocabulary) second: the head's
    constrained law there has no mass, so its chain ends before it and the target's residual
    emits it; every row matches."""
    tokens = _constrained(tiny, r"[ab]c[bcd]*")
    assert np.all(tokens[:, 1] == OUT)


# --- The command line ---------------------------------------------------------------------------


def test_cli_bad_head_config_is_one_line(capsys, tmp_path):
    """A head config.json with num_attention_heads 0 or a list for rope_scaling: exit 2, one line
    naming the file and the field, no traceback (issue 66, item 6)."""
    cli = _cli()
    for field, value in (("num_attention_heads", 0), ("rope_scaling", [1, 2])):
        folder = tmp_path / field
        shutil.copytree(MODELS_DIR / "tinyshakespeare-eagle3", folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, field: value}))
        assert cli.main(["--max-new-tokens", "2", "--draft", head.PREFIX + str(folder)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"sample.py: error: draft={head.PREFIX}{folder}: config.json: field "
                              f"'{field}' must be"), err  # fmt: skip
        assert "\n" not in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_eagle3_draft(capsys, tmp_path):
    """scripts/sample.py --draft eagle3:FOLDER with a head made for the bundled target (a draft
    vocabulary of half its tokens); a missing folder is a one-line error (exit 2)."""
    config = json.loads((MODELS_DIR / "tinyshakespeare-target" / "config.json").read_text())
    target_config = types.SimpleNamespace(**config)
    c = head.HeadConfig.for_target(target_config, 1024)
    embed = jnp.zeros((config["vocab_size"], config["hidden_size"]))
    params = head.init_params(c, jax.random.key(0), embed, np.arange(0, 2048, 2))
    folder = head.save_head(tmp_path / "head", c, params)
    cli = _cli()
    argv = ["--max-new-tokens", "6", "--num-draft-tokens", "2", "--method", "sps", "--json"]
    assert cli.main(argv + ["--draft", head.PREFIX + str(folder)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["new_tokens"] == 6 and result["tokens_per_step"] >= 1.0
    assert cli.main(argv + ["--draft", head.PREFIX + str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"sample.py: error: draft={head.PREFIX}") and "\n" not in err
