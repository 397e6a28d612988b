"""Tokens-per-step statistics and exact expected lengths of single-draft verification.

Tokens per step (ATN, block efficiency) is the number of tokens one verification step emits:
``Verdict.num_tokens``, between 1 and n+1. The Monte Carlo helpers run on device; the exact ones
(``expected_length_sps`` / ``expected_length_asps``) are NumPy float64 on *tabular* models and serve
tests and small studies.

A tabular model of depth d over a vocabulary of V tokens is a sequence of conditional laws
``laws[i]`` of shape ``[V] * i + [V]`` for i = 0..d-1: ``laws[i][x_1, ..., x_i]`` is the law of the
next token after the prefix ``x_1..x_i``. A draft of n tokens needs a draft model of depth n and a
target model of depth n (the bonus law at depth n+1 does not change the length).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax.statistics import mean_stderr
from asps_jax.verify.api import Verdict


def emitted_lengths(verdict: Verdict) -> jax.Array:
    """Tokens emitted per step, int32 with the verdict's batch shape (``num_tokens``)."""
    return verdict.num_tokens


def mean_and_stderr(lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean of per-step lengths over all axes and its standard error ``std(ddof=1) / sqrt(N)``
    (:func:`asps_jax.statistics.mean_stderr`).

    A single sample has an undefined spread; its standard error is reported as ``inf``.
    """
    if np.size(lengths) == 0:
        raise ValueError("mean_and_stderr: lengths must hold at least one step, got none")
    mean, stderr, _ = mean_stderr(jnp.asarray(lengths))
    return mean, stderr


def tokens_per_step(verdict: Verdict) -> tuple[jax.Array, jax.Array]:
    """Mean tokens per step of a batch of verdicts and its standard error."""
    return mean_and_stderr(emitted_lengths(verdict))


def _check_laws(laws: Sequence, depth: int, name: str) -> list[np.ndarray]:
    laws = [np.asarray(law, np.float64) for law in laws]
    if len(laws) < depth:
        raise ValueError(f"{name} must hold at least {depth} conditional laws, got {len(laws)}")
    vocab = laws[0].shape[-1] if laws and laws[0].ndim else 0
    for i, law in enumerate(laws[:depth]):
        if law.shape != (vocab,) * (i + 1):
            raise ValueError(
                f"{name}[{i}] must have shape {(vocab,) * (i + 1)} (V = {vocab}), got {law.shape}"
            )
        if np.any(law < 0) or not np.allclose(law.sum(-1), 1.0, atol=1e-9):
            raise ValueError(f"{name}[{i}] must hold probability vectors on its last axis")
    return laws[:depth]


def _expected_length(
    target_laws: Sequence,
    draft_laws: Sequence,
    update: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> float:
    """``1 + sum_i E_q[w_i]`` where ``w_0 = 1`` and ``w_i = update(w_{i-1}, r_i)`` per draft."""
    draft = _check_laws(draft_laws, len(draft_laws), "draft_laws")
    n = len(draft)
    target = _check_laws(target_laws, n, "target_laws")
    if n and target[0].shape[-1] != draft[0].shape[-1]:
        raise ValueError(
            f"target_laws and draft_laws must share the vocabulary, got V = "
            f"{target[0].shape[-1]} and {draft[0].shape[-1]}"
        )
    prob = np.ones(())  # Q(x_{<=i}) over all prefixes of length i
    weight = np.ones(())  # w_i(x_{<=i})
    total = 1.0
    for i in range(n):
        q, p = draft[i], target[i]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(q > 0, p / np.where(q > 0, q, 1.0), 0.0)  # unused where q == 0
        prob = prob[..., None] * q
        weight = update(weight[..., None], ratio)
        total += float(np.sum(prob * weight))
    return total


def expected_length_sps(target_laws: Sequence, draft_laws: Sequence) -> float:
    """Exact E[L] of SpS: ``1 + sum_i E_q[prod_{k<=i} min(1, r_k)]`` (docs/algorithms.md §1)."""
    return _expected_length(target_laws, draft_laws, lambda w, r: w * np.minimum(1.0, r))


def expected_length_asps(target_laws: Sequence, draft_laws: Sequence) -> float:
    """Exact E[L] of ASpS: ``1 + sum_i E_q[a_i]``, ``a_i = min(1, a_{i-1} r_i)`` (§2.6)."""
    return _expected_length(target_laws, draft_laws, lambda a, r: np.minimum(1.0, a * r))
