"""A fixed-size KV cache with per-row lengths, and the commit of an accepted path into it.

The model forward never writes into the cache: it returns the keys/values of the tokens it scored
(a ``KVBlock``). After verification, ``commit`` copies only the accepted nodes into the cache, in
root-path order, so rows of one batch advance by different amounts while every shape stays fixed.
Slots at or beyond a row's length hold stale data and are always masked (``cache_mask``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax import platforms

# Logical axis names of the cache arrays (for mesh sharding rules). Heads before slots: attention
# reads each (row, head) as one contiguous [S, H] matrix, so the forward never transposes (copies)
# the cache, and the commit can update it in place inside the decode loop.
CACHE_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")


def _evenly_spaced_as_slice(rows, num_rows: int):
    """``rows`` as the slice it is when it is a static, increasing, evenly spaced index array
    (``np.arange(start, stop, step)``), else unchanged: the same rows either way. XLA simplifies a
    slice of a freshly made (broadcast) cache to a smaller broadcast, while it constant-folds a
    gather of one element by element at compile time (2 to 5 CPU-s per compile for the first rows
    of the K replicas of 20,000 rows: ``scoring.prefill_cache_grouped``)."""
    if not isinstance(rows, np.ndarray) or rows.ndim != 1 or rows.dtype.kind not in "iu":
        return rows
    if rows.size == 0 or rows[0] < 0 or rows[-1] >= num_rows:
        return rows
    step = int(rows[1] - rows[0]) if rows.size > 1 else 1
    if step < 1 or not np.array_equal(rows, rows[0] + step * np.arange(rows.size)):
        return rows
    return slice(int(rows[0]), int(rows[-1]) + 1, step)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys (after RoPE) and values, stacked ``[L, B, KVH, S, H]`` or per layer: a tuple of ``L``
    arrays ``[B, KVH, S, H]`` (``init_cache(per_layer=True)``). Inside a compiled forward that
    runs its layers one by one on XLA:CPU, layer ``i`` of a stacked cache is a copy of it on every
    call (XLA cannot alias a slice of a buffer); separate buffers are read in place. A scanned
    forward (an accelerator's layout, ``base.scan_layout_for``) reads a stacked cache as a scan
    input (``docs/design.md``).
    """

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    lengths: jax.Array  # int32[B], number of valid slots per row

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``(L, B, KVH, S, H)`` either way."""
        return (len(self.k), *self.k[0].shape) if self.per_layer else tuple(self.k.shape)

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def max_len(self) -> int:
        return int(self.shape[3])

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        """Layer ``i``'s ``(k, v)``, each ``[B, KVH, S, H]``."""
        return self.k[i], self.v[i]

    def take_rows(self, rows) -> KVCache:
        """The cache of rows ``rows`` (an index array, repeats allowed), in this layout."""
        rows = _evenly_spaced_as_slice(rows, int(self.lengths.shape[0]))
        if self.per_layer:
            k, v = tuple(x[rows] for x in self.k), tuple(x[rows] for x in self.v)
        else:
            k, v = self.k[:, rows], self.v[:, rows]
        return KVCache(k=k, v=v, lengths=self.lengths[rows])

    def stacked(self) -> tuple[jax.Array, jax.Array]:
        """``(k, v)`` stacked ``[L, B, KVH, S, H]`` (a copy when per layer), for a ``lax.scan``
        over the layers."""
        if self.per_layer:
            return jnp.stack(self.k), jnp.stack(self.v)
        return self.k, self.v


def map_layers(fn, a, *stacked):
    """``fn(a, *stacked)`` for an ``[L, ...]`` cache array ``a`` and ``[L, ...]`` arrays
    ``stacked``: on a stacked ``a`` as a whole; on a per-layer tuple layer by layer, each layer
    as ``[1, ...]`` (a reshape, not a copy) with the matching ``[1, ...]`` slices of ``stacked``.
    """
    if isinstance(a, tuple):
        return tuple(fn(x[None], *(s[i : i + 1] for s in stacked))[0] for i, x in enumerate(a))
    return fn(a, *stacked)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVBlock:
    """Keys/values of the T tokens of one forward, not yet in any cache."""

    k: jax.Array  # [L, B, T, KVH, H]
    v: jax.Array  # [L, B, T, KVH, H]


