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

# Logical axis names of the cache arrays (for mesh sharding rules).
CACHE_AXES = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [L, B, S, KVH, H], keys after RoPE
    v: jax.Array  # [L, B, S, KVH, H]
    lengths: jax.Array  # int32[B], number of valid slots per row

    @property
    def max_len(self) -> int:
        return int(self.k.shape[2])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVBlock:
    """Keys/values of the T tokens of one forward, not yet in any cache."""

    k: jax.Array  # [L, B, T, KVH, H]
    v: jax.Array  # [L, B, T, KVH, H]


def init_cache(config, batch_size: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache of ``max_len`` slots per row."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    shape = (
        config.num_hidden_layers,
        batch_size,
        max_len,
        config.num_key_value_heads,
        config.head_dim,
    )
    zeros = jnp.zeros(shape, dtype)
    return KVCache(k=zeros, v=zeros, lengths=jnp.zeros((batch_size,), jnp.int32))


def commit(cache: KVCache, new_kv: KVBlock, nodes: jax.Array, num: jax.Array) -> KVCache:
    """Append ``new_kv[:, b, nodes[b, j]]`` at slot ``lengths[b] + j`` for ``j < num[b]``.

    Args:
      nodes: int32[B, P], the accepted nodes of each row in root-path order, P the longest path
        (extra entries ignored).
      num: int32[B], how many of them to append (0 leaves the row unchanged).

    Writes that would land at or beyond ``max_len`` are dropped; the caller sizes the cache so
    that this never happens for tokens it keeps.
    """
    L, B, S = cache.k.shape[:3]
    if new_kv.k.shape[:2] != (L, B) or new_kv.k.shape[3:] != cache.k.shape[3:]:
        raise ValueError(
            f"new_kv.k must have shape [{L}, {B}, T, {cache.k.shape[3]}, {cache.k.shape[4]}], "
            f"got {new_kv.k.shape}"
        )
    if nodes.ndim != 2 or nodes.shape[0] != B:
        raise ValueError(f"nodes must be int32[{B}, P], got shape {nodes.shape}")
    if num.shape != (B,):
        raise ValueError(f"num must be int32[{B}], got shape {num.shape}")
    P = nodes.shape[1]
    j = jnp.arange(P, dtype=jnp.int32)[None, :]
    # Slot S is out of range: with mode="drop" the unaccepted entries write nowhere.
    slots_BP = jnp.where(j < num[:, None], cache.lengths[:, None] + j, S)

    def write(cache_a, block_a):  # [L, B, S, KVH, H] <- [L, B, T, KVH, H]
        picked = jnp.take_along_axis(block_a, nodes[None, :, :, None, None], axis=2)
        # Non-finite entries are stored as 0: stale slots are masked, and masking cannot undo a
        # NaN (0 * NaN). A target row stops before keeping such a token (decode).
        picked = jnp.where(jnp.isfinite(picked), picked, jnp.zeros((), picked.dtype))
        rows = jnp.arange(B)[:, None]
        # [L, B, P, KVH, H] scattered at (b, slots[b, j]) for every layer at once.
        return cache_a.at[:, rows, slots_BP].set(picked.astype(cache_a.dtype), mode="drop")

    return KVCache(
        k=write(cache.k, new_kv.k),
        v=write(cache.v, new_kv.v),
        lengths=cache.lengths + num.astype(jnp.int32),
    )


def cache_mask(cache: KVCache, T: int) -> jax.Array:
    """``bool[B, T, S]``: cache slot ``s`` is visible to every new token iff ``s < lengths[b]``."""
    S = cache.k.shape[2]
    valid_BS = jnp.arange(S, dtype=jnp.int32)[None, :] < cache.lengths[:, None]
    return jnp.broadcast_to(valid_BS[:, None, :], (valid_BS.shape[0], T, S))
