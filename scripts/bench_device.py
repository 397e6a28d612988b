"""The one-shot accelerator benchmark at the path the device instructions name.

It runs ``benchmarks/bench_device.py`` with the same arguments (its ``--help`` says what it
measures); the benchmark suite lives in ``benchmarks/`` (benchmarks/README.md).

    python scripts/bench_device.py [--smoke] [--batches 1,8,32] [--methods ar,asps,...] ...
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

SUITE = Path(__file__).resolve().parents[1] / "benchmarks"

if __name__ == "__main__":
    sys.path.insert(0, str(SUITE))  # the suite's scripts import its harness by name
    sys.argv[0] = str(SUITE / "bench_device.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
