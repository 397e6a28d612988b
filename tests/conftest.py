"""Test-wide JAX settings: loud rank promotion, CPU only (tests never need an accelerator), one
on-disk compilation cache per test run, and a bounded number of compiled programs held at once."""

import gc
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One on-disk compilation cache per test run, never the user's. The process that imports this
# first (xdist's controller) makes it; the workers it starts and the CLI subprocesses they run
# inherit it through the environment (scripts' main() turns the cache on, in $ASPS_JAX_CACHE_DIR).
# A compiled decoding loop takes seconds, and the same one recurs across test files, workers and
# processes; the cache hands back the executable XLA compiled, so no test is weakened. Tests of
# the cache itself pass their own directory; ASPS_JAX_NO_CACHE=1 turns it off.
_RUN_CACHE_ENV = "ASPS_JAX_TEST_RUN_CACHE"
if _RUN_CACHE_ENV not in os.environ:
    os.environ[_RUN_CACHE_ENV] = tempfile.mkdtemp(prefix="asps_jax_test_cache_")
RUN_CACHE_DIR = os.environ[_RUN_CACHE_ENV]
os.environ["ASPS_JAX_CACHE_DIR"] = RUN_CACHE_DIR

import jax  # noqa: E402
import pytest  # noqa: E402

from asps_jax import compile_cache  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
if compile_cache.enable(RUN_CACHE_DIR) is not None:
    # In-process, only programs that take a while to compile are worth the round trip to disk.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):  # the process that made the directory
        shutil.rmtree(RUN_CACHE_DIR, ignore_errors=True)


# Every program XLA:CPU compiles holds a few memory mappings until JAX's caches drop it; a full
# run compiles thousands, and past the kernel's vm.max_map_count (65530 by default) the next
# compile's mmap fails and the process dies with SIGSEGV inside XLA. Between modules, once the
# count passes this bound, the caches are cleared (later modules recompile what they share).
MAX_MAPPINGS = 20_000


def _num_mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: nothing to count
        return 0


@pytest.fixture(autouse=True, scope="module")
def _bounded_compiled_programs():
    yield
    if _num_mappings() > MAX_MAPPINGS:
        jax.clear_caches()
        gc.collect()
