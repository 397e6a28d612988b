"""KV cache commit and mask against a NumPy loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asps_jax import kv_cache
from asps_jax.kv_cache import CACHE_AXES, KVBlock, KVCache, cache_mask, commit, init_cache
from asps_jax.models import LlamaConfig

CONFIG = LlamaConfig(
    vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=2,
)  # fmt: skip


def reference_commit(k, lengths, new_k, nodes, num):
    """``k [L, B, KVH, S, H]`` <- ``new_k [L, B, T, KVH, H]``, one slot at a time."""
    k = k.copy()
    S = k.shape[3]
    for b in range(k.shape[1]):
        for j in range(num[b]):
            if lengths[b] + j < S:
                k[:, b, :, lengths[b] + j] = new_k[:, b, nodes[b, j]]
    return k, lengths + num


def _per_layer(cache: KVCache) -> KVCache:
    return KVCache(tuple(cache.k), tuple(cache.v), cache.lengths)


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per_layer"])
@pytest.mark.parametrize("row_loop", [False, True], ids=["scatter", "row_loop"])
@pytest.mark.parametrize("S", [10, 6, 4], ids=["fits", "clamped_window", "path_longer_than_cache"])
def test_commit_matches_numpy_loop(row_loop, S, per_layer):
    rng = np.random.default_rng(0)
    L, B, T, P = 3, 4, 6, 5
    KVH, H = 3, 2
    k = rng.normal(size=(L, B, KVH, S, H)).astype(np.float32)
    v = rng.normal(size=(L, B, KVH, S, H)).astype(np.float32)
    lengths = np.array([0, 3, 7, 8], np.int32) * S // 10  # rows 2, 3 overflow: dropped
    new_k = rng.normal(size=(L, B, T, KVH, H)).astype(np.float32)
    new_v = rng.normal(size=(L, B, T, KVH, H)).astype(np.float32)
    nodes = rng.integers(0, T, (B, P)).astype(np.int32)
    num = np.array([5, 0, 3, 4], np.int32)
    cache = KVCache(jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths))
    if per_layer:
        cache = _per_layer(cache)
    block = KVBlock(jnp.asarray(new_k), jnp.asarray(new_v))
    out = jax.jit(commit, static_argnames="row_loop")(cache, block, nodes, num, row_loop=row_loop)
    assert out.per_layer == per_layer and out.shape == (L, B, KVH, S, H)
    want_k, want_len = reference_commit(k, lengths, new_k, nodes, num)
    want_v, _ = reference_commit(v, lengths, new_v, nodes, num)
    np.testing.assert_array_equal(np.asarray(out.stacked()[0]), want_k)
    np.testing.assert_array_equal(np.asarray(out.stacked()[1]), want_v)
    np.testing.assert_array_equal(np.asarray(out.lengths), want_len)
    assert out.lengths.dtype == jnp.int32


def test_row_loop_none_loops_only_where_a_row_is_large(monkeypatch):
    """``row_loop=None``: the batch scatter for a cache of small rows, the row loop (a loop of
    dynamic updates, no scatter) once a row reaches ``ROW_LOOP_MIN_ROW_BYTES``; and
    ``row_loop_for`` never loops on a mesh or an accelerator."""
    cache = init_cache(CONFIG, 3, 8)  # a row: 3 layers * 2 heads * 8 slots * 2 dims * 4 bytes
    block = KVBlock(jnp.ones((3, 3, 2, 2, 2)), jnp.ones((3, 3, 2, 2, 2)))
    nodes, num = jnp.zeros((3, 2), jnp.int32), jnp.ones((3,), jnp.int32)

    def program():
        return str(jax.make_jaxpr(lambda c: commit(c, block, nodes, num, row_loop=None))(cache))

    def loops(jaxpr):  # fori_loop with a static trip count traces as a scan
        return "scan" in jaxpr or "while" in jaxpr

    small = program()
    assert "scatter" in small and not loops(small)
    monkeypatch.setattr(kv_cache, "ROW_LOOP_MIN_ROW_BYTES", 3 * 2 * 8 * 2 * 4)
    large = program()
    assert loops(large) and "scatter" not in large
    assert kv_cache.row_loop_for(None) is None and kv_cache.row_loop_for(object()) is False
    # An accelerator scatters in place; a loop there costs a round trip per row and layer.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert kv_cache.row_loop_for(None) is False


def test_init_cache_and_mask():
    cache = init_cache(CONFIG, batch_size=2, max_len=5, dtype=jnp.bfloat16)
    assert cache.k.shape == (3, 2, 2, 5, 2) == cache.v.shape and cache.k.dtype == jnp.bfloat16
    assert len(CACHE_AXES) == cache.k.ndim and cache.max_len == 5
    cache = KVCache(cache.k, cache.v, jnp.array([0, 3], jnp.int32))
    mask = np.asarray(cache_mask(cache, 2))
    assert mask.shape == (2, 2, 5)
    np.testing.assert_array_equal(mask[0], False)
    np.testing.assert_array_equal(mask[1], [[True, True, True, False, False]] * 2)
    leaves = jax.tree.leaves(cache)  # a pytree: usable as a jit argument / donated state
    assert len(leaves) == 3
    layered = init_cache(CONFIG, batch_size=2, max_len=5, dtype=jnp.bfloat16, per_layer=True)
    assert layered.per_layer and len(layered.k) == 3 and len(jax.tree.leaves(layered)) == 7
    assert layered.shape == cache.shape and layered.max_len == 5
    assert layered.k[0].shape == (2, 2, 5, 2) and layered.k[0].dtype == jnp.bfloat16
    assert layered.layer(1)[0] is layered.k[1] and layered.stacked()[0].shape == cache.k.shape


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per_layer"])
def test_take_rows_by_an_evenly_spaced_index_is_a_slice(per_layer):
    """The rows a gather takes, also where ``take_rows`` slices (a static ``np.arange``): a
    fresh cache sliced lowers to no gather (XLA would constant-fold a gather of the broadcast
    zeros element by element at compile time), other index arrays stay gathers."""
    rng = np.random.default_rng(1)
    k = rng.normal(size=(3, 7, 2, 4, 2)).astype(np.float32)
    cache = KVCache(jnp.asarray(k), jnp.asarray(-k), jnp.arange(7, dtype=jnp.int32))
    cache = _per_layer(cache) if per_layer else cache
    for rows in ([0, 2, 4, 6], [1, 4], [5], [0, 1, 2, 3, 4, 5, 6], [0, 0, 1, 1], [3, 1], [0, 2, 3]):
        got = cache.take_rows(np.asarray(rows))
        np.testing.assert_array_equal(np.stack(got.k) if per_layer else got.k, k[:, rows])
        np.testing.assert_array_equal(np.stack(got.v) if per_layer else got.v, -k[:, rows])
        np.testing.assert_array_equal(got.lengths, rows)

    def fresh(rows):
        return init_cache(CONFIG, 8, 4, per_layer=per_layer).take_rows(rows)

    every_second = jax.jit(lambda: fresh(np.arange(0, 8, 2))).lower().as_text()
    repeated = jax.jit(lambda: fresh(np.arange(8) // 2)).lower().as_text()
    assert "gather" not in every_second and "gather" in repeated


@pytest.mark.slow
def test_commit_casts_to_cache_dtype():
    cache = init_cache(CONFIG, 1, 4, jnp.bfloat16)
    block = KVBlock(jnp.ones((3, 1, 2, 2, 2), jnp.float32), jnp.ones((3, 1, 2, 2, 2), jnp.float32))
    out = commit(cache, block, jnp.array([[1, 0]], jnp.int32), jnp.array([2], jnp.int32))
    assert out.k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out.k[:, 0, :, :2], np.float32), 1.0)
    np.testing.assert_array_equal(np.asarray(out.k[:, 0, :, 2:], np.float32), 0.0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        init_cache(CONFIG, 0, 4)
    with pytest.raises(ValueError, match="max_len"):
        init_cache(CONFIG, 1, 0)
    cache = init_cache(CONFIG, 2, 4)
    block = KVBlock(jnp.zeros((3, 2, 3, 2, 2)), jnp.zeros((3, 2, 3, 2, 2)))
    with pytest.raises(ValueError, match="new_kv"):
        commit(
            cache,
            KVBlock(block.k[:, :1], block.v[:, :1]),
            jnp.zeros((2, 1), jnp.int32),
            jnp.zeros(2, jnp.int32),
        )
    with pytest.raises(ValueError, match="nodes"):
        commit(cache, block, jnp.zeros((3, 1), jnp.int32), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="num"):
        commit(cache, block, jnp.zeros((2, 1), jnp.int32), jnp.zeros(3, jnp.int32))
