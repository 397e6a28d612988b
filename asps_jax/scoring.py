"""Target scoring of a whole padded token tree (or a chain) in one forward.

Node ``i`` of row ``b`` sits at position ``lengths[b] + depth[i]`` and attends to every committed
cache slot plus its valid tree ancestors (itself included), so its logits are exactly those of
decoding its root path after the cached prefix. Padded nodes attend only to themselves: their
logits are junk but finite, and no valid node ever sees them. The forward returns the new keys and
values without writing them; ``kv_cache.commit`` later appends only the accepted path.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax.kv_cache import KVCache, cache_mask, commit, init_cache
from asps_jax.models.output import ForwardOut
from asps_jax.trees import Tree, attention_mask


class Filled(NamedTuple):
    """A cache after a prefill or refill, and the prompts' features when the forward returns
    them (``ForwardOut.features``: float[B, P, F], for a learned head), else None."""

    cache: KVCache
    features: jax.Array | None = None


def _check(name: str, x: jax.Array, shape: tuple[int, ...], kind: str) -> None:
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
    ok = jnp.issubdtype(x.dtype, jnp.integer) if kind == "int" else x.dtype == jnp.bool_
    if not ok:
        raise ValueError(f"{name} must be {'an integer' if kind == 'int' else 'a bool'} array")


def score_tree(
    forward,
    params,
    cache: KVCache,
    node_tokens: jax.Array,  # int32[B, N]
    tree: Tree,
    valid: jax.Array,  # bool[B, N]
    tree_mask: jax.Array | None = None,  # bool[B, N, N]
) -> ForwardOut:
    """The forward's :class:`~asps_jax.models.output.ForwardOut` for every node of the tree:
    ``logits`` float32[B, N, V], ``kv`` [L, B, N, KVH, H] (and the features it was asked for).

    ``forward(params, tokens, positions, mask, cache)`` has the model config bound. ``tree_mask``
    replaces the tree part of the attention mask (default :func:`~asps_jax.trees.attention_mask`;
    e.g. :func:`~asps_jax.trees.merged_attention_mask`, where a node's root path runs through
    other slots than its static ancestors).
    """
    if node_tokens.ndim != 2:
        raise ValueError(f"node_tokens must be [B, N], got shape {node_tokens.shape}")
    B, N = node_tokens.shape
    if N != tree.num_nodes:
        raise ValueError(f"node_tokens has {N} nodes but the tree has {tree.num_nodes}")
    _check("node_tokens", node_tokens, (B, N), "int")
    _check("valid", valid, (B, N), "bool")
    _check("cache.lengths", cache.lengths, (B,), "int")
    depth_N = jnp.asarray(tree.depth, jnp.int32)
    positions_BN = cache.lengths[:, None] + depth_N[None, :]
    if tree_mask is None:
        tree_mask = attention_mask(tree, valid)
    mask_BNS = jnp.concatenate([cache_mask(cache, N), tree_mask], axis=-1)
    return forward(params, node_tokens.astype(jnp.int32), positions_BN, mask_BNS, cache)


def chain_mask(valid: jax.Array) -> jax.Array:
    """``bool[B, T, T]``: causal among valid tokens; a padded token attends only to itself."""
    T = valid.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))[None]
    eye = jnp.eye(T, dtype=bool)[None]
    return jnp.where(valid[:, :, None], causal & valid[:, None, :], eye)


def score_chain(
    forward,
    params,
    cache: KVCache | None,
    tokens: jax.Array,  # int32[B, T]
    valid: jax.Array,  # bool[B, T]
) -> ForwardOut:
    """Prefill / chain scoring: token ``t`` at position ``lengths[b] + t``, causal over valid ones.

    With ``cache=None`` the chain starts at position 0 and the mask is ``[B, T, T]``. Padding is
    expected at the end of a row (``valid`` a prefix); commit ``valid.sum(1)`` tokens afterwards.
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    B, T = tokens.shape
    _check("tokens", tokens, (B, T), "int")
    _check("valid", valid, (B, T), "bool")
    start_B = jnp.zeros((B,), jnp.int32) if cache is None else cache.lengths.astype(jnp.int32)
    if cache is not None:
        _check("cache.lengths", cache.lengths, (B,), "int")
    positions_BT = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    mask_BTT = chain_mask(valid)
    if cache is not None:
        mask_BTT = jnp.concatenate([cache_mask(cache, T), mask_BTT], axis=-1)
    return forward(params, tokens.astype(jnp.int32), positions_BT, mask_BTT, cache)


