"""Public verification entry points, the result type and the method lists (derived from
verify/registry.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax.verify import registry


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


# The public lists, derived from the one registry (verify/registry.py). verify_drafts also takes
# the chain methods (on chain 0 alone), after the multi-draft ones.
CHAIN_METHODS: tuple[str, ...] = registry.names("chain")
DRAFTS_METHODS: tuple[str, ...] = registry.names("drafts") + CHAIN_METHODS
# Root drafts drawn without replacement (multi.sample_without_replacement): verify_drafts only.
WITHOUT_REPLACEMENT_METHODS: tuple[str, ...] = tuple(
    m.name for m in registry.REGISTRY.values() if "iid" not in m.laws
)
# Sequence-level verifiers of a whole token tree (verify.tree.verify_tree, docs/algorithms.md §7).
TREE_METHODS: tuple[str, ...] = registry.names("tree")


def _check_method(method: str, known, fn_name: str) -> None:
    if method not in known:
        raise ValueError(
            f"{fn_name}: unknown method {method!r}; choose one of {', '.join(sorted(known))}"
        )


def _check_draft_length(draft_length, n: int, shape: tuple, fn_name: str) -> jax.Array:
    if draft_length is None:
        return jnp.full(shape, n, jnp.int32)
    if not isinstance(draft_length, jax.core.Tracer):
        arr = np.asarray(draft_length)
        if arr.shape != shape:
            raise ValueError(f"{fn_name}: draft_length must have shape {shape}, got {arr.shape}")
        if np.any(arr < 0) or np.any(arr > n):
            raise ValueError(f"{fn_name}: draft_length must lie in [0, {n}], got {arr.tolist()}")
    elif jnp.shape(draft_length) != shape:
        raise ValueError(
            f"{fn_name}: draft_length must have shape {shape}, got {jnp.shape(draft_length)}"
        )
    return jnp.clip(jnp.asarray(draft_length, jnp.int32), 0, n)


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_dtypes(
    draft_tokens, draft_logprobs, target_logprobs, fn_name: str, tokens_name: str = "draft_tokens"
) -> None:
    """Token ids must be integers and laws floating point (dtypes are known even when traced)."""
    if not jnp.issubdtype(draft_tokens.dtype, jnp.integer):
        raise ValueError(
            f"{fn_name}: {tokens_name} must be integer ids, got dtype {draft_tokens.dtype}"
        )
    for name, arr in (("draft_logprobs", draft_logprobs), ("target_logprobs", target_logprobs)):
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise ValueError(f"{fn_name}: {name} must be floating point, got dtype {arr.dtype}")


def _check_token_range(
    draft_tokens, vocab: int, fn_name: str, tokens_name: str = "draft token ids"
) -> None:
    """Concrete ids must lie in [0, V); traced ones out of range end their chain (never emitted,
    chain.effective_length) or their branch (verify.tree)."""
    if draft_tokens.size and _concrete(draft_tokens):
        arr = np.asarray(draft_tokens)
        bad = arr[(arr < 0) | (arr >= vocab)]
        if bad.size:
            raise ValueError(
                f"{fn_name}: {tokens_name} must lie in [0, V={vocab}), got {bad[0].item()}"
            )


def _check_distinct_roots(draft_tokens, lengths, fn_name: str) -> None:
    """Without-replacement drafts: the root tokens of the chains with draft_length > 0 must be
    distinct (concrete input only; a traced repeat is never accepted)."""
    if draft_tokens.shape[1] == 0 or not (_concrete(draft_tokens) and _concrete(lengths)):
        return
    roots = np.asarray(draft_tokens)[:, 0][np.asarray(lengths) > 0]
    values, counts = np.unique(roots, return_counts=True)
    if np.any(counts > 1):
        raise ValueError(
            f"{fn_name}: method 'specinfer_wor' needs distinct root tokens (drawn without "
            f"replacement), but token {values[counts > 1][0].item()} is repeated"
        )


def verify_chain(
    key: jax.Array,
    draft_tokens: jax.Array,
    draft_logprobs: jax.Array,
    target_logprobs: jax.Array,
    *,
    method: str = "asps",
    draft_length: jax.Array | int | None = None,
) -> Verdict:
    """Verify one draft chain against the target (docs/api.md §1).

    Args:
      key: a PRNG key.
      draft_tokens: int32[n], tokens drawn from the draft.
      draft_logprobs: float32[n, V], the laws the draft tokens were actually drawn from.
      target_logprobs: float32[n+1, V], the target laws; row n is the bonus law.
      method: ``"sps"`` (standard speculative sampling) or ``"asps"`` (accelerated).
      draft_length: int32[] in [0, n]: only the first ``draft_length`` draft tokens are real (the
        rest is padding, e.g. after an EOS); the bonus law is then
        ``target_logprobs[draft_length]``.

    Returns:
      A :class:`Verdict` with ``tokens`` int32[n+1] and ``1 <= num_tokens <= draft_length + 1``.
    """
    _check_method(method, CHAIN_METHODS, "verify_chain")
    draft_tokens = jnp.asarray(draft_tokens)
    draft_logprobs = jnp.asarray(draft_logprobs)
    target_logprobs = jnp.asarray(target_logprobs)
    if draft_tokens.ndim != 1:
        raise ValueError(
            f"verify_chain: draft_tokens must be int32[n], got shape {draft_tokens.shape}"
        )
    n = draft_tokens.shape[0]
    if draft_logprobs.ndim != 2 or draft_logprobs.shape[0] != n:
        raise ValueError(
            f"verify_chain: draft_logprobs must be [n={n}, V], got shape {draft_logprobs.shape}"
        )
    vocab = draft_logprobs.shape[1]
    if target_logprobs.shape != (n + 1, vocab):
        raise ValueError(
            f"verify_chain: target_logprobs must be [n+1={n + 1}, V={vocab}] "
            f"(draft vocabulary), got shape {target_logprobs.shape}"
        )
    _check_dtypes(draft_tokens, draft_logprobs, target_logprobs, "verify_chain")
    _check_token_range(draft_tokens, vocab, "verify_chain")
    length = _check_draft_length(draft_length, n, (), "verify_chain")
    fn = registry.REGISTRY[method].verifier
    return fn(
        key,
        draft_tokens.astype(jnp.int32),
        draft_logprobs.astype(jnp.float32),
        target_logprobs.astype(jnp.float32),
        length,
    )


def verify_drafts(
    key: jax.Array,
    draft_tokens: jax.Array,
    draft_logprobs: jax.Array,
    target_logprobs: jax.Array,
    *,
    method: str = "is",
    draft_length: jax.Array | None = None,
    **options,
) -> Verdict:
    """Verify K independent draft chains against the target (docs/api.md §1, docs/algorithms.md §3).

    Args:
      draft_tokens: int32[K, n]; draft_logprobs: float32[K, n, V]; target_logprobs:
        float32[K, n+1, V] (the target along each chain).
      method: ``"specinfer"``, ``"spectr"``, ``"is"``, ``"optimal"``, ``"specinfer_wor"``, or
        ``"sps"`` / ``"asps"`` on chain 0 alone.
      draft_length: int32[K], valid tokens per chain (default n).
      options: method options (e.g. ``rule=`` for ``"is"``); every multi-draft method takes
        ``tail="asps"`` (default: ASpS verifies the rest of the last alive chain) or ``"sps"``.

    Concrete inputs are validated (shapes, dtypes, token ids in [0, V), distinct root tokens for
    ``"specinfer_wor"``); traced out-of-range ids end their chain and are never emitted.

    Returns:
      A :class:`Verdict`; ``draft_index`` names a chain whose prefix the emitted tokens follow.
    """
    _check_method(method, DRAFTS_METHODS, "verify_drafts")
    draft_tokens = jnp.asarray(draft_tokens)
    draft_logprobs = jnp.asarray(draft_logprobs)
    target_logprobs = jnp.asarray(target_logprobs)
    if draft_tokens.ndim != 2 or draft_tokens.shape[0] == 0:
        raise ValueError(
            f"verify_drafts: draft_tokens must be int32[K, n] with K >= 1, got shape "
            f"{draft_tokens.shape}"
        )
    num_drafts, n = draft_tokens.shape
    if draft_logprobs.ndim != 3 or draft_logprobs.shape[:2] != (num_drafts, n):
        raise ValueError(
            f"verify_drafts: draft_logprobs must be [K={num_drafts}, n={n}, V], got shape "
            f"{draft_logprobs.shape}"
        )
    vocab = draft_logprobs.shape[2]
    if target_logprobs.shape != (num_drafts, n + 1, vocab):
        raise ValueError(
            f"verify_drafts: target_logprobs must be [K={num_drafts}, n+1={n + 1}, V={vocab}], "
            f"got shape {target_logprobs.shape}"
        )
    _check_dtypes(draft_tokens, draft_logprobs, target_logprobs, "verify_drafts")
    _check_token_range(draft_tokens, vocab, "verify_drafts")
    lengths = _check_draft_length(draft_length, n, (num_drafts,), "verify_drafts")
    if method in WITHOUT_REPLACEMENT_METHODS:
        _check_distinct_roots(draft_tokens, lengths, "verify_drafts")
    draft_tokens = draft_tokens.astype(jnp.int32)
    draft_logprobs = draft_logprobs.astype(jnp.float32)
    target_logprobs = target_logprobs.astype(jnp.float32)
    entry = registry.REGISTRY[method]
    entry.validate(options, vocab=vocab)
    if entry.kind == "chain":
        return entry.verifier(
            key, draft_tokens[0], draft_logprobs[0], target_logprobs[0], lengths[0]
        )
    return entry.verifier(key, draft_tokens, draft_logprobs, target_logprobs, lengths, **options)
