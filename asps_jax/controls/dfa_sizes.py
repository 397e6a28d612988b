"""The size limits of a constraint, and the estimates that enforce them before outlines-core runs.

outlines-core builds every transition of a DFA (``S x V`` of them, less the forbidden ones)
before it can be counted, and aborts the process when that runs out of memory; so what would be
too large is refused before it runs (:mod:`~asps_jax.controls.constraints` calls these checks): a
regex whose estimated DFA (:func:`estimate_states`: counted repetitions unrolled) is past
:data:`MAX_STATES` or whose transitions would be past :data:`MAX_INDEX_ENTRIES`
(:func:`check_estimate`), or longer / deeper than :data:`MAX_PATTERN_LENGTH` /
:data:`MAX_PATTERN_DEPTH`; a schema with a keyword outlines-core would drop
(:data:`SCHEMA_KEYWORDS`), nested deeper than :data:`MAX_SCHEMA_DEPTH`, recursive, or whose regex
would be past the length bound (:func:`check_schema`). Host only; it imports no module of the
package.
"""

from __future__ import annotations

import json
import re
import urllib.parse
import warnings

MAX_INDEX_ENTRIES = 1 << 27
"""The bound on ``estimated states x vocabulary``: about the transitions outlines-core would
build (in Rust maps, before anything can be counted): 512 states at V = 262 k (a 444-state schema
is 116 M), 1 342 at V = 100 k; ``[a-z]{1,100000}`` at V = 2 048 (205 M) ran 40 s into a
MemoryError. Past it a pattern is refused before outlines-core runs."""

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


def one_line(err) -> str:
    """An error's text on one line (its whitespace runs as one space)."""
    return " ".join(str(err).split())


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


def check_estimate(pattern: str, vocab: int, what: str) -> None:
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
are a 50 k-character regex with 8 188 DFA states (0.8 s through
:func:`~asps_jax.controls.constraints.compile_regex`), 12 have 32 764 states (just inside the
table bound), 16 take 15 s and 1.3 GB in outlines-core's index, 20 abort the process inside
outlines-core (its regex is 51 M characters)."""


def schema_error(message: str) -> ValueError:
    return ValueError(f"json_schema: {message}")


def _deep(where: str) -> ValueError:
    return schema_error(
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
        raise schema_error("the schema nests too deeply to be read") from None


def _check_keywords(schema, where: str, depth: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise _deep(where)
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise schema_error(f"the schema at {where or '/'} must be an object, got {schema!r}")
    for name, value in schema.items():
        at = f"{where}/{name}"
        if name not in SCHEMA_KEYWORDS:
            raise schema_error(
                f"keyword {name!r} at {at} is not enforced by the regex compiler "
                f"(outlines-core): refused rather than dropped; supported: "
                f"{', '.join(SCHEMA_KEYWORDS)}"
            )
        if name == "type" and value not in SCHEMA_TYPES:
            raise schema_error(
                f"type {value!r} at {at} is not supported (one of {', '.join(SCHEMA_TYPES)})"
            )
        if name == "additionalProperties" and value is not False:
            raise schema_error(
                f"additionalProperties at {at} must be false (the compiled regex admits the "
                f"listed properties only), got {value!r}"
            )
        if name in ("properties", "$defs", "definitions"):
            if not isinstance(value, dict):
                raise schema_error(f"{name} at {at} must be an object")
            # A definition is no level of its own: it is counted where a $ref uses it.
            inner = depth + 1 if name == "properties" else depth
            for sub, subschema in value.items():
                _check_keywords(subschema, f"{at}/{sub}", inner)
        elif name == "items":
            for i, sub in enumerate(value if isinstance(value, list) else [value]):
                _check_keywords(sub, f"{at}/{i}" if isinstance(value, list) else at, depth + 1)
        elif name == "anyOf":
            if not isinstance(value, list) or not value:
                raise schema_error(f"anyOf at {at} must be a non-empty list")
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
                raise schema_error(
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
        raise schema_error(
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
