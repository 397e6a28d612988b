"""Run scripts/sample.py with one SIGINT delivered while a weakref finaliser runs, at a chosen
instant of its start-up: ``python sigint_in_a_finaliser.py EVENT NAME SCRIPT ARGS...`` delivers it
at the first audit event EVENT ("import" or "open") whose first argument contains NAME.

An exception raised inside a finaliser is printed as "Exception ignored" and discarded, so a
SIGINT that becomes a KeyboardInterrupt there is lost (issue 29); this makes that happen on purpose,
at an instant fixed by what the process is doing rather than by a timer. Torch is hidden, as on a
machine without it (transformers does not need it here, and importing it takes seconds).
"""

from __future__ import annotations

import runpy
import signal
import sys
import weakref


def sigint_in_a_finaliser() -> None:
    """SIGINT to this thread from inside a finaliser (``raise_signal`` runs the Python-level
    handler before it returns, so the handler runs inside the finaliser)."""

    class Buffer:
        pass

    buffer = Buffer()
    weakref.finalize(buffer, signal.raise_signal, signal.SIGINT)
    del buffer  # the last reference: the finaliser runs here


def main() -> None:
    sys.modules["torch"] = None
    event, name = sys.argv[1], sys.argv[2]
    sys.argv = sys.argv[3:]
    fired = []

    def hook(what, args):
        if not fired and what == event and args and name in str(args[0]):
            fired.append(True)
            sigint_in_a_finaliser()

    sys.addaudithook(hook)
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        if not fired:
            print(f"sigint_in_a_finaliser: no {event} event named {name!r}", file=sys.stderr)


if __name__ == "__main__":
    main()
