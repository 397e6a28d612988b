"""Test-wide JAX settings: loud rank promotion, CPU only (tests never need an accelerator), and no
persistent compilation cache unless a test asks for one."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# scripts' main() turns the on-disk compilation cache on; tests that call it in-process must not
# write to the user's cache (tests of the cache itself pass their own directory).
os.environ.setdefault("ASPS_JAX_NO_CACHE", "1")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
