"""Structured output: regex and JSON-schema constraints as token DFAs, applied per tree node.

Host side. A regex (or a JSON schema, turned into a regex by outlines-core's ``json_schema``
module after :func:`check_schema` refused the keywords that module would drop) is compiled once
per (pattern, vocabulary) by outlines-core's ``Index`` into a token-level DFA: state s, allowed
tokens A(s), next state δ(s, x). It is kept in memory and on disk (``<compilation cache
dir>/constraints/<sha256>.npz``, see :mod:`asps_jax.compile_cache`), keyed by a hash of the
pattern and the vocabulary's token byte strings.

Device side. The DFAs of a batch are stacked into one dense table ``next int32[S, V]`` (-1 =
forbidden) with ``final bool[S]`` (accepting states) and a start state per row; state 0 is the
sink (nothing allowed), state 1 the free state of an unconstrained row (everything allowed,
accepting). ``S * V`` is bounded by :data:`MAX_TABLE_ENTRIES` (a larger DFA is refused; there is
no compact form). Each row carries its committed state (``History.dfa``; -1 before the first
generated token = the row's start state); a tree node's state is δ* of its path below the root
(the same path the penalties read), and the mask — the tokens with ``next >= 0``, plus the EOS
ids in accepting states — is the first processor of every law: draft, target and bonus.

A node whose state allows nothing (a dead state: e.g. an accepting state with no transition when
EOS is disabled) ends the row there: the draft law is empty, so its chain ends before it, and the
slot drawn from its target law is dropped (:func:`dead_slots`). Every verifier is exact for
arbitrary laws per node, so the output law is the law of constrained sampling from the masked,
renormalised target without speculation.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax import compile_cache

MAX_TABLE_ENTRIES = 1 << 26
"""The bound on ``states x vocabulary`` of a batch's stacked DFA table (int32: 256 MiB)."""

SINK, FREE, FIRST = 0, 1, 2  # global state ids: the sink, the free state, the first pattern state
_FORMAT = 1  # bump when the cached table layout changes

STATS: collections.Counter = collections.Counter()
"""``compiled`` (outlines-core ran), ``disk`` (read from the disk cache), ``memory`` (reused in
this process): how each :func:`compile_regex` call was served."""

_MEMORY: dict[str, TokenDFA] = {}

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
    """One compiled constraint: ``next int32[S, V]`` (-1 forbidden; local state ids),
    ``final bool[S]``, ``start`` (the initial state) and ``key`` (the cache key)."""

    next: np.ndarray
    final: np.ndarray
    start: int
    key: str

    @property
    def num_states(self) -> int:
        return self.next.shape[0]


def _one_line(err) -> str:
    return " ".join(str(err).split())


# ------------------------------------------------------------------------------------------
# The vocabulary


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_kinds(tokenizer) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    kinds = set()

    def walk(node):
        if isinstance(node, dict):
            if "type" in node:
                kinds.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(backend.to_str()).get("decoder"))
    return kinds


