"""Pairwise importance-sampling (IS) selection rules for K drafts and their exact induced laws.

The default IS rule is the level race (level_race.py); the pairwise tournaments here are the
``rule="truncated_lp"``, ``"fixed_order"`` and ``"sir"`` options of ``verify_drafts(method="is")``.

Khisti et al., "Multi-Draft Speculative Sampling: Canonical Architectures and Theoretical Limits"
(arXiv 2410.18234), Theorem 1: any selection of one of the draft tokens followed by single-draft SpS
against the *induced* law ``q_I`` of the selected token is exact. So the rules here may be anything
-- heuristic, solver-proposed, or a fallback -- as long as ``q_I`` is computed exactly for the rule
actually applied. That is what this module guarantees (docs/algorithms.md §3.6, §3.8).

Pairwise rules (two drafts with laws ``qa``, ``qb``) rank tokens by :func:`ranking_key`,
``p / mean(qa, qb)``. The top ``s`` tokens (the *block*, at most the truncated alphabet of ``M``
tokens; one ``top_k``) rank above all others, in key order, and pairs inside the block follow a
weight matrix ``W[r, r']`` = P(keep the first draft's token | the second shows another token). Every
other pair keeps the token of the higher *level*: the block, then 256 buckets of the log-ratio;
two tokens of one bucket split the pair 1/2. That is O(V) (segment sums, no V-sized sort, which
costs ~40 ms per call on a CPU at V = 50272) and ranks the whole vocabulary, which matters: with a
flat law the top 40 tokens may hold a third of the mass, and an arbitrary order on the rest (e.g. by
token id) brought the acceptance back down to single-draft SpS. Rules:

* ``"fixed_order"``: no block (s = 1);
* ``"truncated_lp"``: W maximises ``sum_block min(p, q_I)`` (lp.py); if the solver's certified gap
  exceeds ``tol`` the fixed-order weights are used instead and the event is counted;
* ``"sir"``: self-normalised weights ``w_r / (w_r + w_r')``, ``w = p / ((qa + qb) / 2)``, s = M.

Every induced law is a sum of non-negative terms: the block's pair part is
``sum_j A[i, j] W[i, j] + sum_j A[j, i] (1 - W[j, i])`` (lp.selection_mass), never the cancelling
``base + (G W)`` form, so a token that always loses keeps exactly its own mass (possibly 0).

K > 2 drafts: a tournament (§3.8.5). The winner so far (law ``q_W``) meets the next alive draft; the
pairwise rule for ``(q_W, q_k)`` picks one and ``q_W <- q_I``. The winner is independent of the next
draft, so ``q_W`` stays exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from asps_jax.verify.lp import selection_mass, solve_pairwise_lp

RULES = ("level_race", "truncated_lp", "fixed_order", "sir")
PAIRWISE_RULES = ("truncated_lp", "fixed_order", "sir")


@dataclasses.dataclass(frozen=True)
class RuleConfig:
    """Static description of a selection rule (hashable: it shapes the traced computation).

    ``"level_race"`` (level_race.py) uses ``levels``, ``fit_steps`` and ``table`` only; the
    pairwise rules use the other fields.
    """

    rule: str = "truncated_lp"
    block: int = 5  # s: size of the weighted block (1 = fixed order everywhere)
    alphabet: int = 40  # M: the truncated alphabet (bounds the block; the block for sir/optimal)
    lp_iters: int = 300
    tol: float = 1e-5
    levels: int = 16  # J: levels of the level race
    fit_steps: int = 15  # T: fixed-point evaluations of the level race's law
    table: int = 128  # B: level laws tabulated on log(p / q) (0: one law per token)
    grad_steps: int = 0  # then gradient steps on free level laws ("optimal")
    batch_axis: str | None = None  # a vmap axis over rows: the race fits only where a row needs it


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PairwiseRule:
    """A concrete pairwise rule: the ranking and the block weights actually used."""

    level: jax.Array  # int32[V]: higher level wins; equal levels (same bucket) split 1/2
    weights: jax.Array  # [s, s]: W[r, r'] = P(keep first | first at r, second at r')


def _rev_exclusive_cumsum(x: jax.Array) -> jax.Array:
    """``out[i] = sum_{j > i} x[j]`` along the last axis (shifted, not ``inclusive - x``, so that
    tail masses carry no cancellation error and are never negative)."""
    inclusive = jnp.flip(jnp.cumsum(jnp.flip(x, -1), -1), -1)
    return jnp.concatenate([inclusive[1:], jnp.zeros((1,), x.dtype)])


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    """``out[i] = sum_{j < i} x[j]`` (shifted, so that every entry is a sum of non-negatives)."""
    return jnp.concatenate([jnp.zeros((1,), x.dtype), jnp.cumsum(x)[:-1]])


def ranking_key(p: jax.Array, qa: jax.Array, qb: jax.Array) -> jax.Array:
    """Tokens are ranked by ``log p - log((qa + qb) / 2)``, descending.

    The target's need relative to the drafts: for identical drafts the optimal acceptance is
    attained on a prefix of this order (docs/algorithms.md §3.5), and keeping the higher-ranked
    token fills exactly the tokens the drafts under-propose. (The ``p - qa qb`` key of §3.8 orders
    the many small tokens of a flat law by p alone; on an OPT-size vocabulary that left the
    fixed-order rule at single-draft SpS acceptance.) Tokens neither draft proposes rank last
    (no NaN).
    """
    q_mean = (qa + qb) / 2
    ratio = jnp.log(p) - jnp.log(jnp.where(q_mean > 0, q_mean, 1.0))
    return jnp.where(q_mean > 0, ratio, -jnp.inf)


NUM_BUCKETS = 256
KEY_RANGE = 20.0  # buckets span log-ratios in [-20, 20] (ratio steps of about 1.17); ends clip


def build_pairwise(
    p: jax.Array, qa: jax.Array, qb: jax.Array, cfg: RuleConfig
) -> tuple[PairwiseRule, jax.Array, jax.Array]:
    """Pairwise rule for first draft ~ ``qa``, second ~ ``qb`` and its exact induced law.

    Args:
      p, qa, qb: [V] probabilities (target, first and second draft).
      cfg: the static rule configuration.

    Returns:
      ``(rule, q_I [V], fell_back bool[])``.
    """
    s = cfg.block
    dtype = p.dtype
    key = ranking_key(p, qa, qb)
    _, block_ids = jax.lax.top_k(key, s)  # [s], best first
    in_block = jnp.zeros(key.shape, bool).at[block_ids].set(True)
    # --- Outside the block: buckets of the key (O(V), no sort); within a bucket pairs split 1/2 ---
    width = 2 * KEY_RANGE / NUM_BUCKETS
    bucket = jnp.clip(jnp.floor((key + KEY_RANGE) / width), 0, NUM_BUCKETS - 1).astype(jnp.int32)
    qa_rest = jnp.where(in_block, 0.0, qa)
    qb_rest = jnp.where(in_block, 0.0, qb)
    mass_a = jax.ops.segment_sum(qa_rest, bucket, NUM_BUCKETS)  # [buckets]
    mass_b = jax.ops.segment_sum(qb_rest, bucket, NUM_BUCKETS)
    lower_a = _exclusive_cumsum(mass_a)  # mass in strictly lower buckets
    lower_b = _exclusive_cumsum(mass_b)
    # [V], T_a for rest tokens: a bucket's mass without the token itself (clipped at 0: rounding)
    below_a = lower_a[bucket] + 0.5 * jnp.maximum(mass_a[bucket] - qa_rest, 0.0)
    below_b = lower_b[bucket] + 0.5 * jnp.maximum(mass_b[bucket] - qb_rest, 0.0)
    law = qa * qb + qa * below_b + below_a * qb
    # --- Block: ranked above every other token; pairs inside it follow W ---
    qa_s, qb_s, p_s = qa[block_ids], qb[block_ids], p[block_ids]
    rest_a, rest_b = jnp.sum(qa_rest), jnp.sum(qb_rest)
    coupling = jnp.outer(qa_s, qb_s) * (1.0 - jnp.eye(s, dtype=dtype))  # A [s, s]
    base = qa_s * qb_s + qa_s * rest_b + rest_a * qb_s + jnp.sum(coupling, 0)
    fixed = jnp.triu(jnp.ones((s, s), dtype), 1)  # higher-ranked (smaller position) keeps
    fell_back = jnp.array(False)
    if cfg.rule == "truncated_lp" and s > 1:
        sol = solve_pairwise_lp(p_s, base, coupling, fixed, num_iters=cfg.lp_iters, tol=cfg.tol)
        weights = jnp.where(sol.converged, jnp.clip(sol.weights, 0.0, 1.0), fixed)
        fell_back = ~sol.converged
    elif cfg.rule == "sir":
        # A tiny floor keeps w finite (p <= 1) where both drafts give the token zero mass.
        w = p_s / ((qa_s + qb_s) / 2 + jnp.asarray(1e-30, dtype))
        tot = w[:, None] + w[None, :]
        weights = jnp.where(tot > 0, w[:, None] / jnp.where(tot > 0, tot, 1.0), 0.5)
    else:
        weights = fixed
    # The block law from non-negative terms only (never ``base + selection_load``, whose terms
    # cancel: a token that always loses could get q_I <= 0 and then be accepted where p = 0).
    own = qa_s * qb_s + qa_s * rest_b + rest_a * qb_s
    law = law.at[block_ids].set(own + selection_mass(weights, coupling))
    # Levels: block position r -> NUM_BUCKETS + s - r (above every bucket), others their bucket.
    level = (
        jnp.where(in_block, 0, bucket)
        .at[block_ids]
        .set(NUM_BUCKETS + s - jnp.arange(s, dtype=jnp.int32))
    )
    return PairwiseRule(level=level, weights=weights), law, fell_back


def keep_first(rule: PairwiseRule, a: jax.Array, b: jax.Array) -> jax.Array:
    """P(the rule keeps the first draft's token ``a`` when the second shows ``b``)."""
    s = rule.weights.shape[0]
    la, lb = rule.level[a], rule.level[b]
    in_block = (la >= NUM_BUCKETS) & (lb >= NUM_BUCKETS)
    ra = jnp.clip(NUM_BUCKETS + s - la, 0, s - 1)
    rb = jnp.clip(NUM_BUCKETS + s - lb, 0, s - 1)
    one = jnp.ones((), rule.weights.dtype)
    order = jnp.where(la > lb, one, jnp.where(la < lb, 0.0, 0.5)).astype(one.dtype)
    return jnp.where(a == b, one, jnp.where(in_block, rule.weights[ra, rb], order))


def tournament_rules(
    p: jax.Array, q: jax.Array, alive: jax.Array, cfg: RuleConfig
) -> tuple[PairwiseRule, jax.Array, jax.Array, jax.Array]:
    """The rules of an IS tournament over the alive drafts and the exact law of its winner.

    The rules depend on the laws and the alive set only, never on the tokens, so they are built
    once per node (and once for all token tuples in an enumeration).

    Args:
      p: [V] target probabilities; q: [K, V] draft probabilities; alive: bool[K], one or more true.
      cfg: pairwise rule configuration.

    Returns:
      ``(rules, rounds, q_sel, num_fallbacks)``: ``rules`` stacked over the K-1 rounds, ``rounds``
      int32[K-1] the draft met in each round, ``q_sel`` [V] the law of the selected token.
    """
    num_drafts = q.shape[0]
    first = jnp.argmax(alive)
    # Visit the other drafts cyclically after the first alive one: the order depends only on the
    # alive set, never on the tokens, which is all the tournament's exactness needs.
    rounds = (first + jnp.arange(1, num_drafts)) % num_drafts  # [K-1]

    def play(carry, k):
        q_win, fallbacks = carry
        rule, q_new, fell_back = build_pairwise(p, q_win, q[k], cfg)
        carry = (
            jnp.where(alive[k], q_new, q_win),
            fallbacks + (alive[k] & fell_back).astype(jnp.int32),
        )
        return carry, rule

    (q_sel, fallbacks), rules = jax.lax.scan(play, (q[first], jnp.zeros((), jnp.int32)), rounds)
    return rules, rounds, q_sel, fallbacks


def tournament_selection(
    rules: PairwiseRule, rounds: jax.Array, x: jax.Array, alive: jax.Array
) -> jax.Array:
    """``sel [K]``: P(the tournament selects draft k's token | tokens ``x`` int32[K])."""
    num_drafts = x.shape[0]
    dtype = rules.weights.dtype
    sel0 = jax.nn.one_hot(jnp.argmax(alive), num_drafts, dtype=dtype)

    def play(sel, inputs):
        rule, k = inputs
        keep = jax.vmap(lambda xj: keep_first(rule, xj, x[k]))(x)  # [K]
        moved = jnp.sum(sel * (1.0 - keep))
        played = sel * keep + moved * jax.nn.one_hot(k, num_drafts, dtype=dtype)
        return jnp.where(alive[k], played, sel), None

    sel, _ = jax.lax.scan(play, sel0, (rules, rounds))
    return sel
