"""Stop strings: a row ends after the first occurrence of a stop string in its generated text.

The text is the UTF-8 bytes of the generated tokens. Each token's bytes come from the one table
per tokenizer that constraints read too (:func:`asps_jax.controls.tokenbytes.token_bytes`), laid out
as device arrays once (:func:`token_byte_table`); special tokens add no bytes. Matching runs on
device, inside the jitted loop, once per step on the emitted block (:func:`advance`): the
block's bytes are laid out after the last ``Ls - 1`` bytes of the row's earlier text (its
*tail*, carried in the decode state), and every window ending at a new byte is compared with
every stop string. The first token whose bytes complete an occurrence is the row's last; the
rest of the block is dropped. A stop string may end partway into that token (the token's
remaining bytes are kept, as transformers' ``stop_strings`` keeps them) and may span tokens and
steps.

The stop strings are arrays padded to a bucket (:func:`stop_strings`): changing them within the
bucket (at most ``MAX_STOP_STRINGS`` strings of at most ``MAX_STOP_BYTES`` bytes) never recompiles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax.controls.tokenbytes import token_bytes

__all__ = [
    "MAX_STOP_BYTES",
    "MAX_STOP_STRINGS",
    "StopStrings",
    "advance",
    "stop_strings",
    "token_byte_table",
    "token_bytes",
    "validate_stop",
]

MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 64
_MIN_STRINGS = 4  # string-count buckets: 4, 8, 16
_MIN_BYTES = 8  # string-length buckets (bytes): 8, 16, 32, 64
_TOKEN_BYTES_MULTIPLE = 8
_ABSENT = -1  # a tail slot before the start of the text: equals no byte
_PAD = -2  # a stop string's left padding: matches anything


def validate_stop(stop, name: str = "stop") -> tuple[bytes, ...]:
    """The stop strings as UTF-8 bytes (duplicates dropped, order kept); a one-line
    ``ValueError`` naming ``name`` for anything else than at most ``MAX_STOP_STRINGS`` non-empty
    strings of at most ``MAX_STOP_BYTES`` UTF-8 bytes. None or an empty list: no stop strings;
    one string: that one."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"{name} must be a list of strings, got {type(stop).__name__}")
    out: list[bytes] = []
    for i, s in enumerate(stop):
        where = f"{name}[{i}]" if name == "stop" else f"{name} {s!r}"
        if not isinstance(s, str):
            raise ValueError(f"{where} must be a string, got {type(s).__name__}")
        if not s:
            raise ValueError(f"{where} is empty: a stop string needs at least one character")
        try:
            b = s.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where} is not valid Unicode text (a lone surrogate?)") from None
        if len(b) > MAX_STOP_BYTES:
            raise ValueError(
                f"{where} is {len(b)} bytes long in UTF-8; at most {MAX_STOP_BYTES} are allowed"
            )
        if b not in out:
            out.append(b)
    if len(out) > MAX_STOP_STRINGS:
        raise ValueError(
            f"{name}: {len(out)} distinct stop strings; at most {MAX_STOP_STRINGS} are allowed"
        )
    return tuple(out)


# --------------------------------------------------------------------------------------------
# The token byte table (host, once per tokenizer)


