"""Test-wide JAX settings: loud rank promotion, and CPU only (tests never need an accelerator)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
