"""Regex / JSON-schema constraints (asps_jax/controls/constraints.py).

Expected values are independent of the library: a hand-written DFA walked in pure Python with
NumPy float64 masking (the constrained AR law), exact enumeration of every method's verifier on
the masked tabular laws, transformers forwards masked and renormalised, Python's ``re`` and
``jsonschema`` on the bundled pair's output.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import re

import controls_reference as controls_ref
import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
import tabular as tab
import torch
import transformers
import tree_reference as ref
from hf_checkpoints import char_tokenizer
from multidraft_laws import node_law
from multidraft_reference import continuation_error, tree_law, without_replacement_weights
from test_decode import PROMPT, VOCAB, _chi_square_pvalue, write_pair
from test_lookup import _point_mass_model
from test_verify_chain import code_outcome
from test_verify_tree import enumerate_method

import asps_jax
from asps_jax import sampler, trees
from asps_jax.controls import constraints, penalties
from asps_jax.controls.processors import SamplingParams
from asps_jax.drafters import lookup
from asps_jax.verify.registry import REGISTRY

# --- A hand-written DFA over 4 tokens: every state allows a different set, so the masks vary
# along every path (state -> {token: next state}).
HAND_DFA = {0: {0: 1, 1: 0, 2: 2}, 1: {1: 2, 3: 0}, 2: {0: 0, 2: 1, 3: 2}}
V4, N = 4, 2


def _hand_tables():
    table = np.full((3, V4), -1, np.int32)
    for s, edges in HAND_DFA.items():
        for x, t in edges.items():
            table[s, x] = t
    classes = np.arange(V4, dtype=np.int32)  # every token its own class
    dfa = constraints.TokenDFA(classes, table, np.array([True, False, True]), 0, "hand")
    return SamplingParams.make(1, constraint=constraints.stack([dfa], V4))


def _state(prefix):
    """The hand DFA's state after ``prefix``, None once it left the constraint."""
    state = 0
    for x in prefix:
        state = HAND_DFA[state].get(x) if state is not None else None
    return state


def _reachable(shape):
    return np.array([_state(p) is not None for p in np.ndindex(*shape[:-1])]).reshape(shape[:-1])


def _at_reachable_prefixes(laws, law_at):
    """NumPy float64: each law at every prefix the hand DFA reaches replaced by
    ``law_at(law, keep, prefix)`` (``keep``: the tokens the prefix's state allows); a prefix
    outside the constraint is never reached, so its law is left as it is."""
    out = []
    for law in laws:
        law = law.copy()
        for prefix in np.ndindex(*law.shape[:-1]):
            state = _state(prefix)
            if state is not None:
                keep = np.isin(np.arange(V4), list(HAND_DFA[state]))
                law[prefix] = law_at(law[prefix], keep, prefix)
        out.append(law)
    return out


def _reference_masked(laws):
    """Each law masked to the tokens its prefix's state allows, renormalised."""
    return _at_reachable_prefixes(
        laws, lambda law, keep, _: np.where(keep, law, 0.0) / law[keep].sum()
    )


@functools.partial(jax.jit, static_argnames="draft")
def _process(sampling, history, logits, path, depth, draft):
    return penalties.process(sampling, history, logits, path, depth, draft=draft)


def _library_masked(laws, draft):
    """The library's processing (asps_jax.controls.penalties.process: the constraint's mask, then
    the controls and temperature 1) of every prefix's law, each prefix a tree node's path, in one
    call: returns float64 laws masked by the library's allowed sets, and the float32 laws."""
    strings = [tab.all_strings(V4, i) for i in range(len(laws))]
    rows = sum(len(x) for x in strings)
    path = np.zeros((rows, 1, N + 1), np.int32)
    depth = np.concatenate([np.full(len(x), i) for i, x in enumerate(strings)])
    flat = np.concatenate([law.reshape(-1, V4) for law in laws])
    at = 0
    for i, x in enumerate(strings):
        path[at : at + len(x), 0, :i] = x
        at += len(x)
    history = penalties.History.init(jnp.zeros((rows, 1), jnp.int32), jnp.ones(rows), V4, 1)
    with np.errstate(divide="ignore"):
        logits = jnp.asarray(np.log(flat)[:, None], jnp.float32)
    sampling = _hand_tables().repeat(rows)
    lp, ok = _process(
        sampling, history, logits, jnp.asarray(path), jnp.asarray(depth[:, None]), draft
    )
    assert bool(jnp.all(ok))  # a dead node's law is usable (it ends the row)
    lp = np.asarray(lp[:, 0], np.float64)
    live = np.concatenate([_reachable(law.shape).reshape(-1) for law in laws])
    masked = np.where(lp > -np.inf, flat, 0.0)
    masked[~live] = flat[~live]
    masked /= masked.sum(-1, keepdims=True)
    probs = np.exp(lp)
    probs[~live] = flat[~live]
    exact, processed, at = [], [], 0
    for law in laws:
        size = law.size // V4
        exact.append(masked[at : at + size].reshape(law.shape))
        processed.append(probs[at : at + size].reshape(law.shape))
        at += size
    return exact, processed


