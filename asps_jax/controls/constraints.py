"""Structured output: regex and JSON-schema constraints as token DFAs, applied per tree node.

Host side. A regex (or a JSON schema, turned into a regex by outlines-core's ``json_schema``
module after :func:`check_schema` refused the keywords that module would drop) is compiled once
per (pattern, vocabulary) by outlines-core's ``Index`` into a token-level DFA: state s, allowed
tokens A(s), next state δ(s, x). It is kept in memory and on disk (``<compilation cache
dir>/constraints/<sha256>.npz``, see :mod:`asps_jax.compile_cache`), keyed by a hash of the
pattern and the vocabulary's token byte strings.

Token classes. A DFA treats most tokens alike: every token of a string's body, say, moves every
state to the same next state. The tokens that every state treats alike form a class, and the DFA
is kept as ``classes int32[V]`` (each token's class) with ``next int32[S, C]`` over the classes —
an exact rewrite of the dense ``S x V`` table (``δ(s, x) = next[s, classes[x]]``) that is a few
hundred columns wide instead of V: a 436-state JSON schema over cl100k_base (100 261 ids) has 190
classes (0.33 MB instead of 175 MB). :mod:`asps_jax.controls.dfa_worker` builds it without the dense
table.

Device side. The DFAs of a batch are stacked into one table over their joint classes (tokens that
every DFA of the batch puts in the same class): ``classes int32[V]``, ``next int32[S, C]`` (-1 =
forbidden) with ``final bool[S]`` (accepting states) and a start state per row; state 0 is the
sink (nothing allowed), state 1 the free state of an unconstrained row (everything allowed,
accepting). ``S * C`` is bounded by :data:`MAX_TABLE_ENTRIES`. Since outlines-core builds every
transition of the DFA (``S x V`` of them, less the forbidden ones) before it can be counted, and
aborts the process when that runs out of memory, what would be too large is refused before it
runs: a regex whose estimated DFA (:func:`estimate_states`: counted repetitions unrolled) is past
:data:`MAX_STATES` or whose transitions would be past :data:`MAX_INDEX_ENTRIES`, or longer /
deeper than :data:`MAX_PATTERN_LENGTH` / :data:`MAX_PATTERN_DEPTH`; a schema
nested deeper than :data:`MAX_SCHEMA_DEPTH`, recursive, or whose regex would be past the length
bound (:func:`check_schema`). Each row carries its committed state (``History.dfa``; -1 before
the first generated token = the row's start state); a tree node's state is δ* of its path below
the root (the same path the penalties read), and the mask — the tokens with ``next >= 0``, plus
the EOS ids in accepting states — is the first processor of every law: draft, target and bonus.

A node whose state allows nothing (a dead state: e.g. an accepting state with no transition when
EOS is disabled) ends the row there: the draft law is empty, so its chain ends before it, and the
slot drawn from its target law is dropped (:func:`dead_slots`). Every verifier is exact for
arbitrary laws per node, so the output law is the law of constrained sampling from the masked,
renormalised target without speculation.
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
import re
import signal
import subprocess
import sys
import urllib.parse
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax import compile_cache
from asps_jax.controls import dfa_worker, tokenbytes

MAX_TABLE_ENTRIES = 1 << 26
"""The bound on ``states x token classes`` of a batch's stacked DFA table (int32: 256 MiB)."""

MAX_INDEX_ENTRIES = 1 << 27
"""The bound on ``estimated states x vocabulary``: about the transitions outlines-core would
build (in Rust maps, before anything can be counted): 512 states at V = 262 k (a 444-state schema
is 116 M), 1 342 at V = 100 k; ``[a-z]{1,100000}`` at V = 2 048 (205 M) ran 40 s into a
MemoryError. Past it a pattern is refused before outlines-core runs."""

SINK, FREE, FIRST = 0, 1, 2  # global state ids: the sink, the free state, the first pattern state
_FORMAT = 2  # bump when the cached table layout changes (2: token classes)

STATS: collections.Counter = collections.Counter()
"""``compiled`` (outlines-core ran), ``disk`` (read from the disk cache), ``memory`` (reused in
this process): how each :func:`compile_regex` call was served."""

_MEMORY: dict[str, TokenDFA] = {}
_LOG = logging.getLogger(__name__)

