"""Sample text with exact speculative decoding (docs/api.md §4): a thin wrapper of the installed
command ``asps-jax sample`` (``python -m asps_jax``), whose flow is :mod:`asps_jax.cli.main`.

    python scripts/sample.py                                   # bundled tiny Shakespeare pair
    python scripts/sample.py --method sps --num-draft-tokens 4
    python scripts/sample.py --target llama7b --draft llama68m --prompt "Translate ..."

Exit status: 0 done; 1 a model produced NaN / inf logits; 2 a bad argument or environment; 130
interrupted (Ctrl-C, honoured from the first instruction: one that comes while the package is
being imported is handed to the command, which stops at its first boundary).
"""

from __future__ import annotations

import signal  # first: a Ctrl-C from here on is recorded
import sys

_early: list[int] = []


def _early_sigint(signum, frame) -> None:
    _early.append(signum)


if __name__ == "__main__":  # as early as possible: importing asps_jax takes a while
    try:
        if signal.getsignal(signal.SIGINT) not in (None, signal.SIG_IGN):
            signal.signal(signal.SIGINT, _early_sigint)
    except ValueError:  # signal handlers are set from the main thread only
        pass

from asps_jax.cli.main import (  # noqa: E402, F401  (the names tests reach through this file)
    _NOTICES,
    _CtrlC,
    _record_sigint,
    console,
    main,
    run,
    silence_notices,
)

if __name__ == "__main__":
    if signal.getsignal(signal.SIGINT) is _early_sigint:  # the command's own handler from here on
        signal.signal(signal.SIGINT, _record_sigint)
        _CtrlC.requested = bool(_early)
    sys.exit(main())
