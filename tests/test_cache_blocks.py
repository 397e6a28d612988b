"""The length-aware attention of the accelerator path (``layers.attention`` with ``cache_len``:
the cache read in ``layers.CACHE_BLOCK``-slot blocks up to the last slot a query sees, an online
softmax): against a NumPy softmax attention over the whole cache, a non-finite new key included,
and the forwards of Llama, Gemma 2 and Qwen2 on the scan layout against the per-layer (CPU)
layout over a cache of three blocks filled into the second."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_checkpoints import FAMILY_CONFIGS
from test_scan_layout import prefill_then_chain

from asps_jax.kv_cache import init_cache
from asps_jax.models import base, layers, llama

B, T, NH, KVH, H = 2, 3, 4, 2, 8
S = 3 * layers.CACHE_BLOCK
V = 96  # the vocabulary of hf_checkpoints.FAMILY_CONFIGS


def _reference(q, k, v, ck, cv, mask, scale):
    """Grouped-query softmax attention in float64 over ``[cache | new]`` keys (NumPy)."""
    q, k, v, ck, cv = (np.asarray(a, np.float64) for a in (q, k, v, ck, cv))
    keys = np.concatenate([np.swapaxes(ck, 1, 2), k], axis=1)  # [B, S+T, KVH, H]
    values = np.concatenate([np.swapaxes(cv, 1, 2), v], axis=1)
    keys, values = (np.repeat(a, NH // KVH, axis=2) for a in (keys, values))
    s = np.einsum("btnh,bsnh->bnts", q, keys) * scale
    s = np.where(np.asarray(mask)[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), values)


def test_blocked_attention_matches_a_numpy_softmax_over_the_whole_cache():
    ks = jax.random.split(jax.random.key(0), 5)
    q, ck, cv = (
        jax.random.normal(kk, s) for kk, s in zip(ks, [(B, T, NH, H), *[(B, KVH, S, H)] * 2])
    )
    k, v = (jax.random.normal(kk, (B, T, KVH, H)) for kk in ks[3:])
    lengths = np.array([70, 2 * layers.CACHE_BLOCK + 1])  # blocks 0-1 of row 0; 0-2 of row 1
    seen = np.arange(S)[None, None] < lengths[:, None, None]
    mask = np.concatenate(
        [
            np.broadcast_to(seen, (B, T, S)),
            np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T)),
        ],
        axis=-1,
    )
    bad_k = k.at[1, 1, 0, 3].set(jnp.nan)  # row 1's token 1 in KV head 0: seen by tokens 1, 2

    @jax.jit
    def run(k):
        n = layers.visible_cache_len(mask)
        return n, layers.attention(q, k, v, ck, cv, mask, 0.3, cache_len=n)

    n, got = run(k)
    assert int(n) == lengths.max()
    np.testing.assert_allclose(got, _reference(q, k, v, ck, cv, mask, 0.3), atol=2e-6)
    _, nan = run(bad_k)
    poisoned = np.zeros((B, T, NH), bool)
    poisoned[1, 1:, : NH // KVH] = True  # the queries that see it, in its head's group
    np.testing.assert_array_equal(np.isnan(nan).any(-1), poisoned)
    np.testing.assert_allclose(nan[~poisoned], got[~poisoned], atol=2e-6)


# Gemma 2: soft-capped scores and alternating sliding layers; Qwen2: a window from layer 1 on.
DECODERS = {
    "gemma2": {},
    "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
}


def _model(case: str):
    if case == "llama":
        config = llama.LlamaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=NH, num_key_value_heads=KVH, initializer_range=0.2,
        )  # fmt: skip
        return config, llama.init_params(config, jax.random.key(1))
    family = base.FAMILIES[case]
    hf = {**FAMILY_CONFIGS[case][2], "model_type": case, "num_hidden_layers": 2, **DECODERS[case]}
    config = family.config_from_hf(hf)
    return config, family.init_params(config, jax.random.key(1))


@pytest.mark.parametrize("case", ["llama", *DECODERS])
def test_the_scan_layout_reads_the_blocks_it_needs(case):
    """Scan layout (blocked attention) and per-layer layout (one pass over all slots) give the
    same logits and new keys over a cache filled to 70 of 192 slots."""
    config, stacked = _model(case)
    unrolled = base.prepare_params(config, stacked, scan=False)
    assert isinstance(unrolled["layers"], tuple)
    forward = base.forward_for(config, ())
    P = 70
    tokens = jax.random.randint(jax.random.key(2), (B, P + T), 0, V, jnp.int32)

    @jax.jit
    def run(params, cache):
        return prefill_then_chain(forward, params, cache, tokens, P)[1][:2]

    got = run(stacked, init_cache(config, B, S))
    want = run(unrolled, init_cache(config, B, S, per_layer=True))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_the_census_counts_a_named_data_dependent_loop_at_the_trips_it_is_given():
    """``hlo_census.census(trips=...)``: a ``while`` of data-dependent trip count under the
    ``cache_blocks`` scope is counted the given number of times (else once, and listed unknown)."""
    from asps_jax import hlo_census

    def f(x, n):
        with jax.named_scope("cache_blocks"):
            return jax.lax.fori_loop(0, n, lambda i, a: a + jnp.sin(a * i), x)

    text = jax.jit(f).lower(jnp.ones((256, 256)), 3).compile().as_text()
    once, thrice = hlo_census.census(text), hlo_census.census(text, trips={"cache_blocks": 3})
    assert once.unknown_trips == 1 and thrice.unknown_trips == 0
    assert [t for t, name in thrice.loops if "cache_blocks" in name] == [3]
    body = (thrice.traffic_bytes - once.traffic_bytes) / 2  # one trip's bytes
    assert body >= 2 * 256 * 256 * 4, body  # reads and writes the array at least once per trip