# Schema keywords outlines-core's regex compiler enforces exactly (or more strictly: objects
# keep their properties' order and admit no other property). Anything else is refused, so that
# nothing is silently dropped: e.g. it turns {"type": "integer", "minimum": 0, "maximum": 120}
# into a regex that accepts 121 and -5.
SCHEMA_KEYWORDS = (
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "enum", "const", "anyOf", "$ref", "$defs",
    "definitions", "title", "description", "$schema", "$id", "$comment", "examples", "default",
)  # fmt: skip
SCHEMA_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")


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


def _one_line(err) -> str:
    return " ".join(str(err).split())


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
            broken = f"{type(err).__name__}: {_one_line(err)}".rstrip(": ")
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
    last = _one_line(stderr[-1]) if stderr else "no message"
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


# ------------------------------------------------------------------------------------------
# The size of a regex's DFA, estimated before outlines-core builds it

MAX_PATTERN_LENGTH = 1_000_000
"""The longest pattern compiled (characters). Python's regex parser, which the estimate runs,
reads about 0.4 M characters a second; outlines-core's regex for an object of 150 optional
properties is 0.5 M characters long (and compiles in a few seconds)."""

MAX_PATTERN_DEPTH = 100
"""The deepest nesting of groups, alternations and repetitions in a pattern's parse tree
(outlines-core's parser stops at 250 nested groups, Python's at about 490; the regex of a schema
:data:`MAX_SCHEMA_DEPTH` arrays deep nests about 55)."""

MAX_STATES = 1 << 18
"""The most DFA states the estimate admits, whatever the vocabulary (a small vocabulary would
otherwise admit millions of states, each a Python dict of transitions while compiling)."""

_HUGE = 1 << 62  # the estimates saturate here (no arbitrarily large integers)

try:  # Python's own regex parser (sre_parse): outlines-core's syntax is close to Python's
    import re._parser as _sre
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre

_REPEATS = tuple(
    op for op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", None)) if op
)
_GROUPS = tuple(op for op in (getattr(_sre, "ATOMIC_GROUP", None),) if op)
_ONE_CHAR = (_sre.NOT_LITERAL, _sre.ANY)

# UTF-8 DFA states per position of Rust's Unicode classes (outlines-core: \d, \w, \s are
# Unicode-aware; measured on ``(X){10}`` with outlines-core 0.2.14), and of any other class that
# admits every multi-byte character (``.``, ``[^"]``).
_CATEGORY_STATES = {
    _sre.CATEGORY_DIGIT: 25, _sre.CATEGORY_NOT_DIGIT: 26, _sre.CATEGORY_WORD: 316,
    _sre.CATEGORY_NOT_WORD: 319, _sre.CATEGORY_SPACE: 8, _sre.CATEGORY_NOT_SPACE: 8,
}  # fmt: skip
_ANY_STATES = 8

# Rust-only syntax Python's parser refuses, rewritten to a Python equivalent of the same size:
# \p{..} / \P{..} (Unicode classes: as large as \w), \x{..} / \u{..} / \U{..}, (?<name>..), and
# inline flags anywhere (dropped; they change no position count).
_RUST_ONLY = re.compile(
    r"\\[pP](?:\{[^}]*\}|[A-Za-z])|\\[xuU]\{([0-9A-Fa-f]{1,8})\}|\\z|\(\?P?<(?=[A-Za-z_])"
    r"|\(\?[A-Za-z-]+([:)])|\\.",
    re.S,
)


def _to_python_syntax(pattern: str) -> str:
    def swap(m: re.Match) -> str:
        text = m.group()
        if text[:2] in ("\\p", "\\P"):
            return "\\w"
        if m.group(1) is not None:
            code = int(m.group(1), 16)
            return f"\\U{code:08X}" if code <= 0x10FFFF else text
        if text == "\\z":
            return "\\Z"
        if text.startswith("(?") and text.endswith("<"):
            return "(?P<"
        if m.group(2) is not None:
            return "(?:" if m.group(2) == ":" else ""
        return text

    return _RUST_ONLY.sub(swap, pattern)


