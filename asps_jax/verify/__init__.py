"""Verification algorithms: one pure function per method, one registry of methods (registry.py).

Terms (as vLLM defines them): a draft token that passes verification is *accepted*; the token that
replaces the first rejected draft token is *recovered* (drawn from a residual law); when every draft
token is accepted one more token, the *bonus* token, is drawn from the target law after the draft.
A step therefore emits ``num_tokens`` tokens: the accepted prefix and one recovered or bonus token.

``verify_chain`` takes one chain, ``verify_drafts`` K chains (the signatures of
:data:`~asps_jax.verify.api.ChainVerifier` / :data:`~asps_jax.verify.api.DraftsVerifier`) and
``verify_tree`` a node-indexed token tree; all are pure and work under ``jax.jit`` and
``jax.vmap``. Verification arithmetic runs in float32.
"""

from __future__ import annotations

from asps_jax.verify.api import (
    CHAIN_METHODS,
    DRAFTS_METHODS,
    TREE_METHODS,
    Verdict,
    verify_chain,
    verify_drafts,
    verify_tree,
)

__all__ = [
    "CHAIN_METHODS",
    "DRAFTS_METHODS",
    "TREE_METHODS",
    "Verdict",
    "verify_chain",
    "verify_drafts",
    "verify_tree",
]