@pytest.fixture(scope="module")
def masked_models():
    """Tabular target (depth n + 1) and two draft models (depth n), masked by the library and
    by the reference; the two agree exactly on the allowed sets and to float32 on the laws."""
    rng = np.random.default_rng(23)
    target = tab.target_model(rng, V4, N + 1, "dense")
    drafts = [tab.draft_model(rng, target, N, style) for style in ("close", "independent")]
    ref_target = _reference_masked(target)
    lib_target, proc_target = _library_masked(target, draft=False)
    lib_drafts = []
    for d in drafts:
        lib, proc = _library_masked(d, draft=True)
        for a, b, c in zip(lib, _reference_masked(d), proc):
            np.testing.assert_allclose(a, b, atol=1e-15)
            np.testing.assert_allclose(c, b, atol=2e-6)
        lib_drafts.append(lib)
    for a, b, c in zip(lib_target, ref_target, proc_target):
        np.testing.assert_allclose(a, b, atol=1e-15)
        np.testing.assert_allclose(c, b, atol=2e-6)
    return lib_target, lib_drafts, ref_target, target


def _constrained_ar_law(ref_target):
    """The constrained AR law of n + 1 tokens (the contract), written out."""
    return tab.joint(ref_target, N + 1)


DRAFTS_SCHEMES = {"specinfer": "specinfer", "spectr": "spectr", "is": "is_default",
                  "optimal": "optimal_g20"}  # fmt: skip


@pytest.mark.slow
def test_exact_enumeration_every_method(masked_models):
    """For every method of the registry: the law of one step's emitted string on the laws the
    library masked per node (by the DFA state along each node's path), continued by the
    reference's masked target, equals the constrained AR law; and no string outside the
    constraint has mass."""
    target, drafts, ref_target, _ = masked_models
    want = _constrained_ar_law(ref_target)
    assert np.sum(want > 0) < want.size / 2  # the constraint removes most strings
    covered = set()
    for method, info in REGISTRY.items():
        if info.kind == "chain":
            d, weight, q_rows, p_rows = tab.draft_enumeration(target, drafts[0], N)
            stop, full = code_outcome(method, d, q_rows, p_rows, N)
            emitted = tab.emitted_law(stop, full, weight, d, p_rows[:, N], N)
            got = tab.continue_with_target(emitted, ref_target)
            np.testing.assert_allclose(got, want, atol=1e-10, err_msg=method)
        elif method == "specinfer_wor":
            same = [drafts[0], [drafts[0][0], drafts[1][1]]]
            q_root = same[0][0]
            law, _ = tree_law(
                node_law("specinfer", V4), target, same, N, root_law=node_law(method, V4),
                root_weights=without_replacement_weights(q_root, 2),
            )  # fmt: skip
            assert continuation_error(law, ref_target, N) <= 1e-10, method
        elif info.kind == "drafts":
            law, _ = tree_law(node_law(DRAFTS_SCHEMES[method], V4), target, drafts, N)
            assert continuation_error(law, ref_target, N) <= 1e-10, method
        else:
            tree = trees.chains_token_tree(2, N)
            draws = list(ref.chain_draws(target, drafts, N))
            _, err = enumerate_method(tree, method, draws, target)
            assert err <= 1e-10, method
        covered.add(method)
    assert covered == set(REGISTRY)


@pytest.mark.slow
def test_enumeration_detects_a_law_left_unmasked(masked_models):
    """The check can fail: the target law at depth 1 left unmasked (its node's state ignored)
    gives a law outside the constraint."""
    target, drafts, ref_target, raw_target = masked_models
    broken = [target[0], raw_target[1], target[2]]
    d, weight, q_rows, p_rows = tab.draft_enumeration(broken, drafts[0], N)
    stop, full = code_outcome("asps", d, q_rows, p_rows, N)
    emitted = tab.emitted_law(stop, full, weight, d, p_rows[:, N], N)
    got = tab.continue_with_target(emitted, ref_target)
    assert np.max(np.abs(got - _constrained_ar_law(ref_target))) > 1e-3