def init_cache(
    config, batch_size: int, max_len: int, dtype=jnp.float32, *, per_layer: bool = False
) -> KVCache:
    """An empty cache of ``max_len`` slots per row; ``per_layer``: one buffer per layer."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    shape = (batch_size, config.num_key_value_heads, max_len, config.head_dim)
    lengths = jnp.zeros((batch_size,), jnp.int32)
    if per_layer:
        layers = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_hidden_layers))
        return KVCache(k=layers, v=tuple(jnp.zeros(shape, dtype) for _ in layers), lengths=lengths)
    zeros = jnp.zeros((config.num_hidden_layers, *shape), dtype)
    return KVCache(k=zeros, v=zeros, lengths=lengths)


# row_loop=None writes row by row when one row of the cache is at least this large: then a copy of
# the cache costs more than a loop iteration per row (a 20,000-row batch of a tiny model's cache
# is copied faster than it is looped over).
ROW_LOOP_MIN_ROW_BYTES = 64 * 1024


def per_layer_params(params) -> bool:
    """Parameters whose layers are separate arrays (a run layout, e.g. Llama's
    ``prepare_params``, one CPU device) run the layers one by one; their cache is then one buffer
    per layer, read in place (a layer of a stacked cache is a copy per forward: 0.5b shape, 1024
    slots, 189 -> 135 ms CPU per one-token forward). Stacked parameters (an accelerator's
    layout) get a stacked cache."""
    return isinstance(params, dict) and isinstance(params.get("layers"), (tuple, list))


def row_loop_for(mesh, *arrays) -> bool | None:
    """:func:`commit`'s ``row_loop`` for a decoding loop: its own choice (None) on one CPU device;
    the batch scatter (False) on a mesh, where a loop over rows would gather the split batch axis,
    and on an accelerator, which scatters in place and pays for each iteration of a loop (on an
    H200 a 7B step grew by about 0.9 ms per row with the loop, 2 caches x 32 layers x B
    iterations: docs/benchmarks.md, the accelerator benchmark).

    The platform is the one the call runs on (:func:`asps_jax.platforms.of` of ``mesh`` and
    ``arrays``, e.g. the decode state or the parameters being traced), not the host process's
    default: a TPU program compiled from a CPU process has no row loop."""
    if mesh is not None:
        return False
    return None if platforms.of(None, *arrays) == "cpu" else False


def commit(
    cache: KVCache,
    new_kv: KVBlock,
    nodes: jax.Array,
    num: jax.Array,
    *,
    row_loop: bool | None = False,
) -> KVCache:
    """Append ``new_kv[:, b, nodes[b, j]]`` at slot ``lengths[b] + j`` for ``j < num[b]``.

    Args:
      nodes: int32[B, P], the accepted nodes of each row in root-path order, P the longest path
        (extra entries ignored).
      num: int32[B], how many of them to append (0 leaves the row unchanged).
      row_loop: True writes row by row, each row's window of P slots with one
        ``dynamic_update_slice``, in a loop over the B rows; False, one scatter for the whole
        batch; None, the loop when a row of the cache holds at least ``ROW_LOOP_MIN_ROW_BYTES``.
        Inside a compiled decode loop XLA:CPU updates the cache in place with the loop, while the
        scatter made it copy the whole cache on every call (llama-68m shape, 1024 slots: 1.9 ms
        of a 17 ms step). Pass False where the cache's batch axis is split across devices (a loop
        over rows would gather it).

    Writes that would land at or beyond ``max_len`` are dropped; the caller sizes the cache so
    that this never happens for tokens it keeps. Both ways write the same values.
    """
    L, B, KVH, S, H = cache.shape
    if new_kv.k.shape[:2] != (L, B) or new_kv.k.shape[3:] != (KVH, H):
        raise ValueError(
            f"new_kv.k must have shape [{L}, {B}, T, {KVH}, {H}], got {new_kv.k.shape}"
        )
    if nodes.ndim != 2 or nodes.shape[0] != B:
        raise ValueError(f"nodes must be int32[{B}, P], got shape {nodes.shape}")
    if num.shape != (B,):
        raise ValueError(f"num must be int32[{B}], got shape {num.shape}")
    P = nodes.shape[1]
    j = jnp.arange(P, dtype=jnp.int32)[None, :]
    lengths = cache.lengths.astype(jnp.int32)
    if row_loop is None:
        dtype = jax.tree.leaves(cache.k)[0].dtype
        row_loop = L * KVH * S * H * dtype.itemsize >= ROW_LOOP_MIN_ROW_BYTES
    if row_loop and P <= S:
        # Row b's window starts at min(lengths[b], S - P); window slot w holds path entry
        # w - offset[b] when that entry is written, else keeps its old value.
        start_B = jnp.clip(lengths, 0, S - P)
        src_BP = j - (lengths - start_B)[:, None]
        keep_BP = (src_BP >= 0) & (src_BP < num[:, None])
        nodes = jnp.take_along_axis(nodes, jnp.clip(src_BP, 0, P - 1), axis=1)

        def write(cache_a, block_a):  # [L', B, KVH, S, H] <- [L', B, T, KVH, H]
            picked = _picked(block_a, nodes, cache_a.dtype)  # [L', B, KVH, P, H]

            def row(b, cache_a):
                at = (0, b, 0, start_B[b], 0)
                old = jax.lax.dynamic_slice(cache_a, at, (cache_a.shape[0], 1, KVH, P, H))
                new = jax.lax.dynamic_slice_in_dim(picked, b, 1, axis=1)
                window = jnp.where(keep_BP[b][None, None, None, :, None], new, old)
                return jax.lax.dynamic_update_slice(cache_a, window, at)

            return jax.lax.fori_loop(0, B, row, cache_a)

    else:
        # Slot S is out of range: with mode="drop" the unaccepted entries write nowhere.
        slots_BP = jnp.where(j < num[:, None], lengths[:, None] + j, S)

        def write(cache_a, block_a):  # [L', B, KVH, S, H] <- [L', B, T, KVH, H]
            picked = _picked(block_a, nodes, cache_a.dtype)
            layers = jnp.arange(cache_a.shape[0])[:, None, None, None]
            rows, heads = jnp.arange(B)[None, :, None, None], jnp.arange(KVH)[None, None, :, None]
            # Scattered at (every layer, b, every head, slots[b, j]): the layer is an index of
            # the scatter, not a window dimension, which XLA:TPU made copy the whole stacked
            # cache out and back on every commit (a llama-7B cache of 320 slots: 326 MiB moved
            # at batch 1 and 5.1 GiB at batch 8 to write 2.5 / 20 MiB; now 9 / 50 MiB).
            at = (layers, rows, heads, slots_BP[None, :, None, :])
            return cache_a.at[at].set(picked, mode="drop")

    return KVCache(
        k=map_layers(write, cache.k, new_kv.k),
        v=map_layers(write, cache.v, new_kv.v),
        lengths=lengths + num.astype(jnp.int32),
    )


def _picked(block_a: jax.Array, nodes_BP: jax.Array, dtype) -> jax.Array:
    """``block[:, b, nodes[b, j]]`` as ``[L, B, KVH, P, H]`` in the cache's dtype. Non-finite
    entries become 0: stale slots are masked, and masking cannot undo a NaN (0 * NaN). A target
    row stops before keeping such a token (decode)."""
    picked = jnp.take_along_axis(block_a, nodes_BP[None, :, :, None, None], axis=2)
    picked = jnp.where(jnp.isfinite(picked), picked, jnp.zeros((), picked.dtype))
    return jnp.moveaxis(picked, 2, 3).astype(dtype)


def cache_mask(cache: KVCache, T: int) -> jax.Array:
    """``bool[B, T, S]``: cache slot ``s`` is visible to every new token iff ``s < lengths[b]``."""
    S = cache.max_len
    valid_BS = jnp.arange(S, dtype=jnp.int32)[None, :] < cache.lengths[:, None]
    return jnp.broadcast_to(valid_BS[:, None, :], (valid_BS.shape[0], T, S))
