"""What a verifier returns: :class:`Verdict` (chains) and :class:`TreeVerdict` (a token tree),
and the signatures of the chain and multi-draft verifiers. The bottom of ``verify/``: it imports no
other verification module."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verdict:
    """Result of one verification step.

    ``tokens[:num_tokens]`` are emitted: the accepted draft prefix, then one recovered or bonus
    token; the remaining entries are -1. ``draft_index`` is the chain whose prefix the emitted
    tokens follow (always 0 for a single chain). ``num_fallbacks`` counts selection solves that did
    not converge and were replaced by an exact fallback rule (multi-draft LP methods only).
    """

    tokens: jax.Array  # int32[n+1]
    num_tokens: jax.Array  # int32[]
    draft_index: jax.Array  # int32[]
    num_fallbacks: jax.Array  # int32[]


def make_verdict(tokens, num_tokens, draft_index=0, num_fallbacks=0) -> Verdict:
    """Build a :class:`Verdict`, filling slots at and beyond ``num_tokens`` with -1."""
    tokens = jnp.asarray(tokens, jnp.int32)
    num_tokens = jnp.asarray(num_tokens, jnp.int32)
    keep = jnp.arange(tokens.shape[-1]) < num_tokens
    return Verdict(
        tokens=jnp.where(keep, tokens, -1),
        num_tokens=num_tokens,
        draft_index=jnp.asarray(draft_index, jnp.int32),
        num_fallbacks=jnp.asarray(num_fallbacks, jnp.int32),
    )


ChainVerifier = Callable[..., Verdict]
"""``fn(key, draft_tokens[n], draft_logprobs[n, V], target_logprobs[n+1, V], draft_length[])``."""

DraftsVerifier = Callable[..., Verdict]
"""``fn(key, draft_tokens[K, n], draft_logprobs[K, n, V], target_logprobs[K, n+1, V],
draft_length[K], **options)``."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeVerdict:
    """Result of verifying a tree.

    ``tokens[:num_tokens]`` are emitted: the tokens of the accepted root path, then one recovered
    or bonus token (-1 beyond). ``path[:num_tokens]`` are the nodes to commit: the root, then the
    accepted nodes (canonical slots of the node table), -1 beyond.
    """

    tokens: jax.Array  # int32[D+1]
    num_tokens: jax.Array  # int32[]
    path: jax.Array  # int32[D+1]
