"""A step's program contains only the feature families the call uses: each family's presence is
static (giving it changes the program), its values are traced (changing them does not)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hf_checkpoints import load_tiny_pair

from asps_jax import decode, sampler

PROMPT = [1, 5, 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp("families"))


def _program(pair, **kwargs) -> str:
    """The StableHLO of ``Decoder.generate`` for the call (lowered, not compiled)."""
    target, draft = pair
    call = sampler.prepare(
        target, draft, [PROMPT], key=jax.random.key(0), max_new_tokens=4, method="asps",
        num_draft_tokens=2, **kwargs,
    )  # fmt: skip
    return decode.Decoder.generate.lower(call.decoder, **call.inputs.kwargs()).as_text()


FAMILIES = {
    "top_k": (2, 3),
    "top_p": (0.9, 0.8),
    "min_p": (0.1, 0.2),
    "repetition_penalty": (1.2, 1.3),
    "presence_penalty": (0.5, -0.7),
    "frequency_penalty": (0.5, 0.25),
    "logit_bias": ({2: 1.0}, {3: -np.inf}),
    "no_repeat_ngram_size": (2, 3),
    "min_tokens": (2, 5),
    "bad_words": ([[1, 2], [3]], [[4, 4], [0]]),  # the same shape: [1, 2 words, 2 tokens]
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
