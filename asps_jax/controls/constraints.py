"""Structured output: regex and JSON-schema constraints compiled (on the host) into token DFAs.

A regex (or a JSON schema, turned into a regex by outlines-core's ``json_schema`` module after
:func:`check_schema` refused the keywords that module would drop) is compiled once per (pattern,
vocabulary) by outlines-core's ``Index`` into a token-level DFA: state s, allowed tokens A(s),
next state δ(s, x). It is kept in memory and on disk (``<compilation cache
dir>/constraints/<sha256>.npz``, see :mod:`asps_jax.compile_cache`), keyed by a hash of the
pattern and the vocabulary's token byte strings. What would be too large is refused before
outlines-core runs (:mod:`~asps_jax.controls.dfa_sizes`, its bounds re-exported here), and
outlines-core itself runs in a child process of bounded memory and time
(:mod:`~asps_jax.controls.dfa_worker`).

Token classes. A DFA treats most tokens alike: every token of a string's body, say, moves every
state to the same next state. The tokens that every state treats alike form a class, and the DFA
is kept as ``classes int32[V]`` (each token's class) with ``next int32[S, C]`` over the classes —
an exact rewrite of the dense ``S x V`` table (``δ(s, x) = next[s, classes[x]]``) that is a few
hundred columns wide instead of V: a 436-state JSON schema over cl100k_base (100 261 ids) has 190
classes (0.33 MB instead of 175 MB). :mod:`~asps_jax.controls.dfa_worker` builds it without the
dense table. The DFAs of a batch are stacked into one table (:func:`stack`, ``S * C`` bounded by
:data:`MAX_TABLE_ENTRIES`), which :mod:`~asps_jax.controls.automaton` reads on device.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from asps_jax import compile_cache
from asps_jax.controls import dfa_worker, tokenbytes
from asps_jax.controls.automaton import FIRST, FREE, SINK
from asps_jax.controls.dfa_sizes import (
    MAX_INDEX_ENTRIES,
    MAX_PATTERN_DEPTH,
    MAX_PATTERN_LENGTH,
    MAX_SCHEMA_DEPTH,
    MAX_STATES,
    SCHEMA_KEYWORDS,
    SCHEMA_TYPES,
    check_schema,
    estimate_states,
    one_line,
    schema_error,
)
from asps_jax.controls.dfa_sizes import check_estimate as _check_estimate

__all__ = [  # the bounds and checks of dfa_sizes are part of this module's interface
    "FIRST", "FREE", "MAX_INDEX_ENTRIES", "MAX_PATTERN_DEPTH", "MAX_PATTERN_LENGTH",
    "MAX_SCHEMA_DEPTH", "MAX_STATES", "MAX_TABLE_ENTRIES", "SCHEMA_KEYWORDS", "SCHEMA_TYPES",
    "SINK", "STATS", "TokenDFA", "cache_dir", "check_schema", "compile_regex", "estimate_states",
    "schema_regex", "stack", "token_bytes",
]  # fmt: skip

MAX_TABLE_ENTRIES = 1 << 26
"""The bound on ``states x token classes`` of a batch's stacked DFA table (int32: 256 MiB)."""

_FORMAT = 2  # bump when the cached table layout changes (2: token classes)

STATS: collections.Counter = collections.Counter()
"""``compiled`` (outlines-core ran), ``disk`` (read from the disk cache), ``memory`` (reused in
this process): how each :func:`compile_regex` call was served."""

_MEMORY: dict[str, TokenDFA] = {}
_LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenDFA:
    """One compiled constraint as a token-class automaton: ``classes int32[V]`` (each token's
    class), ``next int32[S, C]`` (-1 forbidden; local state ids; ``δ(s, x) =
    next[s, classes[x]]``), ``final bool[S]``, ``start`` (the initial state) and ``key`` (the
    cache key)."""

    classes: np.ndarray
    next: np.ndarray
    final: np.ndarray
    start: int
    key: str

    @property
    def num_states(self) -> int:
        return self.next.shape[0]

    @property
    def num_classes(self) -> int:
        return self.next.shape[1]

    def dense(self) -> np.ndarray:
        """The dense ``int32[S, V]`` table (for small vocabularies and tests)."""
        return self.next[:, self.classes]


# ------------------------------------------------------------------------------------------
# The vocabulary


