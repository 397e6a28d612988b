"""Checks of a verifier's inputs (shapes, dtypes, token ids, draft lengths), shared by the public
entry points; each failure is a one-line ``ValueError`` naming the function and the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_draft_length(draft_length, n: int, shape: tuple, fn_name: str) -> jax.Array:
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


def concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_dtypes(
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


def check_token_range(
    draft_tokens, vocab: int, fn_name: str, tokens_name: str = "draft token ids"
) -> None:
    """Concrete ids must lie in [0, V); traced ones out of range end their chain (never emitted,
    chain.effective_length) or their branch (verify.tree)."""
    if draft_tokens.size and concrete(draft_tokens):
        arr = np.asarray(draft_tokens)
        bad = arr[(arr < 0) | (arr >= vocab)]
        if bad.size:
            raise ValueError(
                f"{fn_name}: {tokens_name} must lie in [0, V={vocab}), got {bad[0].item()}"
            )


def check_distinct_roots(draft_tokens, lengths, fn_name: str) -> None:
    """Without-replacement drafts: the root tokens of the chains with draft_length > 0 must be
    distinct (concrete input only; a traced repeat is never accepted)."""
    if draft_tokens.shape[1] == 0 or not (concrete(draft_tokens) and concrete(lengths)):
        return
    roots = np.asarray(draft_tokens)[:, 0][np.asarray(lengths) > 0]
    values, counts = np.unique(roots, return_counts=True)
    if np.any(counts > 1):
        raise ValueError(
            f"{fn_name}: method 'specinfer_wor' needs distinct root tokens (drawn without "
            f"replacement), but token {values[counts > 1][0].item()} is repeated"
        )