def token_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
    """The byte string each token id in ``[0, vocab_size)`` adds to the text; None for special
    tokens and ids the tokenizer does not have (the constraint never allows them)."""
    kinds = _decoder_kinds(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    size = min(len(tokenizer), vocab_size)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    byte_level = _bytes_to_unicode() if "ByteLevel" in kinds else None
    metaspace = bool(kinds & {"Metaspace", "ByteFallback"}) or any(
        isinstance(p, str) and p.startswith("\u2581") for p in pieces[:1000]
    )
    out: list[bytes | None] = []
    for i, piece in enumerate(pieces):
        if i in special or piece is None or piece == "":
            out.append(None)
        elif byte_level is not None:
            try:
                out.append(bytes(byte_level[c] for c in piece))
            except KeyError:  # an added (non byte-level) token
                out.append(piece.encode())
        elif metaspace and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        elif metaspace:
            out.append(piece.replace("\u2581", " ").encode())
        else:
            out.append(piece.encode())
    return out + [None] * (vocab_size - size)


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


def compile_regex(pattern: str, tokens: list[bytes | None], *, what: str = "regex") -> TokenDFA:
    """The token DFA of ``pattern`` over the vocabulary ``tokens`` (:func:`token_bytes`):
    from memory, else the disk cache, else outlines-core (then written to the disk cache)."""
    if not isinstance(pattern, str):
        raise ValueError(f"{what} must be a string, got {type(pattern).__name__}")
    vocab = len(tokens)
    key = hashlib.sha256(
        f"{_FORMAT}\0{_outlines_version()}\0{pattern}\0{vocab}\0{_vocabulary_hash(tokens)}".encode()
    ).hexdigest()
    if key in _MEMORY:
        STATS["memory"] += 1
        return _MEMORY[key]
    directory = cache_dir()
    path = None if directory is None else directory / f"{key}.npz"
    if path is not None and path.exists():
        try:
            with np.load(path) as data:
                dfa = TokenDFA(data["next"], data["final"], int(data["start"]), key)
            STATS["disk"] += 1
            _MEMORY[key] = dfa
            return dfa
        except (OSError, ValueError, KeyError):
            pass  # a broken entry: compile again
    dfa = _compile(pattern, tokens, key, what)
    STATS["compiled"] += 1
    _MEMORY[key] = dfa
    if path is not None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
            np.savez_compressed(tmp, next=dfa.next, final=dfa.final, start=dfa.start)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache: compile next time
    return dfa


def _compile(pattern: str, tokens: list[bytes | None], key: str, what: str) -> TokenDFA:
    try:
        from outlines_core import Index, Vocabulary
    except ImportError:  # pragma: no cover - a declared dependency
        msg = f"{what}: constraints need outlines-core (pip install outlines-core)"
        raise ValueError(msg) from None
    vocab = len(tokens)
    mapping: dict[bytes, list[int]] = {}
    for i, t in enumerate(tokens):
        if t is not None:
            mapping.setdefault(t, []).append(i)
    if not mapping:
        raise ValueError(f"{what}: the tokenizer has no usable token")
    eos = vocab  # outlines-core's own end token: an id outside ours (ours are sampling.eos_ids)
    try:
        index = Index(pattern, Vocabulary(eos, mapping))
    except (ValueError, TypeError, RuntimeError) as err:
        raise ValueError(f"{what} {pattern!r} does not compile: {_one_line(err)}") from None
    transitions = index.get_transitions()
    finals = set(index.get_final_states())
    start = index.get_initial_state()
    states = {start} | set(transitions) | finals
    for edges in transitions.values():
        states |= set(edges.values())
    if len(states) * vocab > MAX_TABLE_ENTRIES:
        raise ValueError(_size_error(what, len(states), vocab))
    ids = {s: i for i, s in enumerate([start] + sorted(states - {start}))}
    table = np.full((len(ids), vocab), -1, np.int32)
    for s, edges in transitions.items():
        for token, nxt in edges.items():
            if token < vocab:
                table[ids[s], token] = ids[nxt]
    final = np.zeros(len(ids), bool)
    final[[ids[s] for s in finals]] = True
    return TokenDFA(table, final, 0, key)


def _size_error(what: str, states: int, vocab: int) -> str:
    return (
        f"{what}: the constraint's DFA has {states} states x {vocab} tokens = {states * vocab} "
        f"table entries, past the bound of {MAX_TABLE_ENTRIES}: simplify the pattern (bound "
        "repetitions and string lengths, e.g. maxLength)"
    )


def check_schema(schema, where: str = "") -> None:
    """Refuse (one-line ``ValueError``) every keyword outlines-core's regex compiler does not
    enforce exactly; the supported ones are :data:`SCHEMA_KEYWORDS`."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(
            f"json_schema: the schema at {where or '/'} must be an object, got {schema!r}"
        )
    for name, value in schema.items():
        at = f"{where}/{name}"
        if name not in SCHEMA_KEYWORDS:
            raise ValueError(
                f"json_schema: keyword {name!r} at {at} is not enforced by the regex compiler "
                f"(outlines-core): refused rather than dropped; supported: "
                f"{', '.join(SCHEMA_KEYWORDS)}"
            )
        if name == "type" and value not in SCHEMA_TYPES:
            raise ValueError(
                f"json_schema: type {value!r} at {at} is not supported (one of "
                f"{', '.join(SCHEMA_TYPES)})"
            )
        if name == "additionalProperties" and value is not False:
            raise ValueError(
                f"json_schema: additionalProperties at {at} must be false (the compiled regex "
                f"admits the listed properties only), got {value!r}"
            )
        if name in ("properties", "$defs", "definitions"):
            if not isinstance(value, dict):
                raise ValueError(f"json_schema: {name} at {at} must be an object")
            for sub, subschema in value.items():
                check_schema(subschema, f"{at}/{sub}")
        elif name == "items":
            for i, sub in enumerate(value if isinstance(value, list) else [value]):
                check_schema(sub, f"{at}/{i}" if isinstance(value, list) else at)
        elif name == "anyOf":
            if not isinstance(value, list) or not value:
                raise ValueError(f"json_schema: anyOf at {at} must be a non-empty list")
            for i, sub in enumerate(value):
                check_schema(sub, f"{at}/{i}")


def schema_regex(schema) -> str:
    """The regex of a JSON schema (a dict or its JSON text), after :func:`check_schema`."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"json_schema: not valid JSON ({_one_line(err)})") from None
    if not isinstance(schema, dict):
        raise ValueError(
            f"json_schema must be a dict or its JSON text, got {type(schema).__name__}"
        )
    check_schema(schema)
    from outlines_core import json_schema

    try:
        return json_schema.build_regex_from_schema(json.dumps(schema))
    except (ValueError, TypeError, RuntimeError) as err:
        raise ValueError(f"json_schema: refused by outlines-core: {_one_line(err)}") from None


def stack(dfas: list[TokenDFA | None], vocab: int):
    """One table for a batch: ``(next int32[S, V], final bool[S], start int32[B])`` with the
    sink at 0, the free state at 1 (rows without a constraint) and each distinct DFA after, its
    states offset; S is padded to a multiple of 64 with sink rows (fewer compiled shapes)."""
    offsets: dict[str, int] = {}
    parts, finals, size = [], [], FIRST
    for dfa in dfas:
        if dfa is not None and dfa.key not in offsets:
            offsets[dfa.key] = size
            parts.append(np.where(dfa.next >= 0, dfa.next + size, -1).astype(np.int32))
            finals.append(dfa.final)
            size += dfa.num_states
    padded = -(-size // 64) * 64
    if padded * vocab > MAX_TABLE_ENTRIES:
        raise ValueError(_size_error("the batch's constraints", padded, vocab))
    table = np.full((padded, vocab), -1, np.int32)
    table[FREE] = FREE
    final = np.zeros(padded, bool)
    final[FREE] = True
    at = FIRST
    for part, f in zip(parts, finals):
        table[at : at + part.shape[0]] = part
        final[at : at + part.shape[0]] = f
        at += part.shape[0]
    start = np.array([FREE if d is None else offsets[d.key] + d.start for d in dfas], np.int32)
    return table, final, start


# ------------------------------------------------------------------------------------------
# On device


def root_states(sampling, history) -> jax.Array:
    """int32[B]: each row's committed DFA state (its start state before any generated token)."""
    return jnp.where(history.dfa < 0, sampling.dfa_start, history.dfa)


def advance(sampling, states, tokens) -> jax.Array:
    """δ(state, token) elementwise; a forbidden token leads to the sink."""
    nxt = sampling.dfa_next[states, jnp.asarray(tokens, jnp.int32)]
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
    vocab = sampling.dfa_next.shape[1]
    eos = sampling.eos_ids
    is_eos_V = jnp.zeros(vocab, bool).at[jnp.where(eos >= 0, eos, vocab)].set(True, mode="drop")
    steps = sampling.dfa_next[states] >= 0
    is_eos = is_eos_V.reshape((1,) * (steps.ndim - 1) + (vocab,))
    return (steps & ~is_eos) | (sampling.dfa_final[states][..., None] & is_eos)


def allows(sampling, states, tokens) -> jax.Array:
    """bool, elementwise: ``tokens`` is allowed in ``states`` (:func:`allowed` at one token each,
    without the ``[..., V]`` table)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    eos = sampling.eos_ids.reshape((1,) * tokens.ndim + (-1,))
    is_eos = jnp.any(tokens[..., None] == eos, axis=-1)
    step = sampling.dfa_next[states, tokens] >= 0
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