REP, TEMP = 1.7, 0.8  # a repetition penalty and a temperature composed with the constraint


def _reference_controlled(raw, text):
    """NumPy float64 (controls_reference): the target laws of depth N + 1 below the root after
    the committed ``text``, each masked to the hand DFA's allowed set along its path, then the
    repetition penalty over ``text`` + the path, then the temperature (an unreachable prefix's
    law is left raw)."""

    def law_at(law, keep, prefix):
        logits = np.where(keep, np.log(law), -np.inf)
        return controls_ref.law(
            logits, list(text) + list(prefix), len(prefix),
            dict(repetition_penalty=REP), dict(temperature=TEMP),
        )  # fmt: skip

    return _at_reachable_prefixes(raw, law_at)


@pytest.mark.slow
def test_lookup_with_a_constraint_and_a_penalty_is_exact_by_enumeration(masked_models):
    """Lookup, the hand DFA, a repetition penalty and a temperature together: for committed
    texts whose chains differ (some cut by the constraint), the library's per-node laws
    (penalties.process, every node of every text in one call) equal the NumPy reference's, and
    SpS / ASpS with the library's lookup chain on those laws give the constrained, penalised AR
    law (float64 enumeration)."""
    raw = masked_models[3]
    chosen = {}
    for (text, state), (chain,) in sorted(_lookup_chains(1, 1).items()):
        if state == 0 and tuple(chain) not in chosen:
            chosen[tuple(chain)] = text
    texts = list(chosen.values())[:8]
    assert len(texts) >= 5 and any(len(c) < N for c in chosen)
    # The library's processing of every node (a prefix of depth 0..N) after every text.
    prefixes = [p for i in range(N + 1) for p in np.ndindex(*(V4,) * i)]
    rows = [(t, p) for t in texts for p in prefixes]
    path = np.zeros((len(rows), 1, N + 1), np.int32)
    for r, (_, p) in enumerate(rows):
        path[r, 0, : len(p)] = p
    depth = np.array([[len(p)] for _, p in rows])
    logits = np.stack([np.log(raw[len(p)][p]) for _, p in rows])[:, None].astype(np.float32)
    history = penalties.History.init(
        jnp.asarray([t for t, _ in rows], jnp.int32), jnp.full(len(rows), LOOKUP_TEXT), V4, N + 1
    )
    sampling = dataclasses.replace(
        _hand_tables().repeat(len(rows)),
        repetition_penalty=jnp.full(len(rows), REP, jnp.float32),
        temperature=jnp.full(len(rows), TEMP, jnp.float32),
        penalized=True,  # the penalties' code is compiled in only when the call gives them
    )
    lp, ok = _process(
        sampling, history, jnp.asarray(logits), jnp.asarray(path), jnp.asarray(depth), False
    )
    assert bool(jnp.all(ok))
    got_laws = np.exp(np.asarray(lp[:, 0], np.float64))
    for i, text in enumerate(texts):
        target = _reference_controlled(raw, text)
        for j, p in enumerate(prefixes):
            if _state(p) is not None:
                np.testing.assert_allclose(
                    got_laws[i * len(prefixes) + j], target[len(p)][p], atol=2e-6
                )
        want = tab.joint(target, N + 1)
        assert want[~_reachable((V4,) * (N + 1) + (1,)).reshape(-1)].sum() == 0
        (chain,) = _lookup_chains(1, 1)[(text, 0)]
        x = np.asarray([chain + [0] * (N - len(chain))])
        p_rows = tab.rows_along(target, x, N + 1)
        for method in ("sps", "asps"):
            stop, full = code_outcome(method, x, np.eye(V4)[x], p_rows, len(chain))
            emitted = tab.emitted_law(stop, full, np.ones(1), x, p_rows[:, len(chain)], len(chain))
            got = tab.continue_with_target(emitted, target)
            np.testing.assert_allclose(got, want, atol=1e-10, err_msg=f"{method} {text}")


# --- End to end on a tiny Llama (transformers) with a character tokenizer ----------------------

