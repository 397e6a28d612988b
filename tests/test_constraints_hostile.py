"""Hostile constraints (asps_jax/controls/constraints.py): patterns and schemas that would exhaust
memory or abort the process inside outlines-core are refused first, with one-line errors; broken
constraint-cache entries are compiled again and rewritten.

Every refusal here is checked to come before outlines-core runs (``_compile`` and
``build_regex_from_schema`` replaced by a function that fails the test), so a regression fails
fast instead of taking the machine's memory. The estimate's accuracy is checked against the
states outlines-core actually builds, over a vocabulary of every single byte (so that every
state of the byte-level DFA is reachable).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import outlines_core.json_schema
import pytest

from asps_jax.controls import constraints, dfa_worker

# Every byte as a token, a few multi-byte tokens and a special token (None): small enough that
# outlines-core compiles the patterns below in milliseconds.
BYTES = [bytes([b]) for b in range(256)] + [b"ab", b'{"', b'":', "é".encode(), None]
STR20 = {"type": "string", "maxLength": 20}
THREE_FIELDS = {  # 444 states with a 100 000-token BPE vocabulary (436 over BYTES)
    "type": "object",
    "properties": {"a": STR20, "b": STR20, "c": {"type": "integer"}},
    "required": ["a", "b", "c"],
}
TYPICAL = {
    "three_fields": THREE_FIELDS,
    "integer": {"type": "integer"},
    "number": {"type": "number"},
    "boolean": {"type": "boolean"},
    "enum": {"enum": ["red", "green", "blue", 3, None]},
    "string": {"type": "string"},
    "array_max5": {"type": "array", "items": {"type": "integer"}, "maxItems": 5},
    "array_of_strings": {"type": "array", "items": STR20, "maxItems": 10},
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": STR20},
            "required": ["x", "y"],
        },
        "maxItems": 3,
    },
    "optional_properties": {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(8)},
    },
    "nested_object": {
        "type": "object",
        "properties": {
            "o": {
                "type": "object",
                "properties": {"p": STR20, "q": {"type": "number"}},
                "required": ["p", "q"],
            }
        },
        "required": ["o"],
    },
    "any_of": {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
    "pattern": {"type": "string", "pattern": r"^[A-Z]{3}-[0-9]{4}$"},
    "untyped": {},
}
TYPICAL_REGEXES = [
    r"(Romeo|Juliet) loves (Romeo|Juliet)\.",
    r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}",
    r"\d{4}-\d{2}-\d{2}",
    r"[a-z]{1,100}",
    r"\p{L}{1,5}",
    r"(apple|applesauce|application|banana|bandana)",
]


def _vocab(size: int) -> list[bytes | None]:
    """A synthetic vocabulary of ``size`` distinct tokens (never compiled at large sizes: only
    its length matters to the estimate)."""
    return (BYTES + [b"t%d" % i for i in range(size)])[:size]


def _one_line_error(call, *needles):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


@pytest.fixture
def outlines_unreached(monkeypatch):
    """outlines-core's compilers replaced: a test that reaches them fails (fast)."""

    def boom(*args, **kwargs):
        raise AssertionError("outlines-core was reached")

    monkeypatch.setattr(constraints, "_compile", boom)
    monkeypatch.setattr(outlines_core.json_schema, "build_regex_from_schema", boom)
    monkeypatch.setattr(constraints, "_MEMORY", {})
    monkeypatch.setenv("ASPS_JAX_NO_CACHE", "1")


def _nested_arrays(depth: int, leaf=None) -> dict:
    schema = {"type": "integer"} if leaf is None else leaf
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


# --- 1. The regex size estimate, before outlines-core ---------------------------------------


@pytest.mark.parametrize(
    "pattern, vocab",
    [
        ("[a-z]{1,100000}", 2048),  # 40 s, then MemoryError, before
        ("(a{1000}){1000}", 2048),  # nested counted repetitions multiply
        # A Unicode class is ~300 UTF-8 states per position: {1,200} (63 k states, 97 token
        # classes at 2 048 tokens) compiles in 9 s; {1,500} would be 158 k states.
        (r"\p{L}{1,500}", 2048),
        ("[a-z]{1,300000}", 12),  # a tiny vocabulary: the absolute cap on states
        ('"([^"\\\\]|\\\\.){0,100000}"', 100_000),
    ],
)
def test_counted_repetitions_are_refused_before_outlines_core(outlines_unreached, pattern, vocab):
    _one_line_error(
        lambda: constraints.compile_regex(pattern, _vocab(vocab)),
        "regex: the constraint's DFA is estimated",
        "bound the repetitions",
    )


