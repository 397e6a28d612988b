"""The run layouts of Llama parameters (``llama.prepare_params``): same logits as transformers,
and the one each model of a call gets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_checkpoints import tiny_llama

from asps_jax import sampler
from asps_jax.kv_cache import commit, init_cache
from asps_jax.models import load_model
from asps_jax.models.base import run_params
from asps_jax.models.llama import prepare_params

V = 128
CASES = {  # name: (kv heads, layers, tied)
    "mha_3_layers": (4, 3, False),
    "gqa_tied": (2, 2, True),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    kvh, layers, tied = CASES[request.param]
    hf = tiny_llama(
        seed=3,
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kvh,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-5,
        norm_noise=0.1,
    )
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_model(path)


@pytest.mark.slow
def test_prepared_layout(pair):
    _, m = pair
    p = prepare_params(m.config, m.params)
    assert isinstance(p["layers"], tuple) and len(p["layers"]) == m.config.num_hidden_layers
    c = m.config
    E, NH, KVH, H, F = (
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.intermediate_size,
    )
    layer, stored = p["layers"][1], {k: np.asarray(a[1]) for k, a in m.params["layers"].items()}
    # [out, in] with the head axes merged: row n * H + h of wq is query head n, dimension h.
    for name, rows in (
        ("wq", NH * H),
        ("wk", KVH * H),
        ("wv", KVH * H),
        ("w_gate", F),
        ("w_up", F),
    ):
        assert layer[name].shape == (rows, E)
        np.testing.assert_array_equal(np.asarray(layer[name]), stored[name].reshape(E, -1).T)
    np.testing.assert_array_equal(np.asarray(layer["wo"]), stored["wo"].reshape(NH * H, E).T)
    np.testing.assert_array_equal(np.asarray(layer["w_down"]), stored["w_down"].T)
    for name in ("embed", "final_norm", "lm_head"):  # the stored arrays, not copies
        assert p.get(name) is m.params.get(name)
    assert prepare_params(m.config, p) is p  # idempotent
    assert run_params(m) is run_params(m)  # made once per model
    # The wide layout: each layer the stored [in, out] slice, head axes split (wq [E, NH, H]).
    wide = prepare_params(m.config, m.params, wide=True)
    assert len(wide["layers"]) == m.config.num_hidden_layers
    for name, want in stored.items():
        assert wide["layers"][1][name].shape == want.shape
        np.testing.assert_array_equal(np.asarray(wide["layers"][1][name]), want)
    assert wide["layers"][1]["wq"].shape == (E, NH, H)
    assert prepare_params(m.config, wide) is wide
    assert prepare_params(m.config, p, wide=True) is p  # a run layout is kept as it is
    assert run_params(m, wide=True) is run_params(m, wide=True)
    assert run_params(m, wide=True) is not run_params(m)  # one copy per layout


@pytest.mark.parametrize(
    ("method", "rows", "drafts", "target_wide", "draft_wide"),
    [
        ("ar", 1, 1, False, None),  # one token of one row per forward: [out, in]
        ("ar", 3, 1, True, None),
        ("asps", 1, 1, True, False),  # the target scores n + 1 tokens, the draft rolls one row
        ("asps", 2, 1, True, True),
        ("specinfer", 1, 2, True, True),  # two replicas of the draft: two rows per forward
    ],
)
def test_each_model_gets_the_layout_of_the_rows_it_multiplies(
    pair, method, rows, drafts, target_wide, draft_wide
):
    """``sampler.prepare`` hands the decoding loop each model's run layout by the rows one of
    its forwards multiplies (``wq`` ``[E, NH, H]`` wide, ``[NH * H, E]`` for one row)."""
    _, m = pair
    prepared = sampler.prepare(
        m, None if method == "ar" else m, [[1, 2, 3]] * rows, max_new_tokens=4, method=method,
        num_drafts=drafts, num_draft_tokens=2, key=jax.random.key(0),
    )  # fmt: skip
    inputs = prepared.inputs
    assert (inputs.target_params["layers"][0]["wq"].ndim == 3) == target_wide
    if draft_wide is None:
        assert inputs.draft_params is None
    else:
        assert (inputs.draft_params["layers"][0]["wq"].ndim == 3) == draft_wide


@pytest.mark.slow
@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked_cache", "per_layer_cache"])
@pytest.mark.parametrize("layout", ["run", "wide", "stored"])
def test_prefill_then_decode_matches_transformers(pair, layout, per_layer):
    """Prefill 5 tokens, then 3 one-token steps == HF full-sequence logits, for each parameter
    layout (the run layout's two orientations, the stored one) and either cache layout (the
    decode loop pairs the run layout with a per-layer cache)."""
    hf, m = pair
    B, T, P = 2, 8, 5
    tokens = np.random.default_rng(4).integers(0, V, (B, T)).astype(np.int32)
    with torch.no_grad():
        expected = hf(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
    params = {
        "run": lambda: prepare_params(m.config, m.params),
        "wide": lambda: prepare_params(m.config, m.params, wide=True),
        "stored": lambda: m.params,
    }[layout]()

    @jax.jit
    def run(params, cache, chunk, start):
        t = chunk.shape[1]
        pos = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (B, t))
        slots = jnp.arange(T)[None, None, :] < cache.lengths[:, None, None]
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (B, t, t))
        mask = jnp.concatenate([jnp.broadcast_to(slots, (B, t, T)), causal], axis=-1)
        logits, kv = m.forward(params, chunk, pos, mask, cache)
        nodes = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))
        return logits, commit(cache, kv, nodes, jnp.full((B,), t, jnp.int32))

    cache = init_cache(m.config, B, T, jnp.float32, per_layer=per_layer)
    logits, cache = run(params, cache, jnp.asarray(tokens[:, :P]), 0)
    got = [np.asarray(logits)]
    for i in range(P, T):
        logits, cache = run(params, cache, jnp.asarray(tokens[:, i : i + 1]), i)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), expected, atol=1e-4, rtol=1e-4)
    assert cache.per_layer == per_layer


def test_wrong_layer_count_is_a_clear_error(pair):
    _, m = pair
    p = prepare_params(m.config, m.params)
    bad = dict(p, layers=p["layers"][:-1])
    tokens = jnp.zeros((1, 2), jnp.int32)
    mask = jnp.ones((1, 2, 2), bool)
    with pytest.raises(ValueError, match="layers"):
        m.forward(bad, tokens, jnp.zeros((1, 2), jnp.int32), mask, None)
