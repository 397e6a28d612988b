"""The one-line argument checks the host edge shares (``prepare``, the plan, the drafters), and
the refusal of unknown keyword arguments (:func:`check_keywords`, :func:`known_keywords`)."""

from __future__ import annotations

import difflib
import functools
import inspect

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


class UnknownKeywordError(ValueError, TypeError):
    """A keyword argument no entry point takes (a ``ValueError`` like every bad argument here,
    and the ``TypeError`` Python raises for one)."""


def suggest(name, valid) -> str:
    """``" (did you mean 'x'?)"``: the valid name closest to ``name``, else the valid names."""
    close = difflib.get_close_matches(str(name), sorted(valid), n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f" (valid: {', '.join(sorted(valid))})"


def check_keywords(caller: str, given, valid) -> None:
    """Refuse the first keyword of ``given`` not in ``valid``: one line naming it and the closest
    valid name (:mod:`difflib`)."""
    for name in given:
        if name not in valid:
            raise UnknownKeywordError(f"{caller}: unknown option {name!r}{suggest(name, valid)}")


def known_keywords(*extra: str):
    """Decorate a public function so that an unknown keyword is refused by :func:`check_keywords`
    (naming the closest of its parameters and ``extra``, the options its ``**kwargs`` take)
    instead of Python's "unexpected keyword argument", or a message further in."""

    def decorate(fn):
        params = inspect.signature(fn).parameters.values()
        valid = frozenset((*(p.name for p in params if p.kind is not p.VAR_KEYWORD), *extra))

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            check_keywords(fn.__name__, kwargs, valid)
            return fn(*args, **kwargs)

        return checked

    return decorate