def _utf8_suffixes(lo: int, hi: int, into: set) -> None:
    """Add to ``into`` the proper suffixes (byte-range tuples) of the UTF-8 sequences of the
    code points [lo, hi] (surrogates excluded): the split of Rust's ``Utf8Sequences``."""
    todo = [(lo, hi)]
    while todo:
        s, e = todo.pop()
        if s > e:
            continue
        if s <= 0xDFFF and e >= 0xD800:  # no surrogate is encoded
            todo += [(s, 0xD7FF), (0xE000, e)]
            continue
        split = next((b for b in (0x7F, 0x7FF, 0xFFFF) if s <= b < e), None)
        if split is not None:
            todo += [(s, split), (split + 1, e)]
            continue
        if e <= 0x7F:
            continue  # one byte: no intermediate state
        for i in (1, 2, 3):
            m = (1 << (6 * i)) - 1
            if s & ~m != e & ~m:
                if s & m:
                    todo += [(s, s | m), ((s | m) + 1, e)]
                    break
                if e & m != m:
                    todo += [(s, (e & ~m) - 1), (e & ~m, e)]
                    break
        else:
            seq = tuple(zip(chr(s).encode(), chr(e).encode()))
            into.update(seq[k:] for k in range(1, len(seq)))


def _class_states(items) -> int:
    """UTF-8 DFA states per position of a character class (Python's parse of ``[...]``): 1,
    plus its intermediate states (the distinct proper suffixes of its UTF-8 sequences, which
    the DFA shares), plus the measured size of each Unicode category in it."""
    ranges, extra, negate = [], 0, False
    for op, av in items:
        if op is _sre.NEGATE:
            negate = True
        elif op is _sre.LITERAL:
            ranges.append((av, av))
        elif op is _sre.RANGE:
            ranges.append(av)
        elif op is _sre.CATEGORY:
            extra += _CATEGORY_STATES.get(av, _ANY_STATES)
        else:
            extra += _ANY_STATES
    if negate:
        if extra:
            return 1 + _ANY_STATES + extra
        rest, at = [], 0
        for lo, hi in sorted(ranges):
            if lo > at:
                rest.append((at, lo - 1))
            at = max(at, hi + 1)
        ranges = rest + ([(at, 0x10FFFF)] if at <= 0x10FFFF else [])
    suffixes: set = set()
    for lo, hi in ranges:
        _utf8_suffixes(lo, min(hi, 0x10FFFF), suffixes)
    return 1 + len(suffixes) + extra


class _Estimate:
    """The position count of :func:`estimate_states` over one parse. Each distinct subtree
    (by structure: a capturing group's number aside) is measured once: its positions, and its
    height for the depth bound."""

    def __init__(self):
        self.keys: dict[int, int] = {}  # id of a parsed subpattern -> its structural key
        self.sizes: dict[int, tuple[int, int]] = {}  # structural key -> (positions, height)

    def seq_key(self, sub) -> int:
        key = self.keys.get(id(sub))
        if key is None:
            key = self.keys[id(sub)] = hash(tuple(self.key(item) for item in sub))
        return key

    def key(self, item) -> int:
        op, av = item
        if op is _sre.IN:
            return hash((op, tuple(av)))
        if op is _sre.SUBPATTERN:
            return hash((op, av[1], av[2], self.seq_key(av[-1])))
        if op in _GROUPS:
            return hash((op, self.seq_key(av)))
        if op is _sre.BRANCH:
            return hash((op, tuple(self.seq_key(b) for b in av[1])))
        if op in _REPEATS:
            return hash((op, av[0], av[1], self.seq_key(av[2])))
        if op in (_sre.ASSERT, _sre.ASSERT_NOT):
            return hash((op, av[0], self.seq_key(av[1])))
        if op is _sre.GROUPREF_EXISTS:
            return hash((op, av[0], *(self.seq_key(b) for b in av[1:] if b is not None)))
        try:
            return hash((op, av))
        except TypeError:
            return hash((op, id(av)))

    def seq(self, sub) -> tuple[int, int]:
        """(positions, height) of a concatenation."""
        total = height = 0
        for item in sub:
            n, h = self.item(item)
            total, height = min(total + n, _HUGE), max(height, h)
        return total, height

    def item(self, item) -> tuple[int, int]:
        key = self.key(item)
        known = self.sizes.get(key)
        if known is None:
            known = self.sizes[key] = self._measure(item)
            if known[1] > MAX_PATTERN_DEPTH:
                raise _TooDeep
        return known

    def _measure(self, item) -> tuple[int, int]:
        op, av = item
        if op is _sre.LITERAL:
            return len(chr(av).encode("utf-8", "surrogatepass")), 0
        if op in _ONE_CHAR:
            return 1 + _ANY_STATES, 0
        if op is _sre.IN:
            return _class_states(av), 0
        if op is _sre.AT:
            return 0, 0
        if op is _sre.SUBPATTERN:
            n, h = self.seq(av[-1])
        elif op in _GROUPS:
            n, h = self.seq(av)
        elif op is _sre.BRANCH:
            n, h = self.branch(av[1])
        elif op in _REPEATS:
            lo, hi, body = av
            count = lo + 1 if hi == _sre.MAXREPEAT else max(lo, hi)
            n, h = self.seq(body)
            n = min(count * n, _HUGE)
        elif op is _sre.GROUPREF_EXISTS:
            parts = [self.seq(b) for b in av[1:] if b is not None]
            n, h = sum(p[0] for p in parts), max((p[1] for p in parts), default=0)
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            n, h = self.seq(av[1])
        else:  # a group reference, ...: outlines-core has none of these; count one position
            return 1, 0
        return n, h + 1

    def branch(self, branches) -> tuple[int, int]:
        """Alternatives: the DFA reads their common prefixes once (a trie of their items), and
        their last positions lead to the same continuation (one state for all)."""
        trie: set[tuple[int, int]] = set()
        total = height = biggest = ends = 0
        for sub in branches:
            node, size = 0, 0
            for item in sub:
                n, h = self.item(item)
                size, height = min(size + n, _HUGE), max(height, h)
                step = (node, self.key(item))
                if step not in trie:
                    trie.add(step)
                    total = min(total + n, _HUGE)
                node = hash(step)
            biggest, ends = max(biggest, size), ends + (size > 0)
        return max(total - max(ends - 1, 0), biggest), height


