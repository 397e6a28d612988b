"""The argparse ``type`` of each checked flag of ``scripts/sample.py``: the text converted, or a
one-line ``expected ..., got ...`` error (argparse prints it as ``argument --flag: ...``).

Numbers the decode loop takes are bounded by what float32 holds (the loop runs in float32: 1e39
is finite here, inf there).
"""

from __future__ import annotations

import argparse
import math

from asps_jax import drafters
from asps_jax.logspace import F32_MAX
from asps_jax.trees import parse_widths


def checked(convert, valid, expected: str):
    """An argparse ``type``: ``convert`` the text, then require ``valid(value)``."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not valid(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


positive_int = checked(int, lambda v: v >= 1, "a positive integer")
num_draft_tokens = checked(
    lambda t: t if t == "auto" else int(t),
    lambda v: v == "auto" or v >= 1,
    "a positive integer or 'auto'",
)
non_negative_float = checked(
    float, lambda v: 0.0 <= v <= F32_MAX, "a finite number >= 0 (at most 3.4e38)"
)
top_p = checked(float, lambda v: 0.0 < v <= 1.0, "a top-p in (0, 1]")
seed = checked(int, lambda v: 0 <= v < 2**63, "an integer in [0, 2**63)")
non_negative_int = checked(int, lambda v: v >= 0, "an integer >= 0")
finite_float = checked(
    float, lambda v: abs(v) <= F32_MAX, "a finite number (|value| at most 3.4e38, float32)"
)
positive_float = checked(
    float,
    lambda v: 0.0 < v <= F32_MAX and v >= 1.4e-45,
    "a finite number > 0 that float32 holds (1.4e-45 to 3.4e38)",
)
unit_float = checked(float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")


def draft_stop(text: str) -> str:
    """``confidence:τ``, τ in [0, 1] (checked by the library's own parser)."""
    try:
        drafters.parse_draft_stop(text)
    except ValueError as err:
        message = str(err).replace("draft_stop must be", "expected")
        raise argparse.ArgumentTypeError(message) from None
    return text


def quantize(text: str) -> str:
    """``int8``, ``int4`` or ``int4:G`` (checked by the library's own parser)."""
    from asps_jax.models import quant

    try:
        quant.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).split(": ", 1)[1]) from None
    return text


def bias(text: str) -> tuple[int, float]:
    """``ID=BIAS`` for --logit-bias (``-inf`` bans the token)."""
    token, sep, value = text.partition("=")
    try:
        pair = (int(token), float(value))
    except ValueError:
        pair = None
    if (
        not sep
        or pair is None
        or pair[0] < 0
        or not (abs(pair[1]) <= F32_MAX or pair[1] == -math.inf)
    ):
        raise argparse.ArgumentTypeError(
            "expected ID=BIAS (a token id >= 0, a finite bias that float32 holds, |bias| at most "
            f"3.4e38, or -inf), got {text!r}"
        )
    return pair


def text(value: str) -> str:
    """``--prompt``: text that is valid Unicode (a byte that is not UTF-8 reaches ``argv`` as a
    lone surrogate, which no tokenizer takes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = value[err.start]
        what = f"byte 0x{ord(bad) - 0xDC00:02x}" if "\udc80" <= bad <= "\udcff" else repr(bad)
        raise argparse.ArgumentTypeError(
            f"expected UTF-8 text, got {what} at character {err.start}"
        ) from None
    return value


def widths(value: str) -> tuple[int, ...]:
    """``--tree 4,2,1,1``: children per node at each depth."""
    try:
        return parse_widths(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
