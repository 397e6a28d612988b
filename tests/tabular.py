"""Tabular toy language models and exact enumeration helpers for verification tests (NumPy float64).

A model of depth d over V tokens is a list ``laws`` with ``laws[i]`` of shape ``[V] * i + [V]``:
the law of token i+1 after the prefix ``x_1..x_i`` (the layout ``asps_jax.metrics`` expects).
Strings of length m are coded in base V, most significant token first, which is NumPy's C order.

The per-draft reference outcome laws below are written independently of ``asps_jax``: linear space,
a sequential loop over positions (ASpS as the reference ``tmc_sample`` computes it, overwriting the
continuation entry), vectorised over a batch of drafts.
"""

from __future__ import annotations

import numpy as np
from scipy import stats

TARGET_STYLES = ("dense", "peaked", "sparse")
DRAFT_STYLES = ("close", "far", "sparse", "partly_equal", "independent")


def _dirichlet(rng, shape, vocab, alpha):
    return rng.dirichlet(np.full(vocab, alpha), size=shape)


def _sparsify(rng, law, frac):
    """Zero a random fraction of each law's entries (keeping at least one) and renormalise."""
    drop = rng.random(law.shape) < frac
    keep_one = np.argmax(law * ~drop + 1e-300 * rng.random(law.shape), axis=-1)
    drop = drop & (np.arange(law.shape[-1]) != keep_one[..., None])
    out = np.where(drop, 0.0, law)
    return out / out.sum(-1, keepdims=True)


def target_model(rng, vocab: int, depth: int, style: str) -> list[np.ndarray]:
    """Target laws of depth ``depth``: dense (Dirichlet(1)), peaked, or sparse with zeros."""
    laws = []
    for i in range(depth):
        shape = (vocab,) * i
        if style == "dense":
            law = _dirichlet(rng, shape, vocab, 1.0)
        elif style == "peaked":
            law = _dirichlet(rng, shape, vocab, 0.15)
            law = 0.98 * law + 0.02 / vocab  # peaked but never exactly zero
        elif style == "sparse":
            law = _sparsify(rng, _dirichlet(rng, shape, vocab, 1.0), 0.4)
        else:
            raise ValueError(f"unknown target style {style!r}")
        laws.append(law)
    return laws


def draft_model(rng, target: list[np.ndarray], depth: int, style: str) -> list[np.ndarray]:
    """Draft laws of depth ``depth`` built relative to the target laws."""
    vocab = target[0].shape[-1]
    laws = []
    for i in range(depth):
        p = target[i]
        noise = _dirichlet(rng, p.shape[:-1], vocab, 1.0)
        if style == "close":
            law = 0.8 * p + 0.2 * noise
        elif style == "far":
            # Mass where the target has little: reversed ranking, sharpened.
            law = np.exp(-6.0 * p) * noise
            law = law / law.sum(-1, keepdims=True)
        elif style == "sparse":
            law = _sparsify(rng, 0.7 * p + 0.3 * noise, 0.4)
        elif style == "partly_equal":
            equal = rng.random(p.shape[:-1] + (1,)) < 0.5
            law = np.where(equal, p, 0.6 * p + 0.4 * noise)
        elif style == "independent":
            law = noise
        elif style == "equal":
            law = p.copy()
        else:
            raise ValueError(f"unknown draft style {style!r}")
        laws.append(law)
    return laws


def all_strings(vocab: int, length: int) -> np.ndarray:
    """Every string of ``length`` tokens, ``[V**length, length]``, in code order."""
    if length == 0:
        return np.zeros((1, 0), np.int64)
    grids = np.meshgrid(*([np.arange(vocab)] * length), indexing="ij")
    return np.stack([g.reshape(-1) for g in grids], axis=-1)


def code(strings: np.ndarray, vocab: int) -> np.ndarray:
    """Base-V code of each row of ``strings`` ``[D, m]``."""
    out = np.zeros(strings.shape[0], np.int64)
    for j in range(strings.shape[1]):
        out = out * vocab + strings[:, j]
    return out


