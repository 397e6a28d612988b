"""A step's program contains only the feature families the call uses: each family's presence is
static (giving it changes the program), its values are traced (changing them does not). The
sampling controls, stop strings and constraints have values; top-k logprobs, the raw logprobs and
the diagnostics are an output width or a flag, so only their presence is checked."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hf_checkpoints import char_tokenizer, load_tiny_pair

from asps_jax import decode, sampler

PROMPT = [1, 5, 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, draft = load_tiny_pair(tmp_path_factory.mktemp("families"))
    tokenizer = char_tokenizer("abcdefghijk")  # stop strings and constraints read token bytes
    return dataclasses.replace(target, tokenizer=tokenizer), draft


def _program(pair, method="asps", **kwargs) -> str:
    """The StableHLO of ``Decoder.generate`` for the call (lowered, not compiled)."""
    target, draft = pair
    call = sampler.prepare(
        target, draft, [PROMPT], key=jax.random.key(0), max_new_tokens=4, method=method,
        num_draft_tokens=2, **kwargs,
    )  # fmt: skip
    return decode.Decoder.generate.lower(call.decoder, **call.inputs.kwargs()).as_text()


FAMILIES = {
    "top_k": (2, 3),
    "top_p": (0.9, 0.8),
    "min_p": (0.1, 0.2),
    "typical_p": (0.5, 0.9),
    "repetition_penalty": (1.2, 1.3),
    "presence_penalty": (0.5, -0.7),
    "frequency_penalty": (0.5, 0.25),
    "logit_bias": ({2: 1.0}, {3: -np.inf}),
    "no_repeat_ngram_size": (2, 3),
    "min_tokens": (2, 5),
    "bad_words": ([[1, 2], [3]], [[4, 4], [0]]),  # the same shape: [1, 2 words, 2 tokens]
    "stop": (["ab", "c"], ["ka", "j"]),  # the same lengths
    "regex": ("[a-e]+k", "[f-j]+a"),  # the same automaton shape (json_schema: the same family)
}


@pytest.fixture(scope="module")
def plain(pair):
    return _program(pair)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_enters_the_program_only_when_given(pair, plain, family):
    one, other = FAMILIES[family]
    with_one = _program(pair, **{family: one})
    assert with_one != plain, f"{family} compiled into the plain program, or not at all"
    assert len(with_one) > len(plain)
    assert _program(pair, **{family: other}) == with_one, f"a new {family} value recompiles"


# Presence only: (the call's other arguments, the option given).
FLAGS = {
    "top_logprobs": ({}, {"top_logprobs": 2}),
    "raw_logprobs": ({}, {"raw_logprobs": True}),
    "diagnostics": ({"method": "specinfer", "num_drafts": 2}, {"diagnostics": True}),
}


@pytest.mark.parametrize("flag", FLAGS)
def test_an_output_enters_the_program_only_when_asked(pair, plain, flag):
    base, option = FLAGS[flag]
    without = _program(pair, **base) if base else plain
    with_it = _program(pair, **base, **option)
    assert with_it != without and len(with_it) > len(without), f"{flag} changes nothing"