def token_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
    """The byte string each token id in ``[0, vocab_size)`` adds to the text — the table stop
    strings read too (:func:`asps_jax.controls.tokenbytes.token_bytes`) — with None where a
    constraint never allows the id: special tokens, ids the tokenizer does not have, tokens of no
    text."""
    special = tokenbytes.special_ids(tokenizer)
    pieces = tokenbytes.token_bytes(tokenizer, vocab_size)
    return [None if i in special or not piece else piece for i, piece in enumerate(pieces)]


def _vocabulary_hash(tokens: list[bytes | None]) -> str:
    digest = hashlib.sha256()
    for t in tokens:
        digest.update(b"\xff" if t is None else len(t).to_bytes(4, "little") + t)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------
# Compiling (host)


def cache_dir() -> Path | None:
    """Where compiled constraints are kept: ``constraints/`` in the compilation cache directory
    (:func:`asps_jax.compile_cache.default_dir`); None when ``$ASPS_JAX_NO_CACHE`` is set."""
    if compile_cache.disabled_by_env():
        return None
    return compile_cache.default_dir() / "constraints"


def _outlines_version() -> str:
    """Part of the cache key: another outlines-core may compile a pattern differently."""
    try:
        return importlib.metadata.version("outlines-core")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def compile_regex(
    pattern: str, tokens: list[bytes | None], *, what: str = "regex", notify=None
) -> TokenDFA:
    """The token DFA of ``pattern`` over the vocabulary ``tokens`` (:func:`token_bytes`):
    from memory, else the disk cache, else outlines-core (then written to the disk cache).

    Before outlines-core runs, a pattern longer than :data:`MAX_PATTERN_LENGTH`, nested deeper
    than :data:`MAX_PATTERN_DEPTH`, or whose estimated DFA (:func:`estimate_states`) is past
    the table bound is refused. A disk entry that cannot be read, or does not hold a valid table
    for this vocabulary, is compiled again and rewritten; ``notify`` (default: a warning on this
    module's logger, one line on stderr when logging is not configured) is told so in one line.
    """
    if not isinstance(pattern, str):
        raise ValueError(f"{what} must be a string, got {type(pattern).__name__}")
    try:
        pattern.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{what}: the pattern is not valid Unicode text (a lone surrogate at character "
            f"{err.start}?)"
        ) from None
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise ValueError(
            f"{what}: the pattern has {len(pattern)} characters, past the bound of "
            f"{MAX_PATTERN_LENGTH}: simplify it (for a schema: fewer or shallower properties)"
        )
    vocab = len(tokens)
    key = hashlib.sha256(
        f"{_FORMAT}\0{_outlines_version()}\0{pattern}\0{vocab}\0{_vocabulary_hash(tokens)}".encode()
    ).hexdigest()
    if key in _MEMORY:
        STATS["memory"] += 1
        return _MEMORY[key]
    directory = cache_dir()
    path = None if directory is None else directory / f"{key}.npz"
    broken = None
    if path is not None and path.exists():
        try:
            dfa = _load_entry(path, key, vocab)
        except Exception as err:  # any unusable entry (BadZipFile, EOFError, zlib.error,
            # OSError, a wrong shape, ...) is compiled again and rewritten
            broken = f"{type(err).__name__}: {one_line(err)}".rstrip(": ")
        else:
            STATS["disk"] += 1
            _MEMORY[key] = dfa
            return dfa
    _check_estimate(pattern, vocab, what)
    dfa = _compile(pattern, tokens, key, what)
    STATS["compiled"] += 1
    _MEMORY[key] = dfa
    written = False
    if path is not None:
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            np.savez_compressed(
                tmp, classes=dfa.classes, next=dfa.next, final=dfa.final, start=dfa.start
            )
            os.replace(tmp, path)
            written = True
        except OSError:  # a read-only cache: compile next time
            with contextlib.suppress(OSError):
                tmp.unlink()
    if broken is not None:
        (notify or _LOG.warning)(
            f"{what}: the constraint cache entry {path} was unusable ({broken}); compiled again"
            + (" and rewritten" if written else " (it could not be rewritten)")
        )
    return dfa


