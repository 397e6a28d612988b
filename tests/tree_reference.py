"""Float64 NumPy reference of the sequence-level tree verifiers (docs/algorithms.md §7).

Written independently of ``asps_jax.verify.tree``: the tree is merged into Python objects, TV and
TV-wr are simulated recursively along the all-rejected course (a node's weight is set from its
parent's state when its subtree is entered), and the IS+BV induced laws are obtained by brute-force
enumeration of the walkers' tokens. ASpS on the selected path is ``tabular.ref_asps_outcome``.

A drawn tree is given as ``parents`` (list, -1 for the root, parents before children), ``tokens``,
``q`` [N, V] (the law each slot was drawn from), ``p`` [N, V] (the target after each slot) and
``valid`` [N]. Every function returns the law of the emitted string as a dict
``tuple(tokens) -> probability``.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import tabular as tab


class Node:
    def __init__(self, slot, prefix):
        self.slot = slot
        self.prefix = prefix  # tuple of tokens from the root
        self.walkers = []  # (slot, token, law) in slot order, duplicates included
        self.children = {}  # token -> Node, insertion order = first appearance


def merge(parents, tokens, valid):
    """The merged tree: siblings with equal tokens are one node (the first slot)."""
    nodes = {0: Node(0, ())}
    for i in range(1, len(parents)):
        par = parents[i]
        if not valid[i] or par not in nodes:
            continue
        v = nodes[par]
        tok = int(tokens[i])
        if tok not in v.children:
            v.children[tok] = Node(i, v.prefix + (tok,))
        nodes[i] = v.children[tok]
    return nodes


def _emit(out, node, mass, law):
    for y in range(len(law)):
        if mass * law[y] > 0:
            out[node.prefix + (y,)] += mass * law[y]


def traversal_law(parents, tokens, q, p, valid, with_replacement):
    """Traversal verification (TV) or its with-replacement rule (TV-wr)."""
    nodes = merge(parents, tokens, valid)
    walkers = defaultdict(list)
    for i in range(1, len(parents)):
        if i in nodes:
            walkers[nodes[parents[i]].slot].append((i, int(tokens[i])))
    out = defaultdict(float)
    w = {0: 1.0}
    big_p = {0: np.array(p[0], np.float64)}
    remain = [1.0]

    def update(v, law):
        r = np.maximum(w[v.slot] * big_p[v.slot] - law, 0.0)
        s = r.sum()
        if s > 0:
            big_p[v.slot] = r / s
            w[v.slot] = min(1.0, s / (s + (1.0 - w[v.slot])))
        else:
            w[v.slot] = 0.0

    def visit(v):
        tried = []
        for slot, tok in walkers[v.slot]:
            law = np.array(q[slot], np.float64)
            if tok in tried:
                if with_replacement:
                    update(v, law)
                continue
            if not with_replacement:
                law[tried] = 0.0
                law = law / law.sum()
            child = v.children[tok]
            num = w[v.slot] * big_p[v.slot][tok]
            w[child.slot] = 0.0 if num <= 0 else min(1.0, num / law[tok])
            big_p[child.slot] = np.array(p[child.slot], np.float64)
            visit(child)
            tried.append(tok)
            update(v, law)
        h = 1.0 if v.slot == 0 else w[v.slot]
        _emit(out, v, remain[0] * h, big_p[v.slot])
        remain[0] *= 1.0 - h

    visit(nodes[0])
    return dict(out)


def _rank(p_v, q_mean):
    """Tokens best first: by log p - log mean q (descending), ties by token id."""
    with np.errstate(divide="ignore"):
        key = np.where(q_mean > 0, np.log(p_v) - np.log(np.where(q_mean > 0, q_mean, 1.0)), -np.inf)
    return sorted(range(len(p_v)), key=lambda z: (-key[z], z))


def _select(order, toks):
    pos = {z: r for r, z in enumerate(order)}
    return min(toks, key=lambda z: pos[z])


def is_bv_law(parents, tokens, q, p, valid, alive="walkers"):
    """IS (fixed-order rule) + ASpS of the selected path against the induced conditionals.

    ``alive="walkers"``: laws conditioned on the walkers actually present at each node (any
    independent draws); ``"count"``: marginal over the number of alive drafts (identical drafts,
    every node at a depth with the same number of children).
    """
    nodes = merge(parents, tokens, valid)
    vocab = q.shape[1]
    walkers = defaultdict(list)
    for i in range(1, len(parents)):
        if i in nodes:
            walkers[nodes[parents[i]].slot].append(i)
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    width = {}  # children per node at each depth (the same for every node there, "count" mode)
    for i in range(len(parents)):
        width.setdefault(depth[i], sum(par == i for par in parents))
    v = nodes[0]
    path, laws = [v], []
    pi = {width[0]: 1.0}
    while walkers[v.slot]:
        ws = walkers[v.slot]
        p_v = np.asarray(p[v.slot], np.float64)
        if alive == "walkers":
            lq = [np.asarray(q[s], np.float64) for s in ws]
            order = _rank(p_v, np.mean(lq, axis=0))
            law = np.zeros(vocab)
            for combo in itertools.product(range(vocab), repeat=len(ws)):
                law[_select(order, combo)] += np.prod([lq[k][z] for k, z in enumerate(combo)])
            z = _select(order, [int(tokens[s]) for s in ws])
        else:
            q_v = np.asarray(q[ws[0]], np.float64)
            order = _rank(p_v, q_v)
            law = np.zeros(vocab)
            z = _select(order, [int(tokens[s]) for s in ws])
            surv = defaultdict(float)
            for m, pm in pi.items():
                for combo in itertools.product(range(vocab), repeat=m):
                    prob = pm * np.prod([q_v[t] for t in combo])
                    sel = _select(order, combo)
                    law[sel] += prob
                    if sel == z:
                        surv[sum(t == z for t in combo)] += prob
            total = sum(surv.values())
            pi = {j * width[len(path)]: m / total for j, m in surv.items()}
        laws.append(law)
        v = v.children[z]
        path.append(v)
    n = len(laws)
    out = defaultdict(float)
    if n == 0:
        _emit(out, path[0], 1.0, np.asarray(p[0], np.float64))
        return dict(out)
    x = np.array([[nd.prefix[-1] for nd in path[1:]]])
    q_rows = np.array([laws])
    p_rows = np.array([[np.asarray(p[nd.slot], np.float64) for nd in path]])
    table, full = tab.ref_asps_outcome(x, q_rows, p_rows, n)
    for t in range(n):
        mass = table[0, t].sum()
        if mass > 0:
            _emit(out, path[t], mass, table[0, t] / mass)
    _emit(out, path[n], full[0], p_rows[0, n])
    return dict(out)


LAWS = {
    "tv": lambda *a: traversal_law(*a, with_replacement=False),
    "tv_wr": lambda *a: traversal_law(*a, with_replacement=True),
    "is_bv": lambda *a: is_bv_law(*a, alive="walkers"),
    "is_bv_count": lambda *a: is_bv_law(*a, alive="count"),
}


# --------------------------------------------------------------------------------------------
# Enumeration of drawn trees
# --------------------------------------------------------------------------------------------


def chain_draws(target, drafts, n):
    """Every draw of K independent chains of n tokens (chain k from model ``drafts[k]``), in the
    node layout ``1 + k*n + i``: yields ``(weight, tokens [N], q [N, V], p [N, V])``."""
    num_drafts = len(drafts)
    vocab = target[0].shape[-1]
    for flat in itertools.product(range(vocab), repeat=num_drafts * n):
        x = np.array(flat).reshape(num_drafts, n)
        tokens = np.concatenate([[0], x.reshape(-1)])
        q = np.zeros((1 + num_drafts * n, vocab))
        p = np.zeros((1 + num_drafts * n, vocab))
        p[0] = target[0]
        weight = 1.0
        for k in range(num_drafts):
            for i in range(n):
                slot = 1 + k * n + i
                q[slot] = drafts[k][i][tuple(x[k, :i])]
                p[slot] = target[i + 1][tuple(x[k, : i + 1])]
                weight *= q[slot][x[k, i]]
        if weight > 0:
            yield weight, tokens, q, p


def tree_draws(target, draft, parents, replace, restricted_laws=False):
    """Every draw of a static tree from one draft model: each sibling group is drawn i.i.d.
    (``replace``) or without replacement. Yields ``(weight, tokens, q, p)``; ``q[i]`` is the draft
    law after i's parent, restricted to the tokens its earlier siblings did not take when
    ``restricted_laws`` (drawn without replacement)."""
    vocab = target[0].shape[-1]
    num = len(parents)
    prefix = [()] * num
    for flat in itertools.product(range(vocab), repeat=num - 1):
        tokens = np.concatenate([[0], flat])
        q = np.zeros((num, vocab))
        p = np.zeros((num, vocab))
        weight = 1.0
        taken = defaultdict(list)
        for i in range(num):
            if i > 0:
                par = parents[i]
                prefix[i] = prefix[par] + (int(tokens[i]),)
                law = np.array(draft[len(prefix[par])][prefix[par]])
                left = law.copy()
                if not replace:
                    left[taken[par]] = 0.0
                if left.sum() <= 0 or left[tokens[i]] <= 0:
                    weight = 0.0
                    break
                left /= left.sum()
                weight *= left[tokens[i]]
                q[i] = left if restricted_laws else law
                taken[par].append(int(tokens[i]))
            p[i] = target[len(prefix[i])][prefix[i]]
        if weight > 0:
            yield weight, tokens, q, p


def continued(law, target, length):
    """``[V**length]``: the emitted-string law continued by the target to ``length`` tokens."""
    vocab = target[0].shape[-1]
    out = np.zeros(vocab**length)
    for s, mass in law.items():
        for tail in itertools.product(range(vocab), repeat=length - len(s)):
            z = s + tail
            extra = 1.0
            for i in range(len(s), length):
                extra *= target[i][z[:i]][z[i]]
            out[tab.code(np.array([z]), vocab)[0]] += mass * extra
    return out


def mean_length(law) -> float:
    return float(sum(len(s) * m for s, m in law.items()))
