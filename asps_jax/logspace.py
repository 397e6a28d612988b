"""Log-space helpers shared by every verifier.

All of them return ``-inf`` (never NaN) when both operands are ``-inf``: log-probabilities of
impossible tokens are ``-inf`` by design (top-k / top-p, sparse laws) and must flow through.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf
F32_MAX = float(jnp.finfo(jnp.float32).max)  # past it, float32 (what the device uses) is inf


def log_minus_exp(a: jax.Array, b: jax.Array) -> jax.Array:
    """``log((exp(a) - exp(b))_+)`` elementwise: ``-inf`` wherever ``a <= b`` (incl. both ``-inf``).

    Both branches are evaluated on safe inputs so that no NaN is produced even where the result
    is discarded (``jnp.where`` evaluates both sides).
    """
    a = jnp.asarray(a)
    b = jnp.asarray(b)
    positive = a > b
    # In the discarded branch use a = 0, b = -inf so that expm1(-inf) = -1 and log(1) = 0.
    a_safe = jnp.where(positive, a, 0.0)
    b_safe = jnp.where(positive, b, NEG_INF)
    out = a_safe + jnp.log(-jnp.expm1(b_safe - a_safe))
    return jnp.where(positive, out, NEG_INF)


def log_normalize(logits: jax.Array, axis: int = -1) -> jax.Array:
    """Log-softmax that maps an all ``-inf`` row to all ``-inf`` (not NaN)."""
    m = jnp.max(logits, axis=axis, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    shifted = logits - m_safe
    lse = jnp.log(jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True))
    return jnp.where(jnp.isfinite(m), shifted - lse, NEG_INF)
