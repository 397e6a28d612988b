"""asps_jax: exact speculative sampling for JAX.

Public API (see API.md): :func:`verify_chain`, :func:`verify_drafts`, :class:`Verdict`,
:func:`process_logits`.
"""

from asps_jax.processors import process_logits
from asps_jax.verify import Verdict, verify_chain, verify_drafts

__all__ = ["Verdict", "process_logits", "verify_chain", "verify_drafts"]
