"""asps_jax.textstream: streamed pieces never split a UTF-8 character and add up to the decode."""

from __future__ import annotations

from pathlib import Path

import pytest

from asps_jax.models.loader import load_tokenizer
from asps_jax.textstream import REPLACEMENT, TextStream

ROOT = Path(__file__).resolve().parents[1]
TEXT = "naïve café, 10 € — 😀!"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ROOT / "models" / "tinyshakespeare-target")


def test_byte_level_tokens_split_characters(tokenizer):
    # The premise of the other tests: some prefixes of this token list end inside a character.
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT
    assert sum(REPLACEMENT in tokenizer.decode(ids[:i]) for i in range(len(ids))) >= 4


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_pieces_never_hold_a_replacement_and_concatenate_to_the_decode(tokenizer, chunk):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stream = TextStream(tokenizer, skip_special_tokens=True)
    pieces = [stream.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(stream.flush())
    assert not any(REPLACEMENT in piece for piece in pieces)
    assert "".join(pieces) == TEXT
    assert "".join(pieces[:-1]) == TEXT  # complete at the end: nothing left to flush


def test_flush_emits_an_incomplete_character_at_the_end(tokenizer):
    ids = tokenizer.encode("é", add_special_tokens=False)
    assert len(ids) == 2  # one byte token each
    stream = TextStream(tokenizer)
    assert stream.push(ids[:1]) == ""
    assert stream.flush() == tokenizer.decode(ids[:1]) == REPLACEMENT


def test_special_tokens_are_skipped_like_the_full_decode(tokenizer):
    ids = [1] + tokenizer.encode("ROMEO:", add_special_tokens=False) + [2]
    stream = TextStream(tokenizer, skip_special_tokens=True)
    text = "".join(stream.push([i]) for i in ids) + stream.flush()
    assert text == "ROMEO:"
