"""Tabular multi-draft models and exact enumeration of a tree verifier (NumPy float64).

A model of depth d over V tokens is a list ``laws`` with ``laws[i]`` of shape ``[V] * i + [V]``: the
law of token i+1 after the prefix ``x_1..x_i``. :func:`tree_law` applies a token-level scheme along
K independent chains exactly as docs/algorithms.md §3.1 states (written here independently of
``asps_jax.verify.multi``), enumerating every draft configuration with its probability; the only
thing it takes from the library is the scheme's conditional law ``pi(y | x)`` at one node.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np


def random_laws(rng, vocab: int, depth: int, alpha: float = 1.0, sparse: float = 0.0):
    """Dirichlet(alpha) laws; with ``sparse`` > 0 that fraction of entries is zeroed (>= 1 kept)."""
    laws = []
    for i in range(depth):
        law = rng.dirichlet(np.full(vocab, alpha), size=(vocab,) * i)
        if sparse > 0:
            drop = rng.random(law.shape) < sparse
            keep = np.argmax(law, axis=-1)
            drop &= np.arange(vocab) != keep[..., None]
            law = np.where(drop, 0.0, law)
            law /= law.sum(-1, keepdims=True)
        laws.append(law)
    return laws


def string_prob(laws, z) -> float:
    prob = 1.0
    for i, tok in enumerate(z):
        prob *= laws[i][tuple(z[:i])][tok]
    return prob


def asps_tail(target, draft, prefix, length: int, table_draft=None):
    """Exact law of the strings ASpS emits on a chain drawn fresh from ``draft`` after ``prefix``
    with ``length`` tokens left: dict suffix -> probability (the NumPy reference table of
    tests/tabular.py, enumerating every draft suffix). ``table_draft`` (default ``draft``) is the
    law the verifier is told; a different one is a deliberate mutation for the tests."""
    table_draft = draft if table_draft is None else table_draft
    from tabular import ref_asps_outcome

    vocab = target[0].shape[-1]
    depth = len(prefix)
    suffixes = np.array(list(itertools.product(range(vocab), repeat=length)), np.int64)
    suffixes = suffixes.reshape(len(suffixes), length)
    q_rows = np.zeros((len(suffixes), length, vocab))
    p_rows = np.zeros((len(suffixes), length + 1, vocab))
    weight = np.ones(len(suffixes))
    for row, s in enumerate(suffixes):
        for i in range(length + 1):
            at = prefix + tuple(s[:i].tolist())
            p_rows[row, i] = target[depth + i][at]
            if i < length:
                q_rows[row, i] = table_draft[depth + i][at]
                weight[row] *= draft[depth + i][at][s[i]]
    stop, full = ref_asps_outcome(suffixes, q_rows, p_rows, length)
    out = defaultdict(float)
    for row, s in enumerate(suffixes):
        if weight[row] == 0.0:
            continue
        s = tuple(s.tolist())
        for t in range(length):
            for y in np.nonzero(stop[row, t])[0]:
                out[s[:t] + (int(y),)] += weight[row] * stop[row, t, y]
        for z in np.nonzero(p_rows[row, length])[0]:
            out[s + (int(z),)] += weight[row] * full[row] * p_rows[row, length, z]
    return out


def tree_law(
    node_law,
    target,
    drafts,
    n: int,
    lengths=None,
    root_weights=None,
    root_law=None,
    tail: bool = False,
):
    """Exact law of the emitted string of one verification step.

    Args:
      node_law: ``fn(p[V], q[K, V], x[M, K], alive[K]) -> [M, V]``, the scheme's law of the
        emitted token for each of M token tuples.
      target: target laws of depth n+1; drafts: K draft models of depth n.
      lengths: per-chain draft lengths (default n).
      root_weights: optional ``fn(x[M, K]) -> [M]`` replacing the root's independent draft law
        (drafts without replacement); root_law: the scheme used at the root (default node_law).
      tail: once exactly one chain is alive, verify the rest of it with ASpS (:func:`asps_tail`)
        instead of node by node (docs/algorithms.md §3.10, "ASpS tail").

    Returns:
      ``(law, marginal_error)``: dict emitted string -> probability, and the largest deviation of a
      node's marginal ``sum_x Q(x) pi(. | x)`` from p over all visited nodes.
    """
    num_drafts = len(drafts)
    vocab = target[0].shape[-1]
    lengths = [n] * num_drafts if lengths is None else list(lengths)
    tuples = np.array(list(itertools.product(range(vocab), repeat=num_drafts)), np.int64)
    out = defaultdict(float)
    worst = [0.0]

    def visit(prefix, matched, weight):
        depth = len(prefix)
        alive = [k for k in matched if lengths[k] > depth]
        p = target[depth][prefix]
        if not alive:  # the matched chains ended: bonus token from the target
            for z in range(vocab):
                out[prefix + (z,)] += weight * p[z]
            return
        if tail and len(alive) == 1:
            k = alive[0]
            for suffix, mass in asps_tail(target, drafts[k], prefix, lengths[k] - depth).items():
                out[prefix + suffix] += weight * mass
            return
        q = np.stack([drafts[k][depth][prefix] for k in range(num_drafts)])
        mask = np.isin(np.arange(num_drafts), alive)
        if depth == 0 and root_weights is not None:
            probs = root_weights(tuples)
        else:
            probs = np.ones(len(tuples))
            for k in range(num_drafts):
                probs *= q[k][tuples[:, k]] if mask[k] else (tuples[:, k] == 0)
        scheme = root_law if depth == 0 and root_law is not None else node_law
        laws = np.asarray(scheme(p, q, tuples, mask), np.float64)
        worst[0] = max(worst[0], float(np.max(np.abs(probs @ laws - p))))
        children = defaultdict(float)
        for row in np.nonzero(probs > 0)[0]:
            for y in range(vocab):
                mass = probs[row] * laws[row, y]
                if mass == 0.0:
                    continue
                survivors = tuple(k for k in alive if tuples[row, k] == y)
                if survivors:
                    children[(y, survivors)] += mass
                else:
                    out[prefix + (y,)] += weight * mass
        for (y, survivors), mass in children.items():
            visit(prefix + (y,), survivors, weight * mass)

    visit((), tuple(range(num_drafts)), 1.0)
    return dict(out), worst[0]


def continuation_error(law, target, n: int) -> float:
    """max_z |P(emitted string continued by the target = z) - p(z)| over strings z of length n+1."""
    vocab = target[0].shape[-1]
    worst = 0.0
    for z in itertools.product(range(vocab), repeat=n + 1):
        total = 0.0
        for length in range(1, n + 2):
            mass = law.get(z[:length], 0.0)
            if mass:
                for i in range(length, n + 1):
                    mass *= target[i][z[:i]][z[i]]
                total += mass
        worst = max(worst, abs(total - string_prob(target, z)))
    return worst


def mean_length(law) -> float:
    return float(sum(len(s) * m for s, m in law.items()))


def without_replacement_weights(q_root, num_drafts):
    """``fn(x[M, K]) -> [M]``: probability of each ordered tuple drawn without replacement."""

    def weights(tuples):
        out = np.ones(len(tuples))
        for row, x in enumerate(tuples):
            if len(set(x.tolist())) < num_drafts:
                out[row] = 0.0
                continue
            left = 1.0
            for tok in x:
                out[row] *= q_root[tok] / left if left > 0 else 0.0
                left -= q_root[tok]
        return out

    return weights


def pairwise_lp_optimum(target, base, coupling) -> float:
    """scipy HiGHS optimum of ``max sum_i min(p_i, c_i + (G W)_i)`` over W in [0, 1] (lp.py)."""
    from scipy.optimize import linprog

    s = len(target)
    num = s * s + s
    cost = np.zeros(num)
    cost[s * s :] = -1.0
    a_ub = np.zeros((s, num))
    for i in range(s):
        a_ub[i, s * s + i] = 1.0
        for j in range(s):
            a_ub[i, i * s + j] -= coupling[i, j]
            a_ub[j, i * s + j] += coupling[i, j]
    bounds = [(0.0, 1.0)] * (s * s) + [(0.0, float(t)) for t in target]
    res = linprog(cost, A_ub=a_ub, b_ub=base, bounds=bounds, method="highs")
    assert res.status == 0, res.message
    return -res.fun


def ot_lp_optimum(target, drafts) -> float:
    """Optimal token-level acceptance by the transport LP of docs/algorithms.md §3.5 (scipy HiGHS).

    Variables u(x, y) >= 0 for x in V^K, y in V; rows sum to prod_k q_k(x_k), columns to p(y)
    (one redundant column constraint dropped); maximise the mass on y in set(x).
    """
    from scipy.optimize import linprog

    vocab = len(target)
    tuples = list(itertools.product(range(vocab), repeat=len(drafts)))
    num = len(tuples) * vocab
    cost = np.zeros(num)
    a_eq = np.zeros((len(tuples) + vocab - 1, num))
    b_eq = np.zeros(len(tuples) + vocab - 1)
    for r, x in enumerate(tuples):
        a_eq[r, r * vocab : (r + 1) * vocab] = 1.0
        b_eq[r] = np.prod([drafts[k][x[k]] for k in range(len(drafts))])
        for y in set(x):
            cost[r * vocab + y] = -1.0
    for y in range(vocab - 1):
        a_eq[len(tuples) + y, y::vocab] = 1.0
        b_eq[len(tuples) + y] = target[y]
    res = linprog(cost, A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs")
    assert res.status == 0, res.message
    return -res.fun


def brute_force_acceptance(target, drafts) -> float:
    """``1 + min_S [p(S) - prod_k q_k(S)]`` over all subsets S."""
    vocab = len(target)
    best = 0.0
    for bits in itertools.product([False, True], repeat=vocab):
        s = np.array(bits)
        best = min(best, target[s].sum() - np.prod([q[s].sum() for q in drafts]))
    return 1.0 + best
