"""Incremental detokenisation for streaming that never splits a character.

A byte-level tokenizer can end a step in the middle of a multi-byte UTF-8 character (``é`` is two
byte tokens in the bundled BPE); decoding such a prefix gives U+FFFD where the character will be.
:class:`TextStream` decodes the whole prefix each time and holds back a trailing run of U+FFFD,
which the next tokens complete; :meth:`TextStream.flush` emits whatever is left at the end. The
pieces it returns concatenate to the decode of all tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

REPLACEMENT = "\ufffd"


class TextStream:
    """``push(ids) -> new text`` for a growing token list; ``flush() -> the rest`` at the end.

    ``tokenizer`` is anything with ``decode(ids, **decode_kwargs) -> str`` (a transformers
    tokenizer). Decoding the full prefix each step keeps tokenizers whose pieces depend on their
    neighbours (leading spaces, byte fallback) right, at O(length) per step.
    """

    def __init__(self, tokenizer, **decode_kwargs):
        self._tokenizer = tokenizer
        self._decode_kwargs = decode_kwargs
        self._ids: list[int] = []
        self._shown = ""

    def push(self, ids: Iterable[int]) -> str:
        """Add tokens; return the newly completed text (possibly empty)."""
        self._ids.extend(int(i) for i in ids)
        return self._emit(self._decode().rstrip(REPLACEMENT))

    def flush(self) -> str:
        """Return the text still held back (an incomplete character decodes to U+FFFD here)."""
        return self._emit(self._decode())

    def _decode(self) -> str:
        return self._tokenizer.decode(self._ids, **self._decode_kwargs)

    def _emit(self, text: str) -> str:
        piece = text[len(self._shown) :]
        if piece:
            self._shown = text
        return piece