CHARS = "abcdefghijk"  # ids 1..11; id 0 is "</s>", the EOS
R1 = r"[a-e]+[f-k]?"  # EOS after every token; [f-k] ends the text
R2 = r"a[b-k]|b[a-c]|[c-k]"  # the second token's set depends on the first (no EOS after a, b)
R3 = r"[a-e][f-k]*"  # never ends: always a continuation
# The prefixes of each language, written out by hand: a token is allowed iff the text stays a
# prefix; EOS iff the text is a full match (re.fullmatch).
PREFIX = {R1: r"([a-e]+[f-k]?)?", R2: r"|a|b|a[b-k]|b[a-c]|[c-k]", R3: r"([a-e][f-k]*)?"}


@pytest.fixture(scope="module")
def char_models(tmp_path_factory):
    hf_target, target, draft = write_pair(tmp_path_factory.mktemp("ckpt"))
    tokenizer = char_tokenizer(CHARS)
    assert VOCAB == len(tokenizer) == 12
    with_tok = [dataclasses.replace(m, tokenizer=tokenizer) for m in (target, draft)]
    return hf_target, *with_tok, target


def _text(tokens):
    return "".join(CHARS[t - 1] for t in tokens if t > 0)


def _reference_law(logits, text, pattern, rep=1.0, temperature=1.0, prompt=()):
    """transformers' processors on the logits masked to the tokens ``pattern`` allows after
    ``text``: the constrained target law (float64)."""
    allowed = np.array(
        [bool(re.fullmatch(pattern, text))]
        + [bool(re.fullmatch(PREFIX[pattern], text + c)) for c in CHARS]
    )
    scores = torch.as_tensor(np.where(allowed, logits, -np.inf), dtype=torch.float32)[None]
    ids = torch.tensor([list(prompt) + [CHARS.index(c) + 1 for c in text]])
    if rep != 1.0:
        scores = transformers.RepetitionPenaltyLogitsProcessor(rep)(ids, scores)
    return torch.softmax(scores[0].double() / temperature, -1).numpy()


def _two_token_law(hf_target, pattern, **kw):
    with torch.no_grad():
        first = hf_target(torch.tensor([PROMPT])).logits[0, -1].numpy()
        second = hf_target(torch.tensor([PROMPT + [x] for x in range(VOCAB)])).logits[:, -1]
    p1 = _reference_law(first, "", pattern, prompt=PROMPT, **kw)
    p2 = np.zeros((VOCAB, VOCAB))
    for x in np.flatnonzero(p1):
        p2[x] = _reference_law(second[x].numpy(), CHARS[x - 1], pattern, prompt=PROMPT, **kw)
    return p1[:, None] * p2


# Per-row settings of one call: two patterns (per-row constraints), and one composed with a
# repetition penalty and a temperature.
E2E = [(R1, {}), (R2, {}), (R1, dict(rep=1.6, temperature=0.8))]
E2E_ROWS = 2500


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, shape", [("asps", dict(num_draft_tokens=2)), ("tv", dict(tree=(2, 2)))]
)
def test_first_two_tokens_follow_the_constrained_target_law(char_models, method, shape):
    """End to end through asps_jax.sample: the first two tokens (EOS included: R1 allows it
    after one token, R2 forces it after two) against the masked, renormalised target computed
    with transformers; two regexes in one batch; and every finished row matches its regex."""
    hf_target, target, draft, _ = char_models
    settings = [s for s in E2E for _ in range(E2E_ROWS)]
    out = asps_jax.sample(
        target, draft, [PROMPT] * len(settings), key=jax.random.key(7), max_new_tokens=3,
        method=method, eos_token_id=0, regex=[r for r, _ in settings],
        repetition_penalty=[kw.get("rep", 1.0) for _, kw in settings],
        temperature=[kw.get("temperature", 1.0) for _, kw in settings], **shape,
    )  # fmt: skip
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    for i, (pattern, kw) in enumerate(E2E):
        rows = slice(i * E2E_ROWS, (i + 1) * E2E_ROWS)
        counts = np.zeros((VOCAB, VOCAB))
        np.add.at(counts, (tokens[rows, 0], tokens[rows, 1]), 1)
        pvalue = _chi_square_pvalue(counts, _two_token_law(hf_target, pattern, **kw))
        assert pvalue > 1e-3, f"{method} setting {i}: chi-square p-value {pvalue:.2e}"
        for row, length in zip(tokens[rows], lengths[rows]):
            text = _text(row[:length])
            if row[length - 1] == 0:  # ended by EOS: a full match
                assert re.fullmatch(pattern, text), (pattern, text)
            else:
                assert re.fullmatch(PREFIX[pattern], text), (pattern, text)
    assert np.any(tokens[:E2E_ROWS, 1] == 0)  # EOS in an accepting state happens
    r2 = tokens[E2E_ROWS : 2 * E2E_ROWS]
    assert np.all(r2[np.isin(r2[:, 0], [1, 2]), 2] == 0)  # and is forced after R2's match
    assert np.all(r2[~np.isin(r2[:, 0], [1, 2]), 1] == 0)


