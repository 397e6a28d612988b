"""The one-line argument checks the host edge shares (``prepare``, the plan, the drafters)."""

from __future__ import annotations

import numpy as np


def check_int(name: str, value, minimum: int) -> int:
    """``value`` as an int (an integral float too); a one-line error naming ``name`` unless it
    is a whole number ``>= minimum`` (bools refused)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or int(value) != value
        or int(value) < minimum
    ):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