def test_a_schema_regex_goes_through_the_estimate(monkeypatch):
    monkeypatch.setattr(constraints, "_compile", lambda *a, **k: pytest.fail("compiled"))
    monkeypatch.setattr(constraints, "_MEMORY", {})
    monkeypatch.setenv("ASPS_JAX_NO_CACHE", "1")
    regex = constraints.schema_regex({"type": "string", "maxLength": 100_000})
    _one_line_error(
        lambda: constraints.compile_regex(regex, _vocab(2048), what="json_schema"),
        "json_schema: the constraint's DFA is estimated",
    )


@pytest.mark.parametrize(
    "pattern, needle",
    [
        ("(" * 150 + "a" + ")" * 150, "nests more than 100 levels"),  # outlines-core: 250
        ("(" * 5000 + "a" + ")" * 5000, "nests more than 100 levels"),  # Python: RecursionError
        ("a" * 1_000_001, "the pattern has 1000001 characters, past the bound of 1000000"),
    ],
    ids=["150_groups", "5000_groups", "too_long"],
)
def test_deep_and_long_patterns_are_one_line_errors(outlines_unreached, pattern, needle):
    _one_line_error(lambda: constraints.compile_regex(pattern, BYTES), "regex: ", needle)


def test_a_pattern_python_cannot_parse_is_left_to_outlines_core(monkeypatch):
    monkeypatch.setattr(constraints, "_MEMORY", {})
    monkeypatch.setenv("ASPS_JAX_NO_CACHE", "1")
    assert constraints.estimate_states("a{1,99999999999}") is None  # Python: OverflowError
    _one_line_error(
        lambda: constraints.compile_regex("a{1,99999999999}", BYTES),
        "regex 'a{1,99999999999}' does not compile",
    )
    # Rust-only syntax is read as its Python equivalent, and compiles as before.
    for pattern in (r"(?<x>a)\x{62}", r"a(?i)b", r"[[:alpha:]]{2}", r"\pL"):
        assert constraints.estimate_states(pattern) is not None, pattern
        assert constraints.compile_regex(pattern, BYTES).num_states >= 2


@pytest.mark.parametrize("name", sorted(TYPICAL) + [f"regex{i}" for i in range(6)])
def test_the_estimate_tracks_the_real_dfa_and_admits_what_compiles(name, monkeypatch):
    """On typical schemas and regexes the estimate is within a factor 2 of the states
    outlines-core builds (over every byte: every state reachable), so the gate admits them at
    2 048 tokens, and at 100 000 tokens whenever the real table fits the bound."""
    monkeypatch.setattr(constraints, "_MEMORY", {})
    monkeypatch.setenv("ASPS_JAX_NO_CACHE", "1")
    if name.startswith("regex"):
        regex = TYPICAL_REGEXES[int(name[5:])]
    else:
        regex = constraints.schema_regex(TYPICAL[name])
    real = constraints.compile_regex(regex, BYTES).num_states
    estimate = constraints.estimate_states(regex)
    assert real / 2 <= estimate <= 2 * real, (real, estimate)
    for vocab in (2048, 100_000):
        if real * vocab <= constraints.MAX_INDEX_ENTRIES:
            constraints._check_estimate(regex, vocab, "json_schema")  # no refusal
    if name == "three_fields":  # 444 states: admitted at Llama 3's and Gemma 3's vocabularies
        for vocab in (128_256, 262_144):
            constraints._check_estimate(regex, vocab, "json_schema")


# --- 2. Schemas: depth, recursion, expansion ------------------------------------------------