def test_the_test_patterns_compile_to_their_regex_language(char_models):
    """The references above read the patterns with Python's ``re``: outlines-core's index must
    accept exactly those strings (checked on every string of up to 4 characters)."""
    tokens = constraints.token_bytes(char_models[1].tokenizer, VOCAB)
    for pattern in (R1, R2, R3):
        dfa = constraints.compile_regex(pattern, tokens)
        for length in range(5):
            for s in itertools.product(CHARS, repeat=length):
                state = dfa.start
                for c in s:
                    state = dfa.dense()[state, CHARS.index(c) + 1] if state >= 0 else -1
                accepted = state >= 0 and bool(dfa.final[state])
                assert accepted == bool(re.fullmatch(pattern, "".join(s))), (pattern, s)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "specinfer"])
def test_without_eos_a_row_ends_where_its_constraint_allows_nothing(char_models, method):
    """EOS disabled: R2's accepting states have no continuation, so the row ends there (no
    failure, also when the node is inside a drafted tree); R3's rows never end early."""
    _, target, draft, _ = char_models
    out = asps_jax.sample(
        target, draft if method != "ar" else None, [PROMPT] * 64, key=jax.random.key(1),
        max_new_tokens=5, method=method, eos_token_id=-1, regex=[R2] * 32 + [R3] * 32,
        **(dict(num_drafts=2, num_draft_tokens=3) if method != "ar" else {}),
    )  # fmt: skip
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    for b in range(64):
        text = _text(tokens[b, : lengths[b]])
        assert 0 not in tokens[b, : lengths[b]]
        if b < 32:
            assert lengths[b] in (1, 2) and re.fullmatch(R2, text), text
        else:
            assert lengths[b] == 5 and re.fullmatch(R3, text), text


def test_second_compile_reads_the_disk_cache(char_models, tmp_path, monkeypatch):
    _, target, _, _ = char_models
    monkeypatch.setenv("ASPS_JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ASPS_JAX_NO_CACHE", raising=False)
    monkeypatch.setattr(constraints, "_MEMORY", {})
    tokens = constraints.token_bytes(target.tokenizer, target.vocab_size)
    before = dict(constraints.STATS)
    first = constraints.compile_regex("[a-c]+k", tokens)
    files = list((tmp_path / "constraints").glob("*.npz"))
    assert len(files) == 1 and files[0].stem == first.key
    assert constraints.STATS["compiled"] == before.get("compiled", 0) + 1
    monkeypatch.setattr(constraints, "_MEMORY", {})
    second = constraints.compile_regex("[a-c]+k", tokens)
    assert constraints.STATS["compiled"] == before.get("compiled", 0) + 1
    assert constraints.STATS["disk"] == before.get("disk", 0) + 1
    np.testing.assert_array_equal(first.next, second.next)
    np.testing.assert_array_equal(first.classes, second.classes)
    np.testing.assert_array_equal(first.final, second.final)
    # Another vocabulary is another entry.
    constraints.compile_regex("[a-c]+k", tokens[:-1] + [b"z"])
    assert len(list((tmp_path / "constraints").glob("*.npz"))) == 2


BAD = [
    (dict(regex="(a"), "regex '(a' does not compile"),
    (dict(regex=3), "regex must be a string"),
    (dict(json_schema={"type": "integer", "minimum": 0, "maximum": 120}),
     "keyword 'minimum' at /minimum is not enforced"),
    (dict(json_schema={"type": "object", "properties": {"n": {"type": "number",
     "multipleOf": 2}}}), "keyword 'multipleOf' at /properties/n/multipleOf"),
    (dict(json_schema={"oneOf": [{"type": "string"}]}), "keyword 'oneOf'"),
    (dict(json_schema="{not json"), "json_schema: not valid JSON"),
    (dict(json_schema={"type": "date"}), "type 'date' at /type is not supported"),
    (dict(regex=["a", "b", "c"]), "one per prompt (1)"),
    (dict(regex="a", json_schema={"type": "string"}), "at most one constraint per prompt"),
]  # fmt: skip