def token_byte_table(pieces: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """``(bytes uint8[V, Lt], lengths int32[V])`` of :func:`token_bytes`' list (``Lt`` the
    longest token rounded up to a multiple of 8)."""
    longest = max((len(p) for p in pieces), default=0)
    width = max(_TOKEN_BYTES_MULTIPLE, -(-longest // _TOKEN_BYTES_MULTIPLE) * _TOKEN_BYTES_MULTIPLE)
    table = np.zeros((len(pieces), width), np.uint8)
    for i, p in enumerate(pieces):
        table[i, : len(p)] = np.frombuffer(p, np.uint8)
    return table, np.array([len(p) for p in pieces], np.int32)


_TABLES: dict[int, tuple[object, int, tuple[jax.Array, jax.Array]]] = {}


def cached_table(tokenizer, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """:func:`token_byte_table` of ``tokenizer`` as device arrays, built once per tokenizer."""
    hit = _TABLES.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer or hit[1] != vocab_size:
        table, lengths = token_byte_table(token_bytes(tokenizer, vocab_size))
        hit = (tokenizer, vocab_size, (jnp.asarray(table), jnp.asarray(lengths)))
        _TABLES[id(tokenizer)] = hit
    return hit[2]


# --------------------------------------------------------------------------------------------
# The device state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StopStrings:
    """The stop strings of a call and each row's matching state (a pytree of device arrays).

    Attributes:
      token_bytes: uint8[V, Lt], token i's bytes in ``token_bytes[i, :token_lengths[i]]``.
      token_lengths: int32[V].
      strings: int32[S, Ls], stop string s right-aligned in its row, ``-2`` to its left (a
        bucket of S strings of at most Ls bytes; unused rows have length 0).
      string_lengths: int32[S], 0 for an unused row.
      tail: int32[B, Ls - 1], the last ``Ls - 1`` bytes of each row's generated text, ``-1``
        before its start.
    """

    # The layout over the batch (metadata "sharding", read by asps_jax.sharding): the tables
    # whole on every device, the tails by row.
    token_bytes: jax.Array = dataclasses.field(metadata=dict(sharding="replicated"))
    token_lengths: jax.Array = dataclasses.field(metadata=dict(sharding="replicated"))
    strings: jax.Array = dataclasses.field(metadata=dict(sharding="replicated"))
    string_lengths: jax.Array = dataclasses.field(metadata=dict(sharding="replicated"))
    tail: jax.Array = dataclasses.field(metadata=dict(sharding="rows"))


def _bucket(x: int, minimum: int) -> int:
    size = minimum
    while size < x:
        size *= 2
    return size


def stop_strings(table, strings: tuple[bytes, ...], batch: int) -> StopStrings | None:
    """The device state for the stop strings ``strings`` (:func:`validate_stop`'s output) and
    ``table`` (``(bytes, lengths)``); None when there are none. The strings are padded to
    ``S`` = 4, 8 or 16 rows of ``Ls`` = 8, 16, 32 or 64 bytes."""
    if not strings:
        return None
    count = _bucket(len(strings), _MIN_STRINGS)
    width = _bucket(max(len(s) for s in strings), _MIN_BYTES)
    arr = np.full((count, width), _PAD, np.int32)
    lengths = np.zeros(count, np.int32)
    for i, s in enumerate(strings):
        arr[i, width - len(s) :] = np.frombuffer(s, np.uint8)
        lengths[i] = len(s)
    return StopStrings(
        token_bytes=jnp.asarray(table[0], jnp.uint8),
        token_lengths=jnp.asarray(table[1], jnp.int32),
        strings=jnp.asarray(arr),
        string_lengths=jnp.asarray(lengths),
        tail=jnp.full((batch, width - 1), _ABSENT, jnp.int32),
    )


# --------------------------------------------------------------------------------------------
# Matching (device)


def _row_text(stop: StopStrings, tail_W, block_T, num):
    """One row's text: its tail, then the bytes of ``block[:num]`` (``-1`` after), int32[W + F]
    with F = T * Lt; and the end offset of each token's bytes in the new text, int32[T]."""
    vocab, per_token = stop.token_bytes.shape
    width = block_T.shape[0]
    ids_T = jnp.clip(block_T, 0, vocab - 1)
    lens_T = jnp.where(jnp.arange(width) < num, stop.token_lengths[ids_T], 0)
    ends_T = jnp.cumsum(lens_T)
    # Byte p of the new text lies in token t(p) = #{t : ends[t] <= p}, at offset p - start.
    p_F = jnp.arange(width * per_token)
    t_F = jnp.minimum(jnp.sum(ends_T[None, :] <= p_F[:, None], axis=1), width - 1)
    j_F = p_F - (ends_T[t_F] - lens_T[t_F])
    byte_F = stop.token_bytes[ids_T[t_F], jnp.clip(j_F, 0, per_token - 1)].astype(jnp.int32)
    return jnp.concatenate([tail_W, jnp.where(p_F < ends_T[-1], byte_F, _ABSENT)]), ends_T


def advance(stop: StopStrings | None, block_BT, num_B, first_B=None):
    """Emit ``block[b, :num[b]]`` of each row through the stop strings.

    Returns ``(num, hit, stop)``: ``num`` cut after the first token whose bytes complete a stop
    string (the stop string kept), ``hit`` bool[B] where one did, and the state with each row's
    tail moved past its kept tokens. Without stop strings (``stop`` None): ``(num, False, None)``.
    ``first_B``: int32[B], the first block token that may complete one (``min_tokens``: none
    before the row's ``min_tokens``-th generated token, as vLLM); None: any.
    """
    if stop is None:
        return num_B, jnp.zeros(num_B.shape, bool), None
    rows = jax.vmap(_row_text, in_axes=(None, 0, 0, 0))
    text_BX, ends_BT = rows(stop, stop.tail, block_BT, num_B)
    tail_len = stop.tail.shape[1]  # Ls - 1
    span = text_BX.shape[1] - tail_len  # F

    # The window ending at new byte p is text[p : p + Ls] (the tail is Ls - 1 bytes long): its
    # byte i is the slice text[:, i : i + F] at p, compared with byte i of every stop string (a
    # loop over the Ls window bytes, each step elementwise on [B, F, S]; no gather).
    def compare(i, match_BFS):
        want_S = jax.lax.dynamic_index_in_dim(stop.strings, i, axis=1, keepdims=False)
        have_BF = jax.lax.dynamic_slice_in_dim(text_BX, i, span, axis=1)
        same_BFS = have_BF[:, :, None] == want_S[None, None, :]
        return match_BFS & (same_BFS | (want_S == _PAD)[None, None, :])

    used_S = stop.string_lengths > 0
    start = jnp.broadcast_to(used_S, (text_BX.shape[0], span, used_S.shape[0]))
    match_BFS = jax.lax.fori_loop(0, tail_len + 1, compare, start, unroll=8)
    p_F = jnp.arange(span)
    total_B = ends_BT[:, -1]
    match_BF = jnp.any(match_BFS, axis=-1) & (p_F[None, :] < total_B[:, None])
    if first_B is not None:  # a match ending in a token before first_B does not count
        width = ends_BT.shape[1]
        before = jnp.take_along_axis(ends_BT, jnp.clip(first_B - 1, 0, width - 1)[:, None], 1)
        from_B = jnp.where(first_B <= 0, 0, jnp.where(first_B > width, span, before[:, 0]))
        match_BF = match_BF & (p_F[None, :] >= from_B[:, None])
    first_B = jnp.min(jnp.where(match_BF, p_F[None, :], span), axis=1)
    hit_B = first_B < span
    # The token that completes it: #{t : ends[t] <= first}; the row keeps the tokens up to it.
    last_B = jnp.sum(ends_BT <= first_B[:, None], axis=1)
    width = block_BT.shape[1]
    num_B = jnp.where(hit_B, last_B + 1, num_B).astype(jnp.int32)
    kept_B = jnp.where(
        hit_B,
        jnp.take_along_axis(ends_BT, jnp.minimum(last_B, width - 1)[:, None], axis=1)[:, 0],
        total_B,
    )
    tail_BW = jax.vmap(lambda text, kept: jax.lax.dynamic_slice(text, (kept,), (tail_len,)))(
        text_BX, kept_B
    )
    return num_B, hit_B, dataclasses.replace(stop, tail=tail_BW)
