"""Verification algorithms: one pure function per method, a plain name -> function registry.

Terms (as vLLM defines them): a draft token that passes verification is *accepted*; the token that
replaces the first rejected draft token is *recovered* (drawn from a residual law); when every draft
token is accepted one more token, the *bonus* token, is drawn from the target law after the draft.
A step therefore emits ``num_tokens`` tokens: the accepted prefix and one recovered or bonus token.

Every function here has the signature of :data:`ChainVerifier` or :data:`DraftsVerifier`, is pure,
and works under ``jax.jit`` and ``jax.vmap``. Verification arithmetic runs in float32.
"""

from __future__ import annotations

from asps_jax.verify.api import (
    CHAIN_METHODS,
    DRAFTS_METHODS,
    Verdict,
    verify_chain,
    verify_drafts,
)
from asps_jax.verify.tree import verify_tree as verify_tree

__all__ = ["CHAIN_METHODS", "DRAFTS_METHODS", "Verdict", "verify_chain", "verify_drafts"]