def prefill_cache(forward, params, cache: KVCache, prompts_BP, num_B) -> Filled:
    """Commit the first ``num_B`` prompt tokens of each row into ``cache`` (one forward).

    A ``forward`` that returns features (``forward_for(config, features)``) gives the prompt's
    too, ``Filled.features`` [B, P, F], for a learned head."""
    rows, width = prompts_BP.shape
    valid_BP = jnp.arange(width)[None, :] < num_B[:, None]
    out = score_chain(forward, params, cache, prompts_BP, valid_BP)
    nodes_BP = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
    return Filled(commit(cache, out.kv, nodes_BP, num_B), out.features)


def prefill_cache_grouped(forward, params, cache: KVCache, prompts_BP, num_B, group: int) -> Filled:
    """:func:`prefill_cache` for a cache whose rows come in groups of ``group`` (a static int)
    that hold one prompt each: cache rows ``g * group .. g * group + group - 1`` take prompt row
    ``g * group * B // rows`` (a prompt's n samples, a draft's K replicas; the last group may be
    short). One forward per group on its first row, the row then copied to the group's rows:
    the cache that a forward over every row gives, at 1 / group of its cost."""
    rows = cache.lengths.shape[0]
    if group == 1 and rows == prompts_BP.shape[0]:
        return prefill_cache(forward, params, cache, prompts_BP, num_B)
    first = np.arange(0, rows, group)  # static: each group's first cache row
    src = first * prompts_BP.shape[0] // rows  # ... and its prompt row
    once = prefill_cache(forward, params, cache.take_rows(first), prompts_BP[src], num_B[src])
    features = once.features
    if features is not None:  # one row of them per prompt row
        features = features[np.arange(prompts_BP.shape[0]) * rows // prompts_BP.shape[0] // group]
    return Filled(once.cache.take_rows(np.arange(rows) // group), features)


def _write_rows(cache: KVCache, row: KVCache, first, count: int) -> KVCache:
    """Rows ``first .. first + count - 1`` of ``cache`` take ``row``'s slots ``0 .. P - 1``."""

    def put(a, r):  # a: [L', B', KVH, S, H], r: [L', 1, KVH, P, H]
        r = jnp.broadcast_to(r, (r.shape[0], count) + r.shape[2:])
        return jax.lax.dynamic_update_slice(a, r.astype(a.dtype), (0, first, 0, 0, 0))

    if cache.per_layer:
        ks = tuple(put(a[None], r[None])[0] for a, r in zip(cache.k, row.k))
        vs = tuple(put(a[None], r[None])[0] for a, r in zip(cache.v, row.v))
    else:
        ks, vs = put(cache.k, row.k), put(cache.v, row.v)
    return dataclasses.replace(cache, k=ks, v=vs)


def refill_rows(
    forward, config, params, cache: KVCache, take_B, prompts_BP, committed_B, replicas: int = 1
) -> Filled:
    """Start new prompts in the rows ``take_B`` (bool[B]) of a running cache (continuous
    batching): each taken row's ``replicas`` cache rows (``b * replicas ..``) take its prompt's
    first ``committed_B`` tokens, one single-row prefill forward per row over the prompt width
    only (no attention over the long cache), in the cache's layout and dtype; their lengths are
    set, the other rows unchanged (stale slots past a length are masked, as after a rejection).

    A ``forward`` that returns features gives the taken rows' prompt features too,
    ``Filled.features`` [B, P, F] (zeros in the other rows)."""
    batch, width = prompts_BP.shape
    (slots_R,) = jnp.nonzero(take_B, size=batch, fill_value=0)  # the rows to fill, in order
    dtype = jax.tree.leaves(cache.k)[0].dtype

    def row_prefill(b, per_layer):
        prompt_1P = jax.lax.dynamic_slice_in_dim(prompts_BP, b, 1)
        committed_1 = jax.lax.dynamic_slice_in_dim(committed_B, b, 1)
        row = init_cache(config, 1, width, dtype, per_layer=per_layer)
        return prefill_cache(forward, params, row, prompt_1P, committed_1)

    def fill(i, carry):
        cache, features = carry
        b = slots_R[i]
        row = row_prefill(b, cache.per_layer)
        if features is not None:
            features = jax.lax.dynamic_update_slice_in_dim(features, row.features, b, axis=0)
        return _write_rows(cache, row.cache, b * replicas, replicas), features

    shape = jax.eval_shape(lambda: row_prefill(0, cache.per_layer)).features
    features = None if shape is None else jnp.zeros((batch,) + shape.shape[1:], shape.dtype)
    # The work of a refill is its prompts' tokens, whatever the number of rows.
    cache, features = jax.lax.fori_loop(0, jnp.sum(take_B), fill, (cache, features))
    take = jnp.repeat(take_B, replicas)
    cache = dataclasses.replace(
        cache, lengths=jnp.where(take, jnp.repeat(committed_B, replicas), cache.lengths)
    )
    return Filled(cache, features)
