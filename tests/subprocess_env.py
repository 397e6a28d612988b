"""XLA flags for the suite's subprocesses: the fake-device workers and the notebook's kernel.

They sample a handful of rows, so compiling is nearly all of their CPU time; at ``-O0`` (LLVM's
optimisation off) a decode loop measured alone compiles about 22 % faster (the law-test runs of
20,000 rows, which would run slower, stay in the pytest processes, marked ``optimized``:
tests/conftest.py). The HLO, what each program computes, is the same; a float may differ in its last
bit (FMA contraction), as it already does between a sharded program and the one-device one.
"""

FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(*flags: str) -> str:
    """``XLA_FLAGS`` for a subprocess: ``flags`` and :data:`FAST_COMPILE`."""
    return " ".join((*flags, FAST_COMPILE))