def _load_entry(path: Path, key: str, vocab: int) -> TokenDFA:
    """A disk cache entry, checked against the shape its key promises: a ValueError (or the
    loader's own error) when it does not hold a valid table over ``vocab`` tokens."""
    with np.load(path, allow_pickle=False) as data:
        classes, nxt, final, start = data["classes"], data["next"], data["final"], data["start"]
    if nxt.dtype != np.int32 or nxt.ndim != 2 or min(nxt.shape) < 1:
        raise ValueError(f"next is {nxt.dtype}{list(nxt.shape)}, not int32[S >= 1, C >= 1]")
    states, num_classes = nxt.shape
    if states * num_classes > MAX_TABLE_ENTRIES:
        raise ValueError(f"{states} states x {num_classes} classes is past the table bound")
    if classes.dtype != np.int32 or classes.shape != (vocab,):
        raise ValueError(f"classes is {classes.dtype}{list(classes.shape)}, not int32[{vocab}]")
    if vocab and (int(classes.min()) < 0 or int(classes.max()) >= num_classes):
        raise ValueError(f"classes holds a class outside [0, {num_classes})")
    if nxt.size and (int(nxt.min()) < -1 or int(nxt.max()) >= states):
        raise ValueError(f"next holds a state outside [-1, {states})")
    if final.dtype != np.bool_ or final.shape != (states,):
        raise ValueError(f"final is {final.dtype}{list(final.shape)}, not bool[{states}]")
    if start.ndim != 0 or start.dtype.kind not in "iu" or not 0 <= int(start) < states:
        raise ValueError(f"start is {start!r}, not a state in [0, {states})")
    return TokenDFA(classes, nxt, final, int(start), key)


def _half_the_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (AttributeError, OSError, ValueError):  # pragma: no cover - not POSIX
        return 8 << 30


COMPILE_MEMORY_BYTES = max(2 << 30, _half_the_memory())
"""The address space outlines-core may use to build one DFA (half the physical memory, at least
2 GiB), in a child process (:mod:`asps_jax.controls.dfa_worker`): past it the child stops and the
pattern is refused in one line, where the index builder would exhaust the memory or abort the
process."""

COMPILE_SECONDS = 120.0
"""The time outlines-core may take to build one DFA (seconds): past it the child is stopped and
the pattern refused. An ordinary schema takes well under a second at 2 048 tokens and 7-15 s at
a 100 k vocabulary; a top-level ``{"type": "string", "maxLength": 50}`` would run on (its
search automaton explodes inside outlines-core) until the memory limit, minutes later."""


def _compile(pattern: str, tokens: list[bytes | None], key: str, what: str) -> TokenDFA:
    """outlines-core's DFA of ``pattern``, built in a child process
    (:mod:`asps_jax.controls.dfa_worker`) bounded by :data:`COMPILE_MEMORY_BYTES` (or the caller's
    lower address-space limit) and :data:`COMPILE_SECONDS`, so that no pattern can take this
    process down."""
    if importlib.util.find_spec("outlines_core") is None:  # pragma: no cover - a dependency
        raise ValueError(f"{what}: constraints need outlines-core (pip install outlines-core)")
    if all(t is None for t in tokens):
        raise ValueError(f"{what}: the tokenizer has no usable token")
    # The child keeps a lower address-space limit the caller runs under (never raises it).
    bound = min(dfa_worker.inherited_limit() or COMPILE_MEMORY_BYTES, COMPILE_MEMORY_BYTES)
    request = pickle.dumps((pattern, tokens, MAX_TABLE_ENTRIES, bound))
    fix = "simplify the pattern (bound repetitions and string lengths, e.g. maxLength)"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    worker = [sys.executable, str(Path(__file__).with_name("dfa_worker.py"))]
    try:
        run = dict(input=request, capture_output=True, timeout=COMPILE_SECONDS, env=env)
        done = subprocess.run(worker, **run)
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"{what}: outlines-core took more than {COMPILE_SECONDS:g} s to build the "
            f"constraint's DFA and was stopped: {fix}"
        ) from None
    if done.returncode in (-signal.SIGINT, 128 + signal.SIGINT):
        raise KeyboardInterrupt  # Ctrl-C reached the child too
    try:
        result = pickle.loads(done.stdout) if done.returncode == 0 else ("crash", "")
    except (pickle.UnpicklingError, EOFError, ValueError):
        result = ("crash", "")
    kind = result[0]
    if kind == "ok":
        return TokenDFA(result[1], result[2], result[3], 0, key)
    if kind == "compile":
        raise ValueError(f"{what} {pattern!r} does not compile: {result[1]}")
    if kind == "size":
        raise ValueError(_size_error(what, result[1], result[2]))
    stderr = done.stderr.decode(errors="replace").strip().splitlines()
    last = one_line(stderr[-1]) if stderr else "no message"
    if bound < COMPILE_MEMORY_BYTES:  # the caller's limit, not the pattern, may be at fault
        detail = "out of memory" if kind == "memory" else f"exit status {done.returncode}: {last}"
        raise ValueError(dfa_worker.limit_error(what, bound, COMPILE_MEMORY_BYTES, detail))
    if kind == "memory" or (stderr and "memory allocation" in stderr[-1]):
        raise ValueError(
            f"{what}: outlines-core needed more than {bound / (1 << 30):.1f} GiB to build the "
            f"constraint's DFA and was stopped: {fix}"
        )
    raise ValueError(
        f"{what}: outlines-core failed building the constraint's DFA (exit status "
        f"{done.returncode}: {last}): {fix}"
    )


