"""Parity of the JAX Llama port with transformers' PyTorch LlamaForCausalLM (tiny random models)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_checkpoints import tiny_llama

from asps_jax.kv_cache import commit, init_cache
from asps_jax.models import LlamaConfig, forward_for, load_model, save_checkpoint
from asps_jax.models.llama import forward, init_params, param_axes
from asps_jax.models.rope import RopeScaling

V, E, F, NH = 128, 64, 96, 4

CASES = {
    # name: (kv heads, layers, tied, rope_parameters, max_position_embeddings)
    "mha_odd_layers": (4, 3, False, {"rope_type": "default", "rope_theta": 10000.0}, 64),
    "gqa_tied_linear": (
        2,
        2,
        True,
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        64,
    ),
    # max_position_embeddings 8 < 12 tokens, so the dynamic NTK base growth is exercised.
    "mqa_dynamic": (1, 2, False, {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0}, 8),
    "gqa_llama3": (
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


def hf_model(case: str, seed: int = 0):
    kvh, layers, tied, rope, max_pos = CASES[case]
    return tiny_llama(
        seed=seed,
        vocab_size=V,
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


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each case written by transformers' save_pretrained once, with its model."""
    out = {}
    for case in CASES:
        model = hf_model(case)
        path = tmp_path_factory.mktemp(case)
        model.save_pretrained(path)
        out[case] = (model, path)
    return out


def causal(B, T):
    return jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))


@pytest.mark.parametrize("case", list(CASES))
def test_full_sequence_matches_transformers(saved, case):
    model, path = saved[case]
    m = load_model(path)
    assert m.params["embed"].dtype == jnp.float32
    assert ("lm_head" in m.params) == (not CASES[case][2])
    B, T = 2, 12
    tokens = np.random.default_rng(1).integers(0, V, (B, T)).astype(np.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, new_kv = jax.jit(m.forward)(
        m.params, jnp.asarray(tokens), positions, causal(B, T), None
    )
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), hf_logits(model, tokens), atol=1e-4, rtol=1e-4)
    kvh, layers = CASES[case][:2]
    assert new_kv.k.shape == (layers, B, T, kvh, E // NH)


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_then_decode_matches_full_forward(saved, case):
    """Prefill 4 tokens into the cache, then decode one at a time == HF full-sequence logits."""
    model, path = saved[case]
    m = load_model(path)
    # T < max_position_embeddings: HF's dynamic RoPE is then unscaled (and, being stateful, HF
    # resets frequencies grown by a longer earlier call only below that length).
    B, T, P = 2, 7, 4
    tokens = np.random.default_rng(2).integers(0, V, (B, T)).astype(np.int32)
    expected = hf_logits(model, tokens)
    cache = init_cache(m.config, B, T, jnp.float32)

    @jax.jit
    def run(cache, chunk, start):
        t = chunk.shape[1]
        pos = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (B, t))
        slots = jnp.arange(T)[None, None, :] < cache.lengths[:, None, None]
        mask = jnp.concatenate([jnp.broadcast_to(slots, (B, t, T)), causal(B, t)], axis=-1)
        logits, kv = m.forward(m.params, chunk, pos, mask, cache)
        nodes = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))
        return logits, commit(cache, kv, nodes, jnp.full((B,), t, jnp.int32))

    logits, cache = run(cache, jnp.asarray(tokens[:, :P]), 0)
    got = [np.asarray(logits)]
    for i in range(P, T):
        logits, cache = run(cache, jnp.asarray(tokens[:, i : i + 1]), i)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), expected, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [T, T])


def test_bfloat16_checkpoint_stays_bfloat16(tmp_path, saved):
    model, _ = saved["gqa_tied_linear"]
    tokens = np.random.default_rng(3).integers(0, V, (1, 10)).astype(np.int32)
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


def test_save_checkpoint_loads_in_transformers(tmp_path):
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
        rope_scaling=RopeScaling("linear", 2.0),
    )  # fmt: skip
    params = init_params(config, jax.random.key(0))
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
    ours, _ = jax.jit(forward, static_argnums=0)(
        config, params, jnp.asarray(tokens), pos, causal(2, 9), None
    )
    np.testing.assert_allclose(np.asarray(ours), hf_logits(model, tokens), atol=1e-4, rtol=1e-4)
    back = load_model(tmp_path)
    assert back.config == config
    jax.tree.map(np.testing.assert_array_equal, back.params, params)


def test_config_from_both_rope_forms_and_back():
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
def test_config_errors(change, message):
    base = {"vocab_size": 10, "hidden_size": 120, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 12}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf({**base, **change})


def test_init_params_and_axes():
    config = LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4,
    )  # fmt: skip
    params = init_params(config, jax.random.key(1), jnp.bfloat16)
    axes = param_axes(config)
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


def test_forward_rejects_bad_inputs():
    config = LlamaConfig(
        vocab_size=20, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=4,
    )  # fmt: skip
    params = init_params(config, jax.random.key(0))
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


def test_bench_model_smoke(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_model.py"
    spec = importlib.util.spec_from_file_location("bench_model", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    argv = ["--smoke", "--prefix", "12", "--repeats", "1", "--ar-tokens", "4", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["workload"] for r in rows] == ["prefill", "decode", "chain9", "ar_token"]
    assert all(r["ours_tok_s"] > 0 and r["torch_tok_s"] > 0 for r in rows)
    assert "| chain9 | 9 |" in capsys.readouterr().out
