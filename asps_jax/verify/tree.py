"""Sequence-level verification on token trees: TV, TV-wr and IS+BV (docs/algorithms.md §7).

Inputs are node-indexed over a static :class:`~asps_jax.trees.TokenTree` of N slots: node 0 is the
root (the last committed token), ``draft_logprobs[i]`` is the law slot i's token was drawn from
and ``target_logprobs[i]`` the target law after slot i (leaves included, for the bonus). Siblings
that carry equal tokens (drafts drawn with replacement) are merged first
(:func:`trees.merge_duplicates`): the first of them is the node. Every slot whose merged parent is v
is a *walker* of v, bringing its token (new or already tried) with its own law.

* ``"tv"`` -- traversal verification (Weng et al., arXiv 2505.12398). Every node v holds a weight
  ``w_v`` and a target vector ``P_v``; a child c drawn from Q starts at
  ``w_c = min(1, w_v P_v(x_c) / Q(x_c))``. Nodes are visited in depth-first post-order, siblings in
  first-appearance order; node X stops the walk with probability ``w_X`` and emits its root path and
  one token from ``P_X``. A rejection of X updates its parent with the law Q X was verified with:
  ``R = (w_v P_v - Q)_+``, ``S = sum R``, ``P_v <- R / S``, ``w_v <- S / (S + (1 - w_v))``, then the
  weights of v's untried subtrees are recomputed. A later sibling's law is its slot's law
  restricted to tokens not yet tried at v, renormalised (trees drawn without replacement, or
  merged independent chains).
* ``"tv_wr"`` -- the with-replacement rule for independent draws: every walker at v, in slot
  order, brings its token; a new token is verified with the walker's unrestricted law, a token
  already tried is not re-verified, and both apply the residual update with the walker's law.
* ``"is_bv"`` -- select one root-to-leaf path top-down with an importance-sampling selection rule
  (the level race, :class:`LevelRaceRule`, by default; :class:`FixedOrderRule` as an option), then
  ASpS (block verification) of that path against the *induced* conditionals of the selection
  (exact for any rule, docs/algorithms.md §3.6).

Along the all-rejected course of TV everything is deterministic, so each method is an *outcome law*
(:func:`tree_outcome`: the probability of stopping at each node and the law of the token emitted
there), then one stop draw and one token draw (exact draws, draws.py). Arithmetic follows the
input dtype (float32 from the public API, float64 in the enumeration tests); probabilities are
handled in linear space.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax import draws, trees
from asps_jax.logspace import NEG_INF
from asps_jax.verify import options as opts
from asps_jax.verify.chain import asps_outcome_logweights
from asps_jax.verify.tree_rules import FixedOrderRule, LevelRaceRule, SelectionRule
from asps_jax.verify.verdict import TreeVerdict

METHODS = ("tv", "tv_wr", "is_bv")  # the verifiers here (the registry's "tree" entries)
_OPTIONS = {"tv": opts.TREE_NONE, "tv_wr": opts.TREE_NONE, "is_bv": opts.SELECTION}

_STOP, _TOKEN, _SELECT = 0, 1, 2


def _weight(w_par, p_x, q_x):
    """``min(1, w_par p_x / q_x)``; 0 whenever ``w_par p_x = 0`` (never NaN)."""
    num = w_par * p_x
    safe_q = jnp.where(q_x > 0, q_x, 1.0)
    return jnp.where(num <= 0, 0.0, jnp.where(num >= q_x, 1.0, num / safe_q)).astype(num.dtype)


def _normalise(r, fallback):
    tot = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(tot > 0, r / jnp.where(tot > 0, tot, 1.0), fallback)


def _log(x):
    return jnp.where(x > 0, jnp.log(jnp.where(x > 0, x, 1.0)), NEG_INF)


def _events(tree: trees.TokenTree, node, valid_slot):
    """Order of the slots: depth-first post-order over the merged tree with walkers in slot order
    (a walker of v comes right after the subtrees of the walkers before it), invalid slots last.

    Key of slot i at depth d: the merged ancestors at depths 1..d-1, then i, padded with N.
    """
    n_nodes, max_depth = tree.num_nodes, tree.max_depth
    if max_depth == 0:
        return jnp.zeros((1,), jnp.int32)
    paths = jnp.asarray(tree.paths[:, 1:])  # [N, D]
    depth = jnp.asarray(tree.depth)
    level = jnp.arange(1, max_depth + 1)[None, :]
    slot = jnp.arange(n_nodes)[:, None]
    key = jnp.where(level < depth[:, None], node[jnp.maximum(paths, 0)], n_nodes)
    key = jnp.where(level == depth[:, None], slot, key)
    key = jnp.where(valid_slot[:, None], key, n_nodes + 1)
    return jnp.lexsort(tuple(key[:, j] for j in reversed(range(max_depth)))).astype(jnp.int32)


def _traversal_outcome(tree, tokens, q, p, node, parent, real, valid_slot, restrict, walk_all):
    """TV (``restrict``: later siblings' laws restricted to untried tokens) and TV-wr
    (``walk_all``: walkers bringing a tried token still apply the residual update):
    ``(stop [N], emit [N, V])`` indexed by slot (probabilities)."""
    n_nodes, vocab = q.shape
    dtype = q.dtype
    max_depth = tree.max_depth
    slots = jnp.arange(n_nodes)
    safe_parent = jnp.maximum(parent, 0)
    depth = jnp.asarray(tree.depth)
    paths = jnp.asarray(tree.paths)
    is_root = slots == 0

    # --- Step 1: the law each real slot is verified with; TV restricts it to untried tokens ---
    q_at_tok = jnp.take_along_axis(q, tokens[None, :], axis=1)  # [i, j] = q_i(x_j)
    tried_before = (
        real[:, None]
        & real[None, :]
        & (parent[:, None] == parent[None, :])
        & (slots[None, :] < slots[:, None])
        & restrict
    )
    # excluded[i, y]: y is the token of a sibling tried before i (the mass is summed over the
    # kept tokens, not as 1 - excluded mass, so that the law and its value at x_i agree in f32).
    rows = jnp.broadcast_to(slots[:, None], tried_before.shape)
    cols = jnp.broadcast_to(tokens[None, :], tried_before.shape)
    excluded = jnp.zeros((n_nodes, vocab), bool).at[rows, cols].max(tried_before)
    kept_mass = jnp.sum(jnp.where(excluded, 0.0, q), axis=1)
    qx = jnp.diagonal(q_at_tok) / jnp.where(kept_mass > 0, kept_mass, 1.0)
    qx = jnp.where(kept_mass > 0, qx, 0.0)

    # A node u lies strictly below a canonical node v iff its merged ancestor at depth(v) is v.
    anc_at = jnp.where(paths >= 0, node[jnp.maximum(paths, 0)], -1)  # [N, D+1]

    def refresh(w, P, todo):
        """Recompute ``w`` top-down on the nodes ``todo`` from their parents' current state."""
        p_x = P[safe_parent, tokens]

        def level(_, w):
            return jnp.where(todo, _weight(w[safe_parent], p_x, qx), w)

        return jax.lax.fori_loop(0, max_depth, level, w)

    w0 = refresh(jnp.ones((n_nodes,), dtype), p, real & ~is_root)

    def step(carry, e):
        w, P, visited = carry
        h = jnp.where(is_root[e], 1.0, jnp.where(real[e], w[e], 0.0)).astype(dtype)
        visited = visited.at[e].set(True)
        updates = valid_slot[e] & ~is_root[e] & (real[e] | walk_all)
        v = safe_parent[e]
        # --- the residual update of v with the law slot e was verified with ---
        law = _normalise(jnp.where(excluded[e], 0.0, q[e]), q[e])
        r = jnp.maximum(w[v] * P[v] - law, 0.0)
        s = jnp.sum(r)
        new_P = jnp.where(s > 0, r / jnp.where(s > 0, s, 1.0), P[v])
        new_w = jnp.where(s > 0, jnp.minimum(s / (s + (1.0 - w[v])), 1.0), 0.0)
        P = P.at[v].set(jnp.where(updates, new_P, P[v]))
        w = w.at[v].set(jnp.where(updates, new_w, w[v]))
        below = jnp.take(anc_at, depth[v], axis=1)
        todo = updates & real & ~visited & (depth > depth[v]) & (below == v)
        w = refresh(w, P, todo)
        return (w, P, visited), h

    order = _events(tree, node, valid_slot)
    (_, P, _), h_E = jax.lax.scan(step, (w0, p, jnp.zeros((n_nodes,), bool)), order)
    # --- Step 2: P(stop at the e-th visited slot) = h_e prod_{e' < e} (1 - h_e') ---
    log_keep = jnp.cumsum(_log(1.0 - h_E))
    log_before = jnp.concatenate([jnp.zeros((1,), dtype), log_keep[:-1]])
    stop_E = jnp.exp(_log(h_E) + log_before)
    stop = jnp.zeros((n_nodes,), dtype).at[order].set(stop_E)
    return stop, P


# --------------------------------------------------------------------------------------------
# IS+BV
# --------------------------------------------------------------------------------------------


def _is_bv_outcome(
    tree, tokens, q, p, node, parent, real, valid_slot, rule, alive, select_key, picks=None
):
    """IS+BV: ``(stop [N], emit [N, V], log_pick [])`` indexed by slot (probabilities), given the
    selection drawn with ``select_key`` (irrelevant for a deterministic rule).

    ``picks`` (int32[D], for exact enumeration) forces the walker picked at each level instead of
    drawing it; ``log_pick`` is then the log-probability of that sequence of picks (a level below
    the path's end counts only pick 0), so that summing ``exp(log_pick)`` times the law over every
    sequence marginalises a random rule exactly. Without ``picks`` it is the drawn sequence's.
    """
    n_nodes, vocab = q.shape
    dtype = q.dtype
    max_depth = tree.max_depth
    # The walkers of one node all sit at one depth: gather at most that many rows.
    max_walkers = int(np.bincount(tree.depth).max()) if max_depth else 1
    if alive == "count":
        widths = opts.uniform_widths(tree)
        size = n_nodes + 1
        pi0 = jnp.zeros((size,), dtype).at[widths[0] if widths else 0].set(1.0)
        next_width = jnp.asarray(widths[1:] + (1,), jnp.int32)
    else:
        pi0 = jnp.zeros((1,), dtype)

    def level(carry, t):
        v, going, pi = carry
        is_walker = valid_slot & (parent == v) & going
        has = jnp.any(is_walker)
        slots_W = jnp.nonzero(is_walker, size=max_walkers, fill_value=0)[0]
        alive_W = jnp.arange(max_walkers) < jnp.sum(is_walker)
        if alive == "count":
            select, law, surv = rule.counted(p[v], q[slots_W[0]], pi, tokens[slots_W], alive_W)
        else:
            select, law = rule.walkers(p[v], q[slots_W], tokens[slots_W], alive_W)
        if picks is None:
            pick = draws.draw_from_weights(jax.random.fold_in(select_key, t), select)
        else:
            pick = picks[t]
        active = going & has
        log_pick = jnp.where(active, _log(select[pick]), jnp.where(pick == 0, 0.0, NEG_INF))
        pick = jnp.where(alive_W[pick], pick, jnp.argmax(alive_W))
        if alive == "count":
            surv = surv[pick]
            idx = jnp.arange(size) * next_width[t]
            pi_next = (
                jnp.zeros_like(pi)
                .at[jnp.minimum(idx, size - 1)]
                .add(jnp.where(idx < size, surv, 0.0))
            )
            pi_next = _normalise(pi_next, pi)
        else:
            pi_next = pi
        c = node[slots_W[pick]]
        going = active
        return (jnp.where(going, c, v), going, pi_next), (jnp.where(going, c, -1), law, log_pick)

    (_, _, _), (path_D, law_DV, log_pick_D) = jax.lax.scan(
        level, (jnp.zeros((), jnp.int32), jnp.array(True), pi0), jnp.arange(max_depth)
    )
    length = jnp.sum(path_D >= 0).astype(jnp.int32)
    path_M = jnp.concatenate([jnp.zeros((1,), jnp.int32), path_D])  # root first
    p_MV = p[jnp.maximum(path_M, 0)]
    x_D = tokens[jnp.maximum(path_D, 0)]
    stop_DV, log_full = asps_outcome_logweights(x_D, _log(law_DV), _log(p_MV), length)
    stop_DV = jnp.exp(stop_DV)
    mass_D = jnp.sum(stop_DV, axis=1)
    emit_D = _normalise(stop_DV, p_MV[:max_depth])
    # Row t of the table stops at path node t (t < length); past the path, scatter nowhere.
    at_D = jnp.where(jnp.arange(max_depth) < length, path_M[:max_depth], n_nodes)
    stop = jnp.zeros((n_nodes,), dtype).at[at_D].set(mass_D, mode="drop")
    stop = stop.at[path_M[length]].add(jnp.exp(log_full))
    emit = p.at[at_D].set(emit_D, mode="drop")
    return stop, emit, jnp.sum(log_pick_D)


def _in_contract(node_tokens, draft_logprobs, valid):
    """``(tokens, valid)``: a slot whose id lies outside ``[0, V)``, or whose draft law gives its
    token probability 0, cannot have been drawn; it ends its branch (it and its subtree count as
    not drawn, as ``chain.effective_length`` ends a chain), so it is never emitted. Out-of-range
    ids become 0. The root (slot 0, not drawn: the last committed token) is always valid, so the
    path starts at it. Inside the contract nothing changes."""
    vocab = draft_logprobs.shape[1]
    in_range = (node_tokens >= 0) & (node_tokens < vocab)
    tokens = jnp.where(in_range, node_tokens, 0).astype(jnp.int32)
    lq_x = jnp.take_along_axis(draft_logprobs, tokens[:, None], axis=1)[:, 0]
    return tokens, (valid & in_range & (lq_x > NEG_INF)).at[0].set(True)


def _outcome(
    tree, node_tokens, draft_logprobs, target_logprobs, valid, method, options, select_key
):
    """``(stop, emit, node, tokens)``: the outcome law, the canonical slots and the in-contract
    tokens (:func:`_in_contract`)."""
    node_tokens, valid = _in_contract(node_tokens, draft_logprobs, valid)
    q = jnp.exp(draft_logprobs)
    p = jnp.exp(target_logprobs)
    node, parent, real = trees.merge_duplicates(tree, node_tokens, valid)
    args = (tree, node_tokens, q, p, node, parent, real, node >= 0)
    if method == "is_bv":
        stop, emit, _ = _is_bv_outcome(*args, options["rule"], options["alive"], select_key)
    else:
        stop, emit = _traversal_outcome(*args, restrict=method == "tv", walk_all=method == "tv_wr")
    return stop, emit, node, node_tokens


def tree_outcome(
    tree, node_tokens, draft_logprobs, target_logprobs, valid, method, *, select_key=None, **options
):
    """Exact outcome law of ``method`` for one drawn tree (arguments as :func:`verify_tree`).

    ``select_key`` draws the path of ``"is_bv"`` when its selection rule is random, as the default
    level race is (the law is then conditional on that draw).

    Returns:
      ``(stop [N], emit [N, V])`` in the input dtype, indexed by slot: ``stop[i]`` is the
      probability that the step emits the root path of node i and then one token drawn from
      ``emit[i]``; ``stop`` is zero off the merged tree and sums to 1.
    """
    options = check_options(tree, method, options)
    select_key = jax.random.key(0) if select_key is None else select_key
    stop, emit, _, _ = _outcome(
        tree, node_tokens, draft_logprobs, target_logprobs, valid, method, options, select_key
    )
    return stop, emit


def sample_tree(key, tree, node_tokens, draft_logprobs, target_logprobs, valid, method, **options):
    """One verification step: the outcome law (after the selection draw of ``"is_bv"``), one stop
    draw and one token draw."""
    options = check_options(tree, method, options)
    select_key = jax.random.fold_in(key, _SELECT)
    stop, emit, node, node_tokens = _outcome(
        tree, node_tokens, draft_logprobs, target_logprobs, valid, method, options, select_key
    )
    stop_node = draws.draw_from_weights(jax.random.fold_in(key, _STOP), stop)
    last = draws.draw_from_weights(jax.random.fold_in(key, _TOKEN), emit[stop_node])
    paths = jnp.asarray(tree.paths)
    depth = jnp.asarray(tree.depth)[stop_node]
    steps = jnp.arange(tree.max_depth + 1)
    path = jnp.where(steps <= depth, node[jnp.maximum(paths[stop_node], 0)], -1)
    tokens = jnp.where(steps < depth, node_tokens[jnp.maximum(jnp.roll(path, -1), 0)], -1)
    tokens = jnp.where(steps == depth, last, tokens)
    return TreeVerdict(
        tokens=tokens.astype(jnp.int32),
        num_tokens=(depth + 1).astype(jnp.int32),
        path=path.astype(jnp.int32),
    )


def check_options(tree, method: str, options) -> dict:
    """``method``'s options resolved (a one-line ``ValueError`` for an unknown tree method or an
    option it does not take), before anything is traced."""
    if method not in METHODS:
        raise ValueError(
            f"verify_tree: unknown method {method!r}; choose one of {', '.join(METHODS)}"
        )
    return _OPTIONS[method].check(method, options, tree=tree)


__all__ = ["FixedOrderRule", "LevelRaceRule", "SelectionRule", "sample_tree", "tree_outcome"]
