"""The bytes each token id adds to a text: one table per tokenizer, read by every part that
matches text: stop strings (:mod:`asps_jax.controls.stopping`) and regex / JSON-schema constraints
(:mod:`asps_jax.controls.constraints`), so that a stop string and a pattern see the same text for
the same token.

Byte-level BPE (GPT-2's byte-to-unicode alphabet), SentencePiece-style vocabularies (``▁`` is a
space, ``<0xNN>`` a raw byte), a slow tokenizer's added tokens (their content, as written; a
fast tokenizer decodes them like any other token), and for any other tokenizer
``decode([id])``; special tokens and ids past the tokenizer's vocabulary add none.
"""

from __future__ import annotations

import json
import re

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_TABLES: dict[int, tuple[object, int, tuple[bytes, ...]]] = {}


def token_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """The UTF-8 bytes each token id in ``[0, vocab_size)`` adds to the text (ids past the
    tokenizer's vocabulary, and special tokens, add none); computed once per tokenizer."""
    hit = _TABLES.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer or hit[1] != vocab_size:
        hit = (tokenizer, vocab_size, tuple(_read(tokenizer, int(vocab_size))))
        _TABLES[id(tokenizer)] = hit
    return list(hit[2])


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable Latin-1 bytes stand for themselves,
    every other byte b for chr(256 + its rank among those others)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + rank) for rank, b in enumerate(others)})
    return {c: b for b, c in chars.items()}


def _decoder_types(tokenizer) -> set[str]:
    """The ``type`` of the fast tokenizer's decoder and of every decoder in a Sequence, plus
    ``"ReplaceMetaspace"`` for a Replace of ``▁`` (Llama's tokenizer.json)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return {"SentencePiece"} if hasattr(tokenizer, "sp_model") else set()
    found: set[str] = set()

    def walk(dec):
        if not isinstance(dec, dict):
            return
        found.add(dec.get("type", ""))
        if dec.get("type") == "Replace" and "▁" in json.dumps(dec, ensure_ascii=False):
            found.add("ReplaceMetaspace")
        for sub in dec.get("decoders") or ():
            walk(sub)

    walk(json.loads(backend.to_str()).get("decoder"))
    return found


def special_ids(tokenizer) -> set[int]:
    ids = set(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
    for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(i))
    return ids


def _read(tokenizer, vocab_size: int) -> list[bytes]:
    types = _decoder_types(tokenizer)
    special = special_ids(tokenizer)
    # A fast tokenizer's decode runs added tokens through its decoder like any other (byte-level:
    # 'ÿé' is the bytes ff e9, as decode gives it); a slow one joins their content as written.
    added = {}
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        added = {
            int(i): t.content
            for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
            if int(i) not in special
        }
    size = min(int(vocab_size), len(tokenizer))
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    alphabet = _byte_alphabet() if "ByteLevel" in types else None
    metaspace = bool(types & {"Metaspace", "ByteFallback", "ReplaceMetaspace", "SentencePiece"})
    out: list[bytes] = []
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            out.append(b"")
        elif i in added:
            out.append(added[i].encode("utf-8"))
        elif alphabet is not None and all(c in alphabet for c in piece):
            out.append(bytes(alphabet[c] for c in piece))
        elif metaspace:
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback and "ByteLevel" not in types:
                out.append(bytes([int(fallback.group(1), 16)]))
            else:
                out.append(piece.replace("▁", " ").encode("utf-8"))
        else:  # e.g. a character-level vocabulary: the token decoded alone
            out.append(tokenizer.decode([i]).encode("utf-8"))
    out.extend(b"" for _ in range(int(vocab_size) - size))
    return out