def test_deeply_nested_arrays_are_refused_before_outlines_core(outlines_unreached):
    """20 nested arrays abort the process inside outlines-core (SIGABRT); the limit is 10."""
    deep = "/items" * 11
    _one_line_error(
        lambda: constraints.schema_regex(_nested_arrays(20)),
        "json_schema: the schema nests 11 levels deep",
        f"at {deep} ",
        "past the limit of 10",
    )


def test_ten_nested_arrays_still_compile(monkeypatch):
    monkeypatch.setattr(constraints, "_MEMORY", {})
    monkeypatch.setenv("ASPS_JAX_NO_CACHE", "1")
    regex = constraints.schema_regex(_nested_arrays(constraints.MAX_SCHEMA_DEPTH))
    constraints._check_estimate(regex, 2048, "json_schema")
    small = [bytes([b]) for b in b"[]-0123456789, "]  # 8 188 states: keep the vocabulary small
    assert constraints.compile_regex(regex, small).num_states == 8188


def _deep_dict(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: "[" * 100_000 + "]" * 100_000, "not read: the JSON text nests too deeply"),
        (lambda: _deep_dict(100_000), "nests 11 levels deep at " + "/properties/a" * 11 + " "),
        (lambda: json.dumps(_deep_dict(50)), "nests 11 levels deep at " + "/properties/a" * 11),
    ],
    ids=["json_text", "dict", "json_objects"],
)
def test_deep_schema_input_is_a_one_line_error(outlines_unreached, make, needle):
    schema = make()
    _one_line_error(lambda: constraints.schema_regex(schema), "json_schema: ", needle)


def test_a_cyclic_schema_object_is_a_one_line_error(outlines_unreached):
    schema: dict = {"type": "array"}
    schema["items"] = schema
    _one_line_error(lambda: constraints.schema_regex(schema), "past the limit of 10")
    schema["items"] = None  # no reference cycle left for the garbage collector


RECURSIVE = {
    "self": {"$ref": "#"},
    "linked_list": {
        "type": "object",
        "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}},
        "required": ["v", "next"],  # outlines-core ends it with {}, which misses "v"
    },
    "tree": {
        "type": "object",
        "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "$defs": {
            "node": {"type": "object", "properties": {"kids": {"$ref": "#/properties/kids"}}}
        },
    },
    "defs_loop": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
        "$ref": "#/$defs/a",
    },
}


@pytest.mark.parametrize("name", sorted(RECURSIVE))
def test_recursive_schemas_are_refused(outlines_unreached, name):
    _one_line_error(
        lambda: constraints.schema_regex(RECURSIVE[name]), "a recursive schema): refused"
    )


def test_ref_targets_count_where_they_are_used(outlines_unreached):
    """A definition six levels deep, used six levels down: 12 levels through the $ref."""
    schema = _nested_arrays(6, {"$ref": "#/$defs/deep"})
    schema["$defs"] = {"deep": _nested_arrays(6)}
    message = _one_line_error(
        lambda: constraints.schema_regex(schema), "nests 11 levels deep", "past the limit of 10"
    )
    assert "/items" * 6 + "/$ref[#/$defs/deep]" + "/items" * 5 in message


def test_a_schema_whose_regex_explodes_is_refused_before_outlines_core(outlines_unreached):
    """Eight definitions, each with ten properties using the next one: 10**8 copies inlined."""
    defs = {
        f"d{i}": {
            "type": "object",
            "properties": {f"p{j}": {"$ref": f"#/$defs/d{i + 1}"} for j in range(10)},
            "required": [f"p{j}" for j in range(10)],
        }
        for i in range(8)
    }
    defs["d8"] = {"type": "integer"}
    _one_line_error(
        lambda: constraints.schema_regex({"$defs": defs, "$ref": "#/$defs/d0"}),
        "json_schema: the schema's regex would have at least",
        "past the bound of 1000000",
    )


def test_shared_definitions_still_compile():
    """A definition used several times (not recursively) is inlined by outlines-core as before."""
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    schema = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/definitions/p"}},
        "required": ["a", "b"],
        "$defs": {"p": point},
        "definitions": {"p": point},
    }
    regex = constraints.schema_regex(schema)
    assert regex == outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))


# --- 3. Broken constraint-cache entries -----------------------------------------------------

CACHED = "[a-c]+k(x|yz)?"