def rows_along(laws: list[np.ndarray], strings: np.ndarray, count: int) -> np.ndarray:
    """``[D, count, V]``: the law at depth i along each string, i = 0..count-1."""
    vocab = laws[0].shape[-1]
    rows = [laws[i].reshape(-1, vocab)[code(strings[:, :i], vocab)] for i in range(count)]
    return np.stack(rows, axis=1) if rows else np.zeros((strings.shape[0], 0, vocab))


def joint(laws: list[np.ndarray], length: int) -> np.ndarray:
    """Probability of every string of ``length`` tokens, flattened ``[V**length]``."""
    out = np.ones(1)
    vocab = laws[0].shape[-1]
    for i in range(length):
        out = (out[:, None] * laws[i].reshape(-1, vocab)).reshape(-1)
    return out


def emitted_law(stop_DNV, full_D, weight_D, drafts_DN, bonus_DV, draft_length: int):
    """Law of the emitted string: list ``E[l]`` over strings of length l+1, l = 0..n.

    ``stop_DNV[d, t, y]`` = P(emit x_{<t} y | draft d), ``full_D`` = P(accept the first
    ``draft_length`` tokens, then bonus from ``bonus_DV``), ``weight_D`` = Q(draft).
    """
    num, n, vocab = stop_DNV.shape
    out = [np.zeros(vocab ** (m + 1)) for m in range(n + 1)]
    for t in range(n):
        idx = code(drafts_DN[:, :t], vocab)[:, None] * vocab + np.arange(vocab)
        np.add.at(out[t], idx.reshape(-1), (weight_D[:, None] * stop_DNV[:, t]).reshape(-1))
    idx = code(drafts_DN[:, :draft_length], vocab)[:, None] * vocab + np.arange(vocab)
    full_DV = (weight_D * full_D)[:, None] * bonus_DV
    np.add.at(out[draft_length], idx.reshape(-1), full_DV.reshape(-1))
    return out


def continue_with_target(emitted: list[np.ndarray], target: list[np.ndarray]) -> np.ndarray:
    """Extend every emitted string to the longest length with the target: ``[V**(n+1)]``."""
    vocab = target[0].shape[-1]
    acc = emitted[0]
    for m in range(1, len(emitted)):
        acc = (acc[:, None] * target[m].reshape(-1, vocab)).reshape(-1) + emitted[m]
    return acc


def ref_sps_outcome(drafts_DN, q_DNV, p_DMV, draft_length: int):
    """SpS outcome law per draft (linear space): ``(stop_DNV, full_D)``."""
    num, n, vocab = q_DNV.shape
    rows = np.arange(num)
    stop = np.zeros((num, n, vocab))
    reach = np.ones(num)
    for t in range(draft_length):
        x = drafts_DN[:, t]
        qx, px = q_DNV[rows, t, x], p_DMV[rows, t, x]
        with np.errstate(divide="ignore", invalid="ignore"):
            acc = np.where(qx > 0, np.minimum(1.0, px / np.where(qx > 0, qx, 1.0)), 1.0)
        res = np.maximum(p_DMV[:, t] - q_DNV[:, t], 0.0)
        tot = res.sum(-1, keepdims=True)
        res = np.where(tot > 0, res / np.where(tot > 0, tot, 1.0), p_DMV[:, t])
        stop[:, t] = (reach * (1.0 - acc))[:, None] * res
        reach = reach * acc
    return stop, reach


