"""XLA flags for the suite's subprocesses (the fake-device workers and the notebook's kernel) and,
:data:`FAST_CODEGEN`, for the pytest processes too.

They sample a handful of rows, so compiling is nearly all of their CPU time; at ``-O0`` (LLVM's
optimisation off) a decode loop measured alone compiles about 22 % faster (the law-test runs of
20,000 rows, which would run slower, stay in the pytest processes, marked ``optimized``:
tests/conftest.py). The HLO, what each program computes, is the same; a float may differ in its last
bit (FMA contraction), as it already does between a sharded program and the one-device one.

Every flag here only makes the suite faster, and XLA stops a process at start on a flag its jaxlib
does not know ("Unknown flag in XLA_FLAGS"), while ``jax`` is not pinned: :func:`supported` keeps
the flags this jaxlib accepts, so an older or newer one runs the suite slower instead of not at all.
"""

import json
import os
import subprocess
import sys

_PROBED = "ASPS_JAX_TEST_XLA_FLAGS"  # {flags asked: flags kept}, inherited by xdist's workers


def _starts(flags: str) -> bool:
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    return subprocess.run(probe, env=env, capture_output=True).returncode == 0


def supported(flags: str) -> str:
    """The flags of ``flags`` with which JAX's CPU backend starts: a child process tries them all
    (about 1 s), then each alone if that fails. Once per test run: the answer is kept in the
    environment, which xdist's workers and the tests' subprocesses inherit."""
    probed = json.loads(os.environ.get(_PROBED, "{}"))
    if flags not in probed:
        kept = flags.split() if _starts(flags) else [f for f in flags.split() if _starts(f)]
        probed[flags] = " ".join(kept)
        os.environ[_PROBED] = json.dumps(probed)
    return probed[flags]


# XLA:CPU's elemental emitter for every fusion instead of its MLIR fusion emitters (the default):
# the same HLO, compiled in less time (a float may differ in its last bit). Measured on one decode
# loop (tv, 8 rows, -O0, alone): 2.0 s of backend compile against 3.4 s; tests/test_logprobs.py
# alone took 56 CPU-seconds against 90. The pytest processes use it at every level
# (tests/conftest.py). And one LLVM module per program, not split for threads to compile in
# parallel: the suite's two processes already keep both cores busy, and the split costs CPU (the
# first call of an 8-row loop, compile and trace, alone: tv 3.90 / 4.30 / 4.01 CPU-s against 3.61
# / 3.68 / 3.40 unsplit, specinfer 4.71 / 4.76 / 4.54 against 4.43 / 4.35 / 4.04).
FAST_CODEGEN = supported(
    "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
)
FAST_COMPILE = f"--xla_backend_optimization_level=0 {FAST_CODEGEN}".strip()


def xla_flags(*flags: str) -> str:
    """``XLA_FLAGS`` for a subprocess: ``flags`` and :data:`FAST_COMPILE`."""
    return " ".join((*flags, FAST_COMPILE))
