"""The sampling controls under one roof, and the one module the rest of the library imports.

Host values: :class:`Sampling` (every sampling argument as one typed value, lowered into the
per-row :class:`SamplingParams`), :class:`HostConstraint` (the rows' constraints on the host),
:class:`StopStrings` and their checks. Device values: :class:`History` (each row's committed text
and constraint state, carried by the loop) and :class:`SamplingParams`.

The device façade (:mod:`~asps_jax.controls.facade`), called by the decoding loop and the drafters
in this order within a step: :func:`laws` (every law processed from its node's path), :func:`cut`
(the end of each emitted block: EOS, then a constraint's dead slot, then a stop string) and
:func:`commit` (the history and the constraint states after the emitted tokens).

The modules behind it: :mod:`~asps_jax.controls.processors` (temperature, top-k, top-p, min-p;
``SamplingParams``), :mod:`~asps_jax.controls.sampling` (``Sampling``),
:mod:`~asps_jax.controls.penalties` (the path-dependent controls),
:mod:`~asps_jax.controls.history`, the regex / JSON-schema constraints
(:mod:`~asps_jax.controls.constraints`: compiling and the disk cache;
:mod:`~asps_jax.controls.dfa_sizes`: the size limits checked before compiling;
:mod:`~asps_jax.controls.dfa_worker`: the child process that compiles;
:mod:`~asps_jax.controls.automaton`: the automaton on device), stop strings
(:mod:`~asps_jax.controls.stopping`) and the token-bytes table both read
(:mod:`~asps_jax.controls.tokenbytes`). Outside this package, code imports this module only
(``from asps_jax import controls``; tests may read the modules behind it).
"""

from asps_jax.controls.automaton import allows_along, root_states
from asps_jax.controls.facade import commit, cut, is_eos, laws
from asps_jax.controls.history import History
from asps_jax.controls.processors import SamplingParams, logits_ok, process_logits, sample_token
from asps_jax.controls.sampling import HostConstraint, Sampling, bad_words_per_prompt
from asps_jax.controls.stopping import StopStrings, cached_table, stop_strings, validate_stop

__all__ = [
    "History",
    "HostConstraint",
    "Sampling",
    "SamplingParams",
    "StopStrings",
    "allows_along",
    "bad_words_per_prompt",
    "cached_table",
    "commit",
    "cut",
    "is_eos",
    "laws",
    "logits_ok",
    "process_logits",
    "root_states",
    "sample_token",
    "stop_strings",
    "validate_stop",
]