def ref_asps_outcome(drafts_DN, q_DNV, p_DMV, draft_length: int):
    """ASpS outcome law per draft, the reference's sequential table (§2.2): ``(stop, full)``."""
    num, n, vocab = q_DNV.shape
    rows = np.arange(num)
    table = np.zeros((num, n, vocab))
    a = np.ones(num)
    for t in range(draft_length):
        x = drafts_DN[:, t]
        if t > 0:
            table[rows, t - 1, drafts_DN[:, t - 1]] = 0.0
        c = np.maximum(q_DNV[:, t] - a[:, None] * p_DMV[:, t], 0.0)
        big_c = c.sum(-1)
        qx = q_DNV[rows, t, x]
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(big_c > 0, c[rows, x] / np.where(big_c > 0, big_c * qx, 1.0), 1.0)
            s = np.nan_to_num(s, nan=0.0, posinf=0.0)  # only on drafts of probability zero
        table = table * s[:, None, None]
        table[:, t] = s[:, None] * np.maximum(a[:, None] * p_DMV[:, t] - q_DNV[:, t], 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(qx > 0, p_DMV[rows, t, x] / np.where(qx > 0, qx, 1.0), 1.0)
        a = np.minimum(1.0, a * ratio)
        table[rows, t, x] = a
    full = np.ones(num)
    if draft_length > 0:
        last = drafts_DN[:, draft_length - 1]
        full = table[rows, draft_length - 1, last].copy()
        table[rows, draft_length - 1, last] = 0.0
    return table, full


REF_OUTCOME = {"sps": ref_sps_outcome, "asps": ref_asps_outcome}


def draft_enumeration(target, draft, n: int):
    """All V**n drafts with their probability and the laws along them.

    Returns ``(drafts_DN, weight_D, q_DNV, p_DMV)`` with ``p_DMV`` ``[D, n+1, V]``.
    """
    vocab = target[0].shape[-1]
    drafts = all_strings(vocab, n)
    q_rows = rows_along(draft, drafts, n)
    p_rows = rows_along(target, drafts, n + 1) if n + 1 <= len(target) else None
    weight = np.prod(np.take_along_axis(q_rows, drafts[..., None], axis=-1)[..., 0], axis=-1)
    return drafts, weight, q_rows, p_rows


def exact_emitted_law(method, target, draft, n, lengths):
    """Law of the emitted string (flattened over lengths 1..n+1) from the float64 references."""
    drafts, weight, q_rows, p_rows = draft_enumeration(target, draft, n)
    total = None
    for length in lengths:
        stop, full = REF_OUTCOME[method](drafts, q_rows, p_rows, length)
        law = np.concatenate(emitted_law(stop, full, weight, drafts, p_rows[:, length], length))
        total = law if total is None else total + law
    return total / len(lengths)


def string_index(tokens, num, vocab):
    """Index of each emitted string ``tokens[b, :num[b]]`` among all strings of 1..n+1 tokens."""
    offsets = np.cumsum([0] + [vocab ** (m + 1) for m in range(tokens.shape[1])])
    codes = np.zeros(tokens.shape[0], np.int64)
    for j in range(tokens.shape[1]):
        codes = np.where(j < num, codes * vocab + tokens[:, j], codes)
    return offsets[num - 1] + codes, offsets[-1]


def chi_square_pvalue(index, size, law):
    """Chi-square p-value of observed string indices against ``law``; bins under 5 are pooled."""
    observed = np.bincount(index, minlength=size).astype(np.float64)
    expected = law * index.shape[0]
    assert observed[law == 0].sum() == 0, "emitted a string of probability zero"
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    exp = exp[keep] * obs[keep].sum() / exp[keep].sum()
    return stats.chisquare(obs[keep], exp).pvalue


def random_chain(rng, vocab, n, zeros=0.0):
    """A draft drawn from q, and float32 log-laws; ``zeros`` is the fraction of -inf entries."""

    def law(rows):
        probs = rng.dirichlet(np.ones(vocab), rows)
        probs = np.where(rng.random(probs.shape) < zeros, 0.0, probs)
        probs[np.arange(rows), rng.integers(0, vocab, rows)] += 0.1  # keep each row non-empty
        return probs / probs.sum(-1, keepdims=True)

    q, p = law(n), law(n + 1)
    x = np.array([rng.choice(vocab, p=row) for row in q], np.int32)
    with np.errstate(divide="ignore"):
        return x, np.log(q).astype(np.float32), np.log(p).astype(np.float32)
