"""Test-wide JAX settings: loud rank promotion, CPU only (tests never need an accelerator), no
persistent compilation cache unless a test asks for one, and a bounded number of compiled programs
held at once."""

import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# scripts' main() turns the on-disk compilation cache on; tests that call it in-process must not
# write to the user's cache (tests of the cache itself pass their own directory).
os.environ.setdefault("ASPS_JAX_NO_CACHE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

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
