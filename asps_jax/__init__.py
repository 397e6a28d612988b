"""asps_jax: exact speculative sampling for JAX.

Public API (docs/api.md): verification (:func:`verify_chain`, :func:`verify_drafts`,
:func:`optimal_acceptance`), models (:func:`load_model`), sampling (:func:`sample`,
:func:`stream`, :class:`Sampler` for long-lived use, :class:`Sampling` for their sampling
arguments as one value, :func:`make_mesh` for sharding,
:func:`init_distributed` for several processes), and the shared logits processor
(:func:`process_logits`).
"""

from importlib import metadata as _metadata

from asps_jax.controls import Sampling, process_logits
from asps_jax.models import Model, check_compatible, load_model
from asps_jax.sampler import NonFiniteLogitsError, SampleOutput
from asps_jax.session import Sampler, Session, sample, stream
from asps_jax.sharding import ShardingRules, init_distributed, make_mesh
from asps_jax.verify import Verdict, verify_chain, verify_drafts
from asps_jax.verify.acceptance import optimal_acceptance

try:
    __version__ = _metadata.version("asps_jax")  # the installed distribution's (pyproject.toml)
except _metadata.PackageNotFoundError:  # the tree on PYTHONPATH with no install at all
    __version__ = "0+unknown"

__all__ = [
    "Model",
    "NonFiniteLogitsError",
    "SampleOutput",
    "Sampler",
    "Sampling",
    "Session",
    "ShardingRules",
    "Verdict",
    "check_compatible",
    "init_distributed",
    "load_model",
    "make_mesh",
    "optimal_acceptance",
    "process_logits",
    "sample",
    "stream",
    "verify_chain",
    "verify_drafts",
]