@pytest.mark.parametrize("kwargs, match", BAD)
def test_bad_constraints_are_one_line_errors(char_models, kwargs, match):
    _, target, draft, _ = char_models
    with pytest.raises(ValueError) as info:
        asps_jax.sample(target, draft, [PROMPT], key=jax.random.key(0), max_new_tokens=2, **kwargs)
    assert match in str(info.value) and "\n" not in str(info.value)


def test_no_tokenizer_and_size_bound_are_one_line_errors(char_models, monkeypatch):
    _, target, draft, bare = char_models
    with pytest.raises(ValueError, match="has no tokenizer") as info:
        asps_jax.sample(bare, None, [PROMPT], key=jax.random.key(0), max_new_tokens=2,
                        method="ar", regex="a")  # fmt: skip
    assert "\n" not in str(info.value)
    monkeypatch.setattr(constraints, "MAX_TABLE_ENTRIES", 40)
    monkeypatch.setattr(constraints, "_MEMORY", {})
    with pytest.raises(ValueError, match="past the bound of 40") as info:
        asps_jax.sample(target, draft, [PROMPT], key=jax.random.key(0), max_new_tokens=2,
                        regex="[a-k]{6}")  # fmt: skip
    assert "\n" not in str(info.value)


# --- The bundled pair (byte-level BPE: multi-character tokens) --------------------------------

BUNDLED_REGEX = r"(Romeo|Juliet) loves (Romeo|Juliet)\."
BUNDLED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "bc"]},
    },
    "required": ["name", "ok", "kind"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def bundled():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "models"
    roles = ("target", "draft")
    return tuple(asps_jax.load_model(str(root / f"tinyshakespeare-{r}")) for r in roles)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, shape", [("asps", dict(num_draft_tokens=4)), ("tv", dict(tree=(2, 2)))]
)
def test_bundled_pair_rows_match_their_regex_or_schema(bundled, method, shape):
    """Per-row constraints on the bundled pair: every regex row is a full match of its regex
    (built of multi-character tokens), every schema row parses as JSON and validates against
    the schema (jsonschema); every row ends with the EOS, which only an accepting state allows."""
    target, draft = bundled
    tok = target.tokenizer
    prompt = tok.encode("ROMEO:")
    out = asps_jax.sample(
        target, draft, [prompt] * 6, key=jax.random.key(3), max_new_tokens=96, method=method,
        regex=[BUNDLED_REGEX] * 3 + [None] * 3, json_schema=[None] * 3 + [BUNDLED_SCHEMA] * 3,
        **shape,
    )  # fmt: skip
    eos = tok.eos_token_id
    multi_char = 0
    for b in range(6):
        ids = np.asarray(out.tokens[b, : out.lengths[b]]).tolist()
        assert ids[-1] == eos and eos not in ids[:-1], (b, ids)
        text = tok.decode(ids[:-1])
        multi_char += sum(len(tok.decode([t])) > 1 for t in ids[:-1])
        if b < 3:
            assert re.fullmatch(BUNDLED_REGEX, text), text
        else:
            jsonschema.validate(json.loads(text), BUNDLED_SCHEMA)
    assert multi_char > 0


LOOKUP_PROMPT = "Romeo loves Juliet. Juliet loves Romeo.\nRomeo loves Juliet. Juliet loves Romeo.\n"


@pytest.mark.slow
def test_bundled_lookup_rows_match_their_regex(bundled):
    """draft="lookup" under a regex on the bundled target, with a prompt that quotes the
    language's sentences, so that the lookup drafts (and its candidates that the regex forbids,
    e.g. " Juliet" at the start or after the full stop, are cut): every row, also those composed
    with a repetition penalty and a temperature, is a full match of the regex ending in EOS."""
    target, _ = bundled
    tok = target.tokenizer
    rows = 6
    out = asps_jax.sample(
        target, "lookup", [tok.encode(LOOKUP_PROMPT)] * rows, key=jax.random.key(5),
        max_new_tokens=24, method="asps", num_draft_tokens=4, lookup_ngram=2,
        regex=BUNDLED_REGEX, repetition_penalty=[1.0] * 3 + [1.3] * 3,
        temperature=[1.0] * 3 + [0.8] * 3,
    )  # fmt: skip
    eos = tok.eos_token_id
    for b in range(rows):
        ids = np.asarray(out.tokens[b, : out.lengths[b]]).tolist()
        assert ids[-1] == eos and eos not in ids[:-1], (b, ids)
        assert re.fullmatch(BUNDLED_REGEX, tok.decode(ids[:-1])), tok.decode(ids)
    accepted = np.asarray(out.stats["accepted"])
    assert np.all(np.asarray(out.stats["decisions"]) > 0) and accepted.sum() >= rows, accepted