class _TooDeep(Exception):
    pass


def estimate_states(pattern: str) -> int | None:
    """An estimate of the number of states of ``pattern``'s DFA, computed without building it;
    None when Python's regex parser cannot read the pattern (outlines-core then decides).

    It is the number of positions of a Glushkov (position) automaton of the pattern over UTF-8
    bytes: a literal counts its UTF-8 bytes, a character class 1 plus the intermediate states of
    its multi-byte sequences (``[^"]``: 8; Rust's Unicode ``\\w``: 316), concatenation adds up,
    alternatives count their common prefixes once (a trie of their items) and less one per
    alternative after the first (their last positions merge), and a repetition ``{m,n}``
    counts ``max(m, n)`` copies of its body (``m + 1`` when unbounded: ``*`` 1, ``+`` 2). It is
    no strict bound either way, but close to the states outlines-core (0.2.14) builds, over a
    vocabulary of every byte: 435 against 436 for the regex of an object of two strings of
    maxLength 20 and an integer, 100 against 101 for ``[a-z]{1,100}``, 3 582 against 3 246 for
    an untyped schema; up to twice them for objects with optional properties. A
    :class:`ValueError` when the pattern nests deeper than
    :data:`MAX_PATTERN_DEPTH` (Python's RecursionError included).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FutureWarning: possible nested set, ...
            parsed = _sre.parse(_to_python_syntax(pattern))
        return _Estimate().seq(parsed)[0]
    except (RecursionError, _TooDeep):  # Python's parser, or the measure
        raise ValueError(
            f"the pattern nests more than {MAX_PATTERN_DEPTH} levels deep (groups, "
            "alternations, repetitions)"
        ) from None
    except Exception:  # not Python syntax (re.error, OverflowError, ...)
        return None


def _check_estimate(pattern: str, vocab: int, what: str) -> None:
    try:
        estimate = estimate_states(pattern)
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None
    if estimate is None:
        return
    if estimate > min(MAX_STATES, MAX_INDEX_ENTRIES // max(vocab, 1)):
        shown = f"{estimate}" if estimate < _HUGE else f"more than {_HUGE}"
        raise ValueError(
            f"{what}: the constraint's DFA is estimated (counted repetitions unrolled) at "
            f"{shown} states x {vocab} tokens, past the bound of {MAX_INDEX_ENTRIES} "
            f"transitions (and of {MAX_STATES} states): refused before compiling; bound the "
            "repetitions ({m,n} with a smaller n, maxLength / maxItems in a schema)"
        )


MAX_SCHEMA_DEPTH = 10
"""The deepest nesting of a JSON schema compiled: the steps into a property, an array's items or
an anyOf branch along any path, $ref targets expanded where they are used (a $ref itself is no
step). outlines-core writes an array's items twice in its regex, so the regex doubles with every
array level. Measured with outlines-core 0.2.14 at 2 048 tokens: 10 nested arrays of integers
are a 50 k-character regex with 8 188 DFA states (0.8 s through :func:`compile_regex`), 12 have
32 764 states (just inside the table bound), 16 take 15 s and 1.3 GB in outlines-core's index,
20 abort the process inside outlines-core (its regex is 51 M characters)."""


def _schema_error(message: str) -> ValueError:
    return ValueError(f"json_schema: {message}")


def _deep(where: str) -> ValueError:
    return _schema_error(
        f"the schema nests {MAX_SCHEMA_DEPTH + 1} levels deep at {where or '/'} (properties, "
        f"items, anyOf branches; $ref targets expanded), past the limit of {MAX_SCHEMA_DEPTH}"
    )


def check_schema(schema, where: str = "") -> None:
    """Refuse (one-line ``ValueError``) every keyword outlines-core's regex compiler does not
    enforce exactly (the supported ones are :data:`SCHEMA_KEYWORDS`), a schema nested deeper
    than :data:`MAX_SCHEMA_DEPTH`, a recursive one (a ``$ref`` to a schema it is inside), and
    one whose regex would be longer than :data:`MAX_PATTERN_LENGTH` even at its shortest
    (``$ref`` targets inlined, array items and optional properties repeated): before
    outlines-core writes that regex."""
    try:
        _check_keywords(schema, where, 0)
        if not where:
            _check_expansion(schema)
    except RecursionError:
        raise _schema_error("the schema nests too deeply to be read") from None


def _check_keywords(schema, where: str, depth: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise _deep(where)
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise _schema_error(f"the schema at {where or '/'} must be an object, got {schema!r}")
    for name, value in schema.items():
        at = f"{where}/{name}"
        if name not in SCHEMA_KEYWORDS:
            raise _schema_error(
                f"keyword {name!r} at {at} is not enforced by the regex compiler "
                f"(outlines-core): refused rather than dropped; supported: "
                f"{', '.join(SCHEMA_KEYWORDS)}"
            )
        if name == "type" and value not in SCHEMA_TYPES:
            raise _schema_error(
                f"type {value!r} at {at} is not supported (one of {', '.join(SCHEMA_TYPES)})"
            )
        if name == "additionalProperties" and value is not False:
            raise _schema_error(
                f"additionalProperties at {at} must be false (the compiled regex admits the "
                f"listed properties only), got {value!r}"
            )
        if name in ("properties", "$defs", "definitions"):
            if not isinstance(value, dict):
                raise _schema_error(f"{name} at {at} must be an object")
            # A definition is no level of its own: it is counted where a $ref uses it.
            inner = depth + 1 if name == "properties" else depth
            for sub, subschema in value.items():
                _check_keywords(subschema, f"{at}/{sub}", inner)
        elif name == "items":
            for i, sub in enumerate(value if isinstance(value, list) else [value]):
                _check_keywords(sub, f"{at}/{i}" if isinstance(value, list) else at, depth + 1)
        elif name == "anyOf":
            if not isinstance(value, list) or not value:
                raise _schema_error(f"anyOf at {at} must be a non-empty list")
            for i, sub in enumerate(value):
                _check_keywords(sub, f"{at}/{i}", depth + 1)


def _resolve(root, ref):
    """The schema a local ``$ref`` (``#``, ``#/$defs/x``, any JSON pointer) points at in
    ``root``; None for any other reference (outlines-core reports those)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    pointer = urllib.parse.unquote(ref[1:])
    if not pointer:
        return root
    if not pointer.startswith("/"):
        return None
    node = root
    for part in pointer[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


_SCALAR_CHARS, _ANY_CHARS = 10, 5000


def _json_chars(value) -> int:
    try:
        return len(json.dumps(value))
    except (TypeError, ValueError, RecursionError):
        return 1


def _check_expansion(root) -> None:
    """Walk the schema as outlines-core expands it (``$ref`` targets inlined): refuse a path
    deeper than :data:`MAX_SCHEMA_DEPTH`, a ``$ref`` cycle, and a schema whose regex would be
    past :data:`MAX_PATTERN_LENGTH` even at its shortest. Each ``$ref`` target is measured once
    (its height and shortest regex length are memoised), so a schema that uses a definition many
    times costs no more to check than its text."""
    memo: dict[int, tuple[int, int]] = {}  # id of a $ref target -> (height, regex characters)

    def walk(node, where: str, depth: int, inside: frozenset) -> tuple[int, int]:
        if depth > MAX_SCHEMA_DEPTH:
            raise _deep(where)
        if not isinstance(node, dict):
            return 0, _ANY_CHARS if node is True else 1
        inside = inside | {id(node)}  # the schemas this one is inside, and itself
        height = chars = 0

        def into(sub, segment: str) -> int:
            nonlocal height
            h, c = walk(sub, where + segment, depth + 1, inside)
            height = max(height, h + 1)
            return c

        ref = node.get("$ref")
        target = None if ref is None else _resolve(root, ref)
        if target is not None:
            if id(target) in inside:
                raise _schema_error(
                    f"$ref {ref!r} at {where}/$ref points at a schema it is inside (a recursive "
                    "schema): refused, since outlines-core unrolls recursion a fixed number of "
                    "times and then admits values the schema rejects"
                )
            known = memo.get(id(target))
            if known is None or depth + known[0] > MAX_SCHEMA_DEPTH:  # (too deep: raises)
                known = memo[id(target)] = walk(target, f"{where}/$ref[{ref}]", depth, inside)
            height, chars = max(height, known[0]), chars + known[1]
        props, items, any_of = node.get("properties"), node.get("items"), node.get("anyOf")
        if isinstance(props, dict):
            required = node.get("required")
            optional = not (isinstance(required, list) and required)
            for i, (name, sub) in enumerate(props.items()):
                c = into(sub, f"/properties/{name}")
                # With no required property, outlines-core writes property i once for each
                # property from i on (each of them may be the first one present).
                chars += (len(props) - i if optional else 1) * (len(str(name)) + 2 + c)
        if isinstance(items, list):
            for i, sub in enumerate(items):
                chars += into(sub, f"/items/{i}")
        elif items is not None:  # written twice: (item(,item){m-1,n-1}), none when maxItems 0
            chars += (0 if node.get("maxItems") == 0 else 2) * into(items, "/items")
        if isinstance(any_of, list):
            for i, sub in enumerate(any_of):
                chars += into(sub, f"/anyOf/{i}")
        if target is None and props is None and items is None and any_of is None:
            chars += _leaf_chars(node)
        return height, min(chars, _HUGE)

    chars = walk(root, "", 0, frozenset())[1]
    if chars > MAX_PATTERN_LENGTH:
        raise _schema_error(
            f"the schema's regex would have at least {chars} characters ($ref targets inlined; "
            "outlines-core writes array items twice and an optional property once per later "
            f"one), past the bound of {MAX_PATTERN_LENGTH}: use fewer or shallower properties "
            "and definitions, or mark properties required"
        )


def _leaf_chars(node: dict) -> int:
    """The fewest characters outlines-core (0.2.14) writes for a schema with no subschema:
    ``(-)?(0|[1-9][0-9]*)`` for an integer is 19, ``null`` 4, an enum its values' JSON; an
    untyped value (any JSON) is 13 879, an untyped object or array about 6 900."""
    if "enum" in node and isinstance(node["enum"], list):
        return sum(_json_chars(v) for v in node["enum"])
    if "const" in node:
        return _json_chars(node["const"])
    kind = node.get("type")
    if kind == "string" and isinstance(node.get("pattern"), str):
        return len(node["pattern"])
    if kind == "null":
        return 4
    if kind in ("string", "integer", "number", "boolean"):
        return _SCALAR_CHARS
    if kind == "object" and node.get("additionalProperties") is False:
        return 4
    return _ANY_CHARS


def schema_regex(schema) -> str:
    """The regex of a JSON schema (a dict or its JSON text), after :func:`check_schema`."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise _schema_error(f"not valid JSON ({_one_line(err)})") from None
        except RecursionError:
            raise _schema_error(
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
        raise _schema_error(f"not JSON-serialisable ({_one_line(err)})") from None
    try:
        return json_schema.build_regex_from_schema(text)
    except (ValueError, TypeError, RuntimeError) as err:
        raise _schema_error(f"refused by outlines-core: {_one_line(err)}") from None


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


# ------------------------------------------------------------------------------------------
# On device


def root_states(sampling, history) -> jax.Array:
    """int32[B]: each row's committed DFA state (its start state before any generated token)."""
    return jnp.where(history.dfa < 0, sampling.dfa_start, history.dfa)


def advance(sampling, states, tokens) -> jax.Array:
    """δ(state, token) elementwise; a forbidden token leads to the sink."""
    nxt = sampling.dfa_next[states, sampling.dfa_classes[jnp.asarray(tokens, jnp.int32)]]
    return jnp.where(nxt >= 0, nxt, SINK)


def node_states(sampling, history, path_BXD, depth_BX) -> jax.Array:
    """int32[B, X]: δ* of each node's path below the root (the first ``depth`` tokens) from the
    row's committed state."""
    states = jnp.broadcast_to(root_states(sampling, history)[:, None], depth_BX.shape)
    for d in range(path_BXD.shape[2]):
        moved = advance(sampling, states, path_BXD[:, :, d])
        states = jnp.where(d < depth_BX, moved, states)
    return states


def allowed(sampling, states) -> jax.Array:
    """bool[..., V]: the tokens allowed in each state (the EOS ids in accepting states only)."""
    vocab = sampling.dfa_classes.shape[0]
    eos = sampling.eos_ids
    is_eos_V = jnp.zeros(vocab, bool).at[jnp.where(eos >= 0, eos, vocab)].set(True, mode="drop")
    steps = jnp.take(sampling.dfa_next[states] >= 0, sampling.dfa_classes, axis=-1)
    is_eos = is_eos_V.reshape((1,) * (steps.ndim - 1) + (vocab,))
    return (steps & ~is_eos) | (sampling.dfa_final[states][..., None] & is_eos)


def allows(sampling, states, tokens) -> jax.Array:
    """bool, elementwise: ``tokens`` is allowed in ``states`` (:func:`allowed` at one token each,
    without the ``[..., V]`` table)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    eos = sampling.eos_ids.reshape((1,) * tokens.ndim + (-1,))
    is_eos = jnp.any(tokens[..., None] == eos, axis=-1)
    step = sampling.dfa_next[states, sampling.dfa_classes[tokens]] >= 0
    return jnp.where(is_eos, sampling.dfa_final[states], step)


def mask(sampling, history, logits_BXV, path_BXD, depth_BX):
    """The logits with every token outside each node's allowed set at ``-inf``, and whether each
    node's state allows nothing (bool[B, X]); ``(logits, None)`` when no row is constrained."""
    if not sampling.constrained:
        return logits_BXV, None
    ok_BXV = allowed(sampling, node_states(sampling, history, path_BXD, depth_BX))
    return jnp.where(ok_BXV, logits_BXV, -jnp.inf), ~jnp.any(ok_BXV, axis=-1)


def dead_slots(sampling, history, block_BT, num_B):
    """Cut each emitted block before its first slot drawn at a dead node (a state that allows
    nothing: the constrained text ended after the previous token); returns ``(num, ended)``."""
    if not sampling.constrained:
        return num_B, jnp.zeros(num_B.shape, bool)
    width = block_BT.shape[1]
    states, dead = root_states(sampling, history), []
    for j in range(width):
        dead.append(~jnp.any(allowed(sampling, states), axis=-1))
        states = advance(sampling, states, jnp.maximum(block_BT[:, j], 0))
    dead_BT = jnp.stack(dead, axis=1) & (jnp.arange(width)[None, :] < num_B[:, None])
    first = jnp.where(jnp.any(dead_BT, axis=1), jnp.argmax(dead_BT, axis=1), width)
    ended = first < width
    return jnp.where(ended, first, num_B), ended


def commit(sampling, history, block_BT, num_B):
    """The history with each row's DFA state advanced along its first ``num`` block tokens."""
    if not sampling.constrained:
        return history
    states = root_states(sampling, history)
    for j in range(block_BT.shape[1]):
        moved = advance(sampling, states, jnp.maximum(block_BT[:, j], 0))
        # EOS (not a DFA transition) ends the row; its state stays.
        states = jnp.where((j < num_B) & (moved != SINK), moved, states)
    return dataclasses.replace(history, dfa=jnp.where(num_B > 0, states, history.dfa))