def _size_error(what: str, states: int, classes: int) -> str:
    return (
        f"{what}: the constraint's DFA has {states} states x {classes} token classes = "
        f"{states * classes} table entries, past the bound of {MAX_TABLE_ENTRIES}: simplify the "
        "pattern (bound repetitions and string lengths, e.g. maxLength)"
    )


def schema_regex(schema) -> str:
    """The regex of a JSON schema (a dict or its JSON text), after :func:`check_schema`."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise schema_error(f"not valid JSON ({one_line(err)})") from None
        except RecursionError:
            raise schema_error(
                f"not read: the JSON text nests too deeply (the schema's limit is "
                f"{MAX_SCHEMA_DEPTH} levels)"
            ) from None
    if not isinstance(schema, dict):
        raise ValueError(
            f"json_schema must be a dict or its JSON text, got {type(schema).__name__}"
        )
    check_schema(schema)
    from outlines_core import json_schema

    try:
        text = json.dumps(schema)
    except (TypeError, ValueError, RecursionError) as err:  # a value (const, default) in it
        raise schema_error(f"not JSON-serialisable ({one_line(err)})") from None
    try:
        return json_schema.build_regex_from_schema(text)
    except (ValueError, TypeError, RuntimeError) as err:
        raise schema_error(f"refused by outlines-core: {one_line(err)}") from None


def stack(dfas: list[TokenDFA | None], vocab: int):
    """One table for a batch: ``(classes int32[V], next int32[S, C], final bool[S], start
    int32[B])`` with the sink at 0, the free state at 1 (rows without a constraint) and each
    distinct DFA after, its states offset. The classes are the batch's joint classes (tokens in
    the same class of every DFA); S and C are padded to multiples of 64 (C at most V) with
    sink rows and unused columns (fewer compiled shapes)."""
    distinct: dict[str, TokenDFA] = {}
    for dfa in dfas:
        if dfa is not None:
            distinct.setdefault(dfa.key, dfa)
    per_dfa = np.stack([d.classes for d in distinct.values()] or [np.zeros(vocab, np.int32)])
    classes, representatives = dfa_worker.number_classes(per_dfa.T)  # a token's key: its classes
    joint = per_dfa[:, representatives]  # [D, C_joint]: each joint class's class in each DFA
    size = FIRST + sum(d.num_states for d in distinct.values())
    padded = -(-size // 64) * 64
    width = max(1, min(-(-joint.shape[1] // 64) * 64, vocab))
    if padded * width > MAX_TABLE_ENTRIES:
        raise ValueError(_size_error("the batch's constraints", padded, width))
    table = np.full((padded, width), -1, np.int32)
    table[FREE] = FREE
    final = np.zeros(padded, bool)
    final[FREE] = True
    offsets, at = {}, FIRST
    for d, columns in zip(distinct.values(), joint):
        part = d.next[:, columns]  # [S_d, C_joint]: each joint class's column in this DFA
        table[at : at + d.num_states, : part.shape[1]] = np.where(part >= 0, part + at, -1)
        final[at : at + d.num_states] = d.final
        offsets[d.key] = at
        at += d.num_states
    start = np.array([FREE if d is None else offsets[d.key] + d.start for d in dfas], np.int32)
    return classes, table, final, start