def _cli():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "sample.py"
    spec = importlib.util.spec_from_file_location("sample_cli_constraints", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--regex", "(a"], "regex '(a' does not compile"),
        (["--json-schema", "SCHEMA"], "keyword 'maximum' at /maximum is not enforced"),
        (["--json-schema", "/nonexistent/schema.json"], "--json-schema: cannot read"),
    ],
)
def test_cli_constraint_errors_exit_2_with_one_line(capsys, tmp_path, argv, needle):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "integer", "maximum": 120}))
    argv = [str(schema) if a == "SCHEMA" else a for a in argv]
    assert _cli().main(argv + ["--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.slow
def test_stream_takes_the_constraint(char_models):
    """asps_jax.stream (a Session underneath): the streamed tokens are the result's, and every
    row is a full match of its regex ending in EOS."""
    _, target, _, _ = char_models
    gen = asps_jax.stream(
        target, None, [PROMPT] * 4, key=jax.random.key(2), max_new_tokens=4, method="ar",
        eos_token_id=0, regex=R2,
    )  # fmt: skip
    streamed = [[] for _ in range(4)]
    try:
        while True:
            for b, new in enumerate(next(gen)):
                streamed[b] += new
    except StopIteration as stop:
        out = stop.value
    for b in range(4):
        ids = np.asarray(out.tokens[b, : out.lengths[b]]).tolist()
        assert ids == streamed[b] and ids[-1] == 0
        assert re.fullmatch(R2, _text(ids)), ids


# --- Prompt lookup under a constraint (draft="lookup"; asps_jax/lookup.py) --------------------

LOOKUP_TEXT = 6  # every committed text of 6 tokens over V4


def _reference_lookup(text, state, ngram, num_chains):
    """Pure Python: the K most recent distinct continuations (at most N tokens, never past the
    root) of an earlier occurrence of the last ``ngram`` tokens, each cut before its first token
    the hand DFA forbids from ``state`` (None: no constraint); an empty continuation is no
    match."""
    out, last = [], len(text) - 1
    for j in range(last - 1, ngram - 2, -1):
        if text[j - ngram + 1 : j + 1] != text[last - ngram + 1 :]:
            continue
        chain, s = [], state
        for x in text[j + 1 : j + 1 + N]:
            if state is not None and (s is None or x not in HAND_DFA[s]):
                break
            chain.append(x)
            s = HAND_DFA[s].get(x) if state is not None else None
        if chain and chain not in out:
            out.append(chain)
    return (out + [[]] * num_chains)[:num_chains]


@functools.lru_cache
def _lookup_chains(ngram, num_chains):
    """The library's lookup chains (asps_jax.lookup.lookup_drafts with the hand DFA) of every
    committed text of LOOKUP_TEXT tokens, from each committed DFA state, in one call: a dict
    (text, state) -> list of K chains."""
    texts = tab.all_strings(V4, LOOKUP_TEXT)
    rows = [(t, s) for t in texts for s in HAND_DFA]
    prompts = jnp.asarray(np.stack([t for t, _ in rows]), jnp.int32)
    history = penalties.History.init(prompts, jnp.full(len(rows), LOOKUP_TEXT), V4, 1)
    # The committed state as a global id of the stacked table (the hand DFA starts at FIRST).
    dfa = jnp.asarray([s + constraints.FIRST for _, s in rows], jnp.int32)
    history = dataclasses.replace(history, dfa=dfa)
    draft = jax.jit(
        functools.partial(
            lookup.lookup_drafts, ngram=ngram, cap=N, num_chains=num_chains, draft_len=N, vocab=V4
        )
    )
    tokens, laws, lengths = draft(history, sampling=_hand_tables().repeat(len(rows)))
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    assert np.all(np.asarray(laws)[..., 0, :].max(-1) == 0.0)  # point masses
    return {
        (tuple(t), s): [tokens[i, k, : lengths[i, k]].tolist() for k in range(num_chains)]
        for i, (t, s) in enumerate(rows)
    }


@pytest.mark.slow
@pytest.mark.parametrize("ngram, num_chains", [(1, 1), (2, 2)])
def test_lookup_cuts_candidates_the_constraint_forbids(ngram, num_chains):
    """Every committed text of 6 tokens from every DFA state: the library's chains are the
    reference search's, each cut before the first token the constraint forbids at its node (an
    occurrence whose continuation starts with a forbidden token is no match). Some candidate
    was cut, and some text has a match only further back because of a cut."""
    got = _lookup_chains(ngram, num_chains)
    cut = skipped = 0
    for (text, state), chains in got.items():
        assert chains == _reference_lookup(list(text), state, ngram, num_chains), (text, state)
        free = _reference_lookup(list(text), None, ngram, num_chains)[0]
        cut += 0 < len(chains[0]) < len(free) and chains[0] == free[: len(chains[0])]
        skipped += bool(chains[0]) and chains[0][0] != free[0]
    assert cut > 0 and skipped > 0


@pytest.mark.parametrize("method", ["sps", "asps", "specinfer"])
def test_lookup_under_a_constraint_is_exact_by_enumeration(masked_models, method):
    """Every distinct lookup chain (or pair of chains, K = 2 for specinfer) the library drafts
    from the start state: the step's outcome law on the target masked per node by the library,
    continued by the reference's masked target, is the constrained AR law (NumPy float64), so
    no string outside the constraint has mass."""
    target, _, ref_target, _ = masked_models
    want = _constrained_ar_law(ref_target)
    num_chains = 2 if method == "specinfer" else 1
    ngram = 2 if num_chains == 2 else 1
    found = {
        tuple(map(tuple, chains))
        for (_, state), chains in _lookup_chains(ngram, num_chains).items()
        if state == 0
    }
    assert len(found) >= 4 and any(len(c) == 1 for chains in found for c in chains)
    # And the uncut chains (a point mass on a token the constraint forbids, as a logit_bias ban
    # still leaves it): rejected with certainty, no NaN, no string outside the constraint.
    uncut = {
        tuple(map(tuple, _reference_lookup(list(text), None, ngram, num_chains)))
        for text in tab.all_strings(V4, 4)
    }
    assert any(_state(c) is None for chains in uncut for c in chains)
    found |= uncut
    for chains in sorted(found):
        if num_chains == 2:
            padded = [list(c) + [0] * (N - len(c)) for c in chains]
            drafts = [_point_mass_model(c, V4) for c in padded]
            lengths = [len(c) for c in chains]
            law, _ = tree_law(node_law("specinfer", V4), target, drafts, N, lengths, tail=True)
            assert continuation_error(law, ref_target, N) < 1e-9, chains
            continue
        length = len(chains[0])
        x = np.asarray([list(chains[0]) + [0] * (N - length)])
        p_rows = tab.rows_along(target, x, N + 1)
        stop, full = code_outcome(method, x, np.eye(V4)[x], p_rows, length)
        emitted = tab.emitted_law(stop, full, np.ones(1), x, p_rows[:, length], length)
        got = tab.continue_with_target(emitted, ref_target)
        np.testing.assert_allclose(got, want, atol=1e-10, err_msg=str(chains))


@pytest.mark.slow
def test_rows_cut_before_their_constraint_matched_are_flagged_incomplete(char_models):
    """``SampleOutput.incomplete`` against Python's ``re``: a row is incomplete iff its text
    (EOS, id 0, left out) is not a full match of its regex; budgets of 1 to 5 tokens cut the
    4-token pattern's rows short, EOS or a dead state ends others."""
    _, target, draft, _ = char_models
    method = "specinfer"  # the flag is read from the emitted tokens, whatever the method
    patterns = [R1] * 16 + [R2] * 16 + ["[a-e]{2}[f-k]{2}"] * 32  # the last: 4 tokens or none
    budgets = [1 + b % 5 for b in range(64)]
    out = asps_jax.sample(
        target, draft, [PROMPT] * 64, key=jax.random.key(2), max_new_tokens=budgets,
        method=method, regex=patterns, eos_token_id=0, num_drafts=2, num_draft_tokens=3,
    )  # fmt: skip
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    expected = [
        re.fullmatch(patterns[b], _text(tokens[b, : lengths[b]])) is None for b in range(64)
    ]
    assert out.incomplete.tolist() == expected
    assert 0 < sum(expected) < 64, expected
    # No constraint, no flag (SampleOutput.incomplete is None): nothing kept on the host.
    plain = sampler.prepare(target, draft, [PROMPT], key=jax.random.key(2), max_new_tokens=2)
    assert plain.constraint is None