def _truncate(path, fresh):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _empty(path, fresh):
    path.write_bytes(b"")


def _save(path, fresh, **changed):
    arrays = dict(classes=fresh.classes, next=fresh.next, final=fresh.final, start=fresh.start)
    np.savez_compressed(path, **{**arrays, **changed})


def _wrong_width(path, fresh):  # a class map over another vocabulary
    _save(path, fresh, classes=np.zeros(len(BYTES) + 1, np.int32))


def _out_of_range(path, fresh):
    bad = fresh.next.copy()
    bad[0, 0] = fresh.num_states + 5
    _save(path, fresh, next=bad)


def _class_out_of_range(path, fresh):
    bad = fresh.classes.copy()
    bad[3] = fresh.num_classes
    _save(path, fresh, classes=bad)


def _old_format(path, fresh):  # a dense table of format 1 (no class map)
    np.savez_compressed(path, next=fresh.dense(), final=fresh.final, start=fresh.start)


def _wrong_final(path, fresh):
    _save(path, fresh, final=fresh.final[:-1])


def _bad_start(path, fresh):
    _save(path, fresh, start=fresh.num_states)


def _text(path, fresh):
    path.write_text("not a cache entry")


@pytest.mark.parametrize(
    "damage",
    [
        _truncate,
        _empty,
        _wrong_width,
        _out_of_range,
        _class_out_of_range,
        _old_format,
        _wrong_final,
        _bad_start,
        _text,
    ],  # fmt: skip
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_broken_cache_entry_is_compiled_again_and_rewritten(
    damage, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("ASPS_JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ASPS_JAX_NO_CACHE", raising=False)
    monkeypatch.setattr(constraints, "_MEMORY", {})
    fresh = constraints.compile_regex(CACHED, BYTES)
    (path,) = (tmp_path / "constraints").glob("*.npz")
    damage(path, fresh)
    before = dict(constraints.STATS)
    monkeypatch.setattr(constraints, "_MEMORY", {})
    with caplog.at_level(logging.WARNING, logger="asps_jax.controls.constraints"):
        again = constraints.compile_regex(CACHED, BYTES)
    np.testing.assert_array_equal(again.next, fresh.next)
    np.testing.assert_array_equal(again.classes, fresh.classes)
    np.testing.assert_array_equal(again.final, fresh.final)
    assert again.start == fresh.start
    assert constraints.STATS["compiled"] == before.get("compiled", 0) + 1
    (notice,) = [
        r.getMessage() for r in caplog.records if r.name == "asps_jax.controls.constraints"
    ]
    assert "\n" not in notice and str(path) in notice and "compiled again and rewritten" in notice
    # Rewritten: the next process (a fresh memory) reads it from disk, with no notice.
    caplog.clear()
    monkeypatch.setattr(constraints, "_MEMORY", {})
    third = constraints.compile_regex(CACHED, BYTES)
    assert constraints.STATS["disk"] == before.get("disk", 0) + 1
    assert constraints.STATS["compiled"] == before.get("compiled", 0) + 1
    np.testing.assert_array_equal(third.next, fresh.next)
    assert not [r for r in caplog.records if r.name == "asps_jax.controls.constraints"]
    assert sorted(p.name for p in (tmp_path / "constraints").iterdir()) == [path.name]


def test_a_broken_entry_notice_goes_to_notify(tmp_path, monkeypatch):
    monkeypatch.setenv("ASPS_JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ASPS_JAX_NO_CACHE", raising=False)
    monkeypatch.setattr(constraints, "_MEMORY", {})
    constraints.compile_regex(CACHED, BYTES, what="json_schema")
    (path,) = (tmp_path / "constraints").glob("*.npz")
    path.write_bytes(b"")
    monkeypatch.setattr(constraints, "_MEMORY", {})
    notices: list[str] = []
    constraints.compile_regex(CACHED, BYTES, what="json_schema", notify=notices.append)
    assert notices == [
        f"json_schema: the constraint cache entry {path} was unusable (EOFError: No data left "
        "in file); compiled again and rewritten"
    ]


# --- The last guard: outlines-core in a child process of bounded memory and time ---------------

# A top-level bounded string: its DFA has ~200 states (no estimate sees a problem), but
# outlines-core's unanchored search automaton grows exponentially while it builds the index
# (maxLength 20: 77 s and 4.4 GB; maxLength 50 aborted the process under an 8 GB cap).
EXPLODING = {"type": "string", "maxLength": 50}


@pytest.fixture
def uncached(monkeypatch):
    monkeypatch.setattr(constraints, "_MEMORY", {})
    monkeypatch.setenv("ASPS_JAX_NO_CACHE", "1")


@pytest.mark.slow
@pytest.mark.parametrize(
    "memory, seconds, needle",
    [(300 << 20, 600.0, "needed more than 0.3 GiB"), (None, 1.0, "took more than 1 s")],
)
def test_an_exploding_index_is_stopped_in_its_child(uncached, monkeypatch, memory, seconds, needle):
    """The child runs out of its memory (a limit made small here, so that it does so in seconds)
    or of its time; this process gets one line and carries on: the next pattern compiles."""
    if memory is not None:
        monkeypatch.setattr(constraints, "COMPILE_MEMORY_BYTES", memory)
    monkeypatch.setattr(constraints, "COMPILE_SECONDS", seconds)
    regex = constraints.schema_regex(EXPLODING)
    with pytest.raises(ValueError, match=needle) as info:
        constraints.compile_regex(regex, BYTES, what="json_schema")
    message = str(info.value)
    assert "\n" not in message and message.startswith("json_schema: outlines-core")
    dfa = constraints.compile_regex("[a-c]{2}", BYTES)
    assert dfa.num_states == 3


def test_the_child_reports_what_outlines_core_refuses(uncached):
    with pytest.raises(ValueError, match=r"regex '\(a' does not compile: ") as info:
        constraints.compile_regex("(a", BYTES)
    assert "\n" not in str(info.value)


def test_a_pattern_that_is_not_unicode_text_names_its_flag(uncached):
    """A lone surrogate raised "'utf-8' codec can't encode ...", naming no argument."""
    with pytest.raises(ValueError, match="regex: the pattern is not valid Unicode text"):
        constraints.compile_regex("ab\ud800", BYTES)


# A process under an address-space limit lower than the builder's own (``ulimit -v``, Slurm, a
# container): the child inherits it and keeps it (it used to try to raise it, which the hard
# limit forbids: every new pattern was refused as "not allowed to raise maximum limit").
UNDER_A_LIMIT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from asps_jax.controls import constraints
constraints.COMPILE_MEMORY_BYTES = 8 << 30  # the limit is below the builder's bound on any host
tokens = [bytes([b]) for b in range(256)]
print(constraints.compile_regex("[a-d]{2}x", tokens).num_states)
resource.setrlimit(resource.RLIMIT_AS, (100 << 20, 3 << 30))  # too small for the child to start
try:
    constraints.compile_regex("[e-h]{2}y", tokens)
except ValueError as err:
    print(err)
"""


@pytest.mark.slow
def test_the_child_keeps_the_callers_address_space_limit(tmp_path):
    """Under a 3 GiB limit a pattern compiles; under one too small for the child, the error names
    the limit (not the pattern) in one line."""
    env = dict(os.environ, ASPS_JAX_NO_CACHE="1", XDG_CACHE_HOME=str(tmp_path))
    run = subprocess.run(
        [sys.executable, "-c", UNDER_A_LIMIT], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    states, message = run.stdout.splitlines()
    assert states == "4"
    assert message.startswith("regex: outlines-core failed building the constraint's DFA under ")
    assert "address-space limit of 0.10 GiB" in message and "ulimit -v" in message
    assert "raise that limit" in message


# --- 5. Token classes: an exact rewrite of the dense table ------------------------------------

# Byte tokens, multi-byte pieces that cross the patterns' boundaries, and ids never allowed.
CLASS_VOCAB = BYTES + [b"12", b"3,", b'","', b'"b', b"true", b" -", "\u00e9t\u00e9".encode(), None]
CLASS_PATTERNS = [
    r"(true|false|-?[0-9]{1,4})(,[0-9]{2})?",
    r"\p{L}{1,3}[a-c]?",  # multi-byte UTF-8: partial characters are states of their own
    constraints.schema_regex(THREE_FIELDS),
]


def outlines_index(pattern: str, tokens: list = CLASS_VOCAB):
    """outlines-core's own ``Index`` over ``tokens``: its transitions, the state ids the worker
    gives them (start first, then by outlines-core's id) and its final states."""
    from outlines_core import Index, Vocabulary

    mapping: dict = {}
    for i, t in enumerate(tokens):
        if t is not None:
            mapping.setdefault(t, []).append(i)
    index = Index(pattern, Vocabulary(len(tokens), mapping))
    transitions, start = index.get_transitions(), index.get_initial_state()
    finals = set(index.get_final_states())
    states = {start} | set(transitions) | finals
    for edges in transitions.values():
        states |= set(edges.values())
    ids = {s: i for i, s in enumerate([start] + sorted(states - {start}))}
    return transitions, ids, finals


def _outlines_dense(pattern: str) -> tuple[np.ndarray, np.ndarray]:
    """The dense ``int32[S, V]`` table and ``final bool[S]`` from outlines-core's transitions."""
    transitions, ids, finals = outlines_index(pattern)
    dense = np.full((len(ids), len(CLASS_VOCAB)), -1, np.int32)
    for s, edges in transitions.items():
        for t, n in edges.items():
            if t < len(CLASS_VOCAB):
                dense[ids[s], t] = ids[n]
    final = np.zeros(len(ids), bool)
    final[[ids[s] for s in finals]] = True
    return dense, final


@pytest.mark.parametrize("pattern", CLASS_PATTERNS, ids=["regex", "unicode", "three_fields"])
def test_token_classes_equal_the_dense_table(pattern, monkeypatch):
    """Every state x token: ``next[s, classes[x]]`` is outlines-core's own transition (or -1),
    the classes are as few as the distinct columns, and the fallback for a hash collision
    (grouping the columns themselves) gives the very same classes."""
    monkeypatch.setattr(constraints, "_MEMORY", {})
    monkeypatch.setenv("ASPS_JAX_NO_CACHE", "1")
    dfa = constraints.compile_regex(pattern, CLASS_VOCAB)
    dense, final = _outlines_dense(pattern)
    np.testing.assert_array_equal(dfa.dense(), dense)
    np.testing.assert_array_equal(dfa.final, final)
    assert dfa.num_classes == np.unique(dense, axis=1).shape[1] < len(CLASS_VOCAB) // 2
    transitions, ids, _ = outlines_index(pattern)
    rows = dfa_worker.state_rows(transitions, ids, len(CLASS_VOCAB))
    classes, reps = dfa_worker.token_classes(rows, len(CLASS_VOCAB))
    np.testing.assert_array_equal(classes, dfa.classes)
    for got, want in zip(dfa_worker.exact_classes(rows, len(CLASS_VOCAB)), (classes, reps)):
        np.testing.assert_array_equal(got, want)


def test_a_collision_is_caught_by_the_exact_check(monkeypatch):
    """Two tokens with different columns given one class (a hash collision) make no table, and
    the worker then groups the columns themselves: the same automaton as without a collision."""
    pattern = CLASS_PATTERNS[0]
    transitions, ids, _ = outlines_index(pattern)
    rows = dfa_worker.state_rows(transitions, ids, len(CLASS_VOCAB))
    classes, reps = dfa_worker.token_classes(rows, len(CLASS_VOCAB))
    assert dfa_worker.class_table(rows, classes, reps, len(ids)) is not None
    one, two = int(classes[ord("1")]), int(classes[ord("t")])
    assert one != two
    merged = np.where(classes == two, one, classes)
    assert dfa_worker.class_table(rows, merged, reps, len(ids)) is None
    good = dfa_worker.build_table(pattern, CLASS_VOCAB, constraints.MAX_TABLE_ENTRIES)
    monkeypatch.setattr(dfa_worker, "token_classes", lambda rows, vocab: (merged, reps))
    again = dfa_worker.build_table(pattern, CLASS_VOCAB, constraints.MAX_TABLE_ENTRIES)
    for a, b in zip(good[1:], again[1:], strict=True):
        np.testing.assert_array_equal(a, b)
