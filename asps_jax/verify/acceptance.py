"""The optimal token-level multi-draft acceptance probability (docs/algorithms.md §3.5).

For K independent drafts ``X_k ~ q_k`` and target p, the best acceptance ``P(Y in {X_1..X_K})`` of
any exact selection scheme is ``1 + min_S [p(S) - prod_k q_k(S)]`` (Hu et al., ICLR 2025, via the
dual of the transport LP; Khisti et al., arXiv 2410.18234). For identical drafts the minimising S
is a prefix of the tokens sorted by ``p / q`` (``-t^K`` is concave), an O(V log V) computation.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

MAX_BRUTE_FORCE_VOCAB = 12
"""Up to this vocabulary size every subset is enumerated, so the value is exact for any laws."""


def _prefix_minimum(p, q, key) -> jax.Array:
    """``min_j [p(S_j) - prod_k q_k(S_j)]`` over prefixes S_j of ``argsort(key)`` (incl. empty).

    p: [V]; q: [K, V]; key: [V].
    """
    order = jnp.argsort(key)
    p_cum = jnp.cumsum(p[order])
    q_cum = jnp.cumsum(q[:, order], axis=-1)  # [K, V]
    vals = p_cum - jnp.prod(q_cum, axis=0)
    return jnp.minimum(jnp.min(vals), 0.0)


def _log_ratio(lp, lq):
    """``log p - log q`` with tokens the draft never proposes (q = 0) sorted last (never NaN)."""
    return jnp.where(jnp.isneginf(lq), jnp.inf, lp - jnp.where(jnp.isneginf(lq), 0.0, lq))


def sorted_prefix_acceptance(target_logprobs: jax.Array, draft_logprobs: jax.Array) -> jax.Array:
    """``1 + min over sorted prefixes`` for one target [V] and drafts [K, V].

    Exact for identical drafts (order by p / q). For different laws the prefixes of the orders
    ``p / q_k`` (each k) and ``p / mean_k q_k`` are all tried; the result is then an upper bound.
    """
    p = jnp.exp(target_logprobs)
    q = jnp.exp(draft_logprobs)
    mean_lq = jnp.log(jnp.mean(q, axis=0))
    keys = jnp.concatenate(
        [
            jax.vmap(_log_ratio, (None, 0))(target_logprobs, draft_logprobs),
            _log_ratio(target_logprobs, mean_lq)[None],
        ]
    )
    mins = jax.vmap(lambda key: _prefix_minimum(p, q, key))(keys)
    return 1.0 + jnp.min(mins)


def identical_drafts_acceptance(
    target_logprobs: jax.Array, draft_logprobs: jax.Array, num_drafts: int
) -> jax.Array:
    """:func:`optimal_acceptance` for ``num_drafts`` independent drafts that share one law.

    Args:
      target_logprobs: [..., V] log p.
      draft_logprobs: [..., V] log q, the law of every draft.
      num_drafts: K >= 1.

    Returns:
      [...] ``1 + min_S [p(S) - q(S)^K]``, exact at every V: the minimising S is a prefix of the
      tokens sorted by ``p / q``, so one sort per law is all it takes (``optimal_acceptance`` on
      K copies of q sorts K + 1 times, and also tries every subset when ``V <= 12``).
    """
    target_logprobs = jnp.asarray(target_logprobs)
    draft_logprobs = jnp.asarray(draft_logprobs)
    if draft_logprobs.shape != target_logprobs.shape:
        raise ValueError(
            "identical_drafts_acceptance: draft_logprobs must have the shape of target_logprobs "
            f"{target_logprobs.shape}, got {draft_logprobs.shape}"
        )
    if num_drafts < 1:
        raise ValueError(f"identical_drafts_acceptance: num_drafts must be >= 1, got {num_drafts}")

    def one(lp, lq):
        order = jnp.argsort(_log_ratio(lp, lq))
        vals = jnp.cumsum(jnp.exp(lp[order])) - jnp.cumsum(jnp.exp(lq[order])) ** num_drafts
        return 1.0 + jnp.minimum(jnp.min(vals), 0.0)

    vocab = target_logprobs.shape[-1]
    lp, lq = target_logprobs.reshape((-1, vocab)), draft_logprobs.reshape((-1, vocab))
    return jax.vmap(one)(lp, lq).reshape(target_logprobs.shape[:-1])


def _brute_force(p, q) -> jax.Array:
    vocab = p.shape[-1]
    subsets = jnp.asarray(
        np.array(list(itertools.product([0.0, 1.0], repeat=vocab)), dtype=np.float32), p.dtype
    )  # [2^V, V]
    vals = subsets @ p - jnp.prod(q @ subsets.T, axis=0)
    return 1.0 + jnp.min(vals)


def optimal_acceptance(target_logprobs: jax.Array, draft_logprobs: jax.Array) -> jax.Array:
    """Optimal multi-draft acceptance ``1 + min_S [p(S) - prod_k q_k(S)]``.

    Args:
      target_logprobs: [..., V] log p.
      draft_logprobs: [..., K, V] log q_k of the K independent drafts (repeat one law K times for
        identical drafts).

    Returns:
      [...] the largest ``P(Y in drafts)`` any exact selection scheme can reach. Exact for identical
      drafts at every V (sorted prefixes) and for any drafts when ``V <= 12`` (all subsets);
      otherwise (different laws, V > 12) the best sorted prefix, an upper bound.
    """
    target_logprobs = jnp.asarray(target_logprobs)
    draft_logprobs = jnp.asarray(draft_logprobs)
    if draft_logprobs.ndim != target_logprobs.ndim + 1 or (
        draft_logprobs.shape[:-2] + draft_logprobs.shape[-1:] != target_logprobs.shape
    ):
        raise ValueError(
            "optimal_acceptance: draft_logprobs must be [..., K, V] for target_logprobs [..., V]="
            f"{target_logprobs.shape}, got {draft_logprobs.shape}"
        )
    if draft_logprobs.shape[-2] == 0:
        raise ValueError("optimal_acceptance: draft_logprobs needs K >= 1 drafts")
    vocab = target_logprobs.shape[-1]
    batch = target_logprobs.shape[:-1]
    lp = target_logprobs.reshape((-1, vocab))
    lq = draft_logprobs.reshape((-1,) + draft_logprobs.shape[-2:])

    def one(lp_v, lq_kv):
        value = sorted_prefix_acceptance(lp_v, lq_kv)
        if vocab <= MAX_BRUTE_FORCE_VOCAB:
            value = jnp.minimum(value, _brute_force(jnp.exp(lp_v), jnp.exp(lq_kv)))
        return value

    return jax.vmap(one)(lp, lq).reshape(batch)
