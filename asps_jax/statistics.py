"""Decoding statistics, in one place: the per-row counters a step updates on device
(:class:`DecodeStats`, :func:`update`), their per-row summary (:func:`summarize`, what
``SampleOutput.stats`` holds) and the one mean +- standard error estimator that
``asps_jax.sample``, ``scripts/sample.py`` and the benchmarks report (:func:`mean_stderr`,
:func:`histogram_mean_stderr`).

Tokens per step (ATN, block efficiency) is the number of tokens one target call emits. Each row
keeps a histogram ``emitted_hist[b, l]`` of the steps that emitted ``l`` tokens; pooled over rows it
gives the mean tokens per step and its standard error without storing every step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeStats:
    """Per-row counters of a decoding loop, kept on device (``D`` = n, the draft length).

    Attributes:
      target_calls: int32[B], target forwards after prefill (one per step of an active row).
      emitted_hist: int32[B, D + 2], ``emitted_hist[b, l]`` = steps of row b that emitted l tokens,
        l = 0..n+1.
      decisions: int32[B], draft tokens verified (accept / reject decisions).
      accepted: int32[B], draft tokens accepted.
      fallbacks: int32[B], LP solves replaced by an exact fallback rule.
      root_steps: int32[B], steps with at least one draft token at the root.
      root_accepted: int32[B], of those, steps whose first token is one of the root draft tokens.
      root_optimal: float32[B], sum over the same steps of ``optimal_acceptance`` at the root.
      bad_logits: bool[B], the row stopped at a law with a NaN or ``+inf`` logit or no finite one.
      failed_at: int32[B], the index (among the row's new tokens) of the token that law was to
        give, i.e. the number of tokens emitted before the failure; -1 when the row did not fail.
      scored_nodes: int32[B], draft nodes the target scored, summed over steps (a tree method
        scores each node of the merged tree once: chains that share a prefix share its nodes).
    """

    target_calls: jax.Array
    emitted_hist: jax.Array
    decisions: jax.Array
    accepted: jax.Array
    fallbacks: jax.Array
    root_steps: jax.Array
    root_accepted: jax.Array
    root_optimal: jax.Array
    bad_logits: jax.Array
    failed_at: jax.Array
    scored_nodes: jax.Array

    @classmethod
    def zeros(cls, batch: int, draft_len: int) -> DecodeStats:
        zeros_B = jnp.zeros((batch,), jnp.int32)
        return cls(
            target_calls=zeros_B,
            emitted_hist=jnp.zeros((batch, draft_len + 2), jnp.int32),
            decisions=zeros_B,
            accepted=zeros_B,
            fallbacks=zeros_B,
            root_steps=zeros_B,
            root_accepted=zeros_B,
            root_optimal=jnp.zeros((batch,), jnp.float32),
            bad_logits=jnp.zeros((batch,), bool),
            failed_at=jnp.full((batch,), -1, jnp.int32),
            scored_nodes=zeros_B,
        )


def update(
    stats: DecodeStats,
    *,
    active_B: jax.Array,
    emitted_B: jax.Array,
    failed_at_B: jax.Array,
    verdict=None,
    draft_lengths_BK: jax.Array | None = None,
    root_drafts_BK: jax.Array | None = None,
    root_optimal_B: jax.Array | None = None,
    scored_nodes_B: jax.Array | None = None,
) -> DecodeStats:
    """The counters after one step.

    Args:
      active_B: bool[B], rows that ran this step (each made one target call).
      emitted_B: int32[B], tokens emitted (after EOS truncation; 0 for inactive rows).
      failed_at_B: int32[B], where the row failed this step (the token index whose law, or whose
        draft law, was not usable; see :attr:`DecodeStats.failed_at`), -1 when it did not.
      verdict: the step's ``Verdict`` (batch B); None for autoregressive decoding, which has no
        draft statistics. Its ``draft_index`` is the chain the acceptance counts follow: the
        verified chain, or for a tree method the chain that drew the accepted path.
      draft_lengths_BK: int32[B, K], the usable length of each draft chain.
      root_drafts_BK: int32[B, K], the first token of each draft chain.
      root_optimal_B: float32[B], ``optimal_acceptance`` at the root (docs/algorithms.md §3.5).
      scored_nodes_B: int32[B], draft nodes the target scored this step.
    """
    calls_B = active_B.astype(jnp.int32)
    width = stats.emitted_hist.shape[1]
    stats = dataclasses.replace(
        stats,
        target_calls=stats.target_calls + calls_B,
        emitted_hist=stats.emitted_hist
        + calls_B[:, None] * jax.nn.one_hot(emitted_B, width, dtype=jnp.int32),
        bad_logits=stats.bad_logits | (failed_at_B >= 0),
        failed_at=jnp.where(failed_at_B >= 0, failed_at_B, stats.failed_at),
    )
    if verdict is None:
        return stats
    chosen_len_B = jnp.take_along_axis(draft_lengths_BK, verdict.draft_index[:, None], axis=1)[:, 0]
    # Token-level acceptance at the root, where all K drafts are alive.
    root_live_BK = draft_lengths_BK >= 1
    root_B = calls_B * jnp.any(root_live_BK, axis=1)
    root_hit_B = jnp.any(root_live_BK & (root_drafts_BK == verdict.tokens[:, :1]), axis=1)
    return dataclasses.replace(
        stats,
        root_steps=stats.root_steps + root_B,
        root_accepted=stats.root_accepted + root_B * root_hit_B,
        root_optimal=stats.root_optimal + root_B * root_optimal_B,
        decisions=stats.decisions + calls_B * jnp.minimum(verdict.num_tokens, chosen_len_B),
        accepted=stats.accepted + calls_B * (verdict.num_tokens - 1),
        fallbacks=stats.fallbacks + calls_B * verdict.num_fallbacks,
        scored_nodes=stats.scored_nodes + calls_B * scored_nodes_B,
    )


def summarize(stats: DecodeStats, num_generated_B: jax.Array, batch: int) -> dict:
    """Per-row statistics (device arrays) of the first ``batch`` rows.

    ``target_calls``: target forwards after prefill; ``tokens_per_step``: tokens emitted per target
    call (ATN / block efficiency); ``emitted_hist[b, l]``: steps that emitted l tokens;
    ``acceptance``: accepted / verified draft tokens; ``fallbacks``: LP solves replaced by an exact
    fallback rule; ``root_acceptance``: how often the first token of a step is one of the K root
    draft tokens, beside ``root_optimal_acceptance``, the mean of ``optimal_acceptance`` over the
    same steps (the theoretical limit of any exact token-level scheme there; NaN with K >= 2 drafts
    unless the loop ran with ``diagnostics=True``); ``bad_logits`` / ``failed_at``: the row stopped
    at an unusable law, and the index of the new token it stopped at (-1 if it did not);
    ``scored_nodes_per_step``: draft nodes the target scored per call.
    """
    s = jax.tree.map(lambda a: a[:batch], stats)
    generated = num_generated_B[:batch]
    return {
        "target_calls": s.target_calls,
        "tokens_per_step": generated / jnp.maximum(s.target_calls, 1),
        "emitted_hist": s.emitted_hist,
        "acceptance": s.accepted / jnp.maximum(s.decisions, 1),
        "decisions": s.decisions,
        "accepted": s.accepted,
        "fallbacks": s.fallbacks,
        "root_steps": s.root_steps,
        "root_acceptance": s.root_accepted / jnp.maximum(s.root_steps, 1),
        "root_optimal_acceptance": s.root_optimal / jnp.maximum(s.root_steps, 1),
        "bad_logits": s.bad_logits,
        "failed_at": s.failed_at,
        "scored_nodes_per_step": s.scored_nodes / jnp.maximum(s.target_calls, 1),
    }


def mean_stderr(values, counts=None):
    """Mean of ``values`` (each seen ``counts`` times, default once) and its standard error
    ``std(ddof=1) / sqrt(N)``, with ``N`` the total count; returns ``(mean, stderr, N)``.

    NumPy inputs are reduced in float64 on the host, JAX arrays in float32 (jit-able). One sample
    has an undefined spread: its standard error is ``inf``.
    """
    on_device = isinstance(values, jax.Array) or isinstance(counts, jax.Array)
    xp, dtype = (jnp, jnp.float32) if on_device else (np, np.float64)
    x = xp.ravel(xp.asarray(values, dtype))
    c = xp.ones_like(x) if counts is None else xp.ravel(xp.asarray(counts, dtype))
    total = c.sum()
    mean = (c * x).sum() / xp.maximum(total, 1)
    var = (c * xp.square(x - mean)).sum() / xp.maximum(total - 1, 1)
    stderr = xp.where(total > 1, xp.sqrt(var / xp.maximum(total, 1)), xp.inf)
    return mean, stderr, total


def histogram_mean_stderr(hist) -> tuple[float, float, int]:
    """Tokens per step pooled over all rows of ``emitted_hist[..., l]``: (mean, stderr, steps).

    The one estimator that ``sample``'s CLI and the benchmarks report (host-side, float64).
    """
    counts_L = np.asarray(hist).reshape(-1, np.shape(hist)[-1]).sum(0)
    if counts_L.sum() == 0:
        raise ValueError("histogram_mean_stderr: the histogram counts no step")
    mean, stderr, steps = mean_stderr(np.arange(counts_L.shape[0]), counts_L)
    return float(mean), float(stderr), int(steps)


def pooled_rate(rates_B, weights_B) -> float | None:
    """``sum(rate * weight) / sum(weight)`` over rows (a per-row rate pooled by its counts), or
    None when no row has any weight."""
    weights_B = np.asarray(weights_B, np.float64)
    total = weights_B.sum()
    if total <= 0:
        return None
    return float(np.sum(np.asarray(rates_B, np.float64) * weights_B) / total)


def tokens_per_step(verdict) -> tuple[jax.Array, jax.Array]:
    """Mean tokens per step (``Verdict.num_tokens``) of a batch of verdicts and its standard
    error (:func:`mean_stderr`)."""
    if np.size(verdict.num_tokens) == 0:
        raise ValueError("tokens_per_step: the verdicts hold no step")
    mean, stderr, _ = mean_stderr(verdict.num_tokens)
    return mean, stderr


# --------------------------------------------------------------------------------------------
# Exact expected lengths of single-draft verification on tabular models (NumPy float64; tests and
# small studies). A tabular model of depth d over V tokens is a sequence of conditional laws
# ``laws[i]`` of shape ``[V] * i + [V]`` for i = 0..d-1: ``laws[i][x_1, ..., x_i]`` is the law of
# the next token after the prefix ``x_1..x_i``. A draft of n tokens needs draft and target models
# of depth n (the bonus law at depth n+1 does not change the length).


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
