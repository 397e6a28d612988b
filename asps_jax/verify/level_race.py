"""The level race: an importance-sampling selection rule whose induced law has a closed form built
from non-negative terms (docs/algorithms.md §3.10).

Khisti et al. (arXiv 2410.18234, Theorem 1) show that *any* rule that selects one of the drafts'
tokens, followed by single-draft SpS of the selected token against the exact law ``q_I`` of the
selection, is exact. The level race is such a rule, chosen so that ``q_I`` is cheap, exact, and can
be steered towards p:

* every token y has a rate ``lam_y >= 0``; a fixed grid ``0 = t_0 < t_1 < ... < t_{J-1}``,
  ``t_J = inf`` buckets an exponential clock of rate ``lam_y`` into J *levels*, level j having
  probability ``F_y(j) = exp(-lam_y t_{j-1}) - exp(-lam_y t_j)`` (computed as
  ``exp(-lam t_{j-1}) * -expm1(-lam (t_j - t_{j-1}))``: no cancellation);
* each alive draft k draws a level from the law of its own token ``x_k``; the lowest level wins and
  ties are broken uniformly at random.

For draft k at level j, with ``a_i = P(level_i = j)`` and ``b_i = P(level_i > j)`` for the other
alive drafts (unconditionally: ``a_i = sum_z q_i(z) F_z(j)``; given their tokens: ``F_{x_i}(j)``),
the chance that k wins, ties shared uniformly, is ``E[1 / (1 + #ties)] = int_0^1 prod_{i != k}
(b_i + a_i t) dt``: a polynomial of degree at most K - 1 in t, integrated exactly by Gauss-Legendre
with ``ceil(K / 2)`` nodes (positive weights, nodes in (0, 1)). Hence, for drafts with different
laws ``q_k`` as well as identical ones,

    q_I(y) = sum_k q_k(y) sum_j F_y(j) int_0^1 prod_{i != k} (b_i(j) + a_i(j) t) dt,

a sum of non-negative terms, and ``P(select k | x)`` is the same expression with the other drafts'
tokens fixed. Both are exact for *any* rates and grid; the rates only decide the efficiency
``sum_y min(p_y, q_I(y))``. They are fitted by a few multiplicative fixed-point steps
``lam <- lam * p / q_I`` from ``lam = p / mean_k q_k``, keeping the rates with the best efficiency:
they depend on (p, q, alive) only, never on the drawn tokens. With one alive draft the rule selects
it and ``q_I = q_k`` (single-draft SpS); the fit is skipped (``lax.cond``).

Nothing in the formulas needs the level laws to be bucketed clocks: ``verify_drafts(method=
"optimal")`` starts from the fitted clocks and lets each token's level law ``F_y`` be any law on the
J levels (``softmax`` of free logits), taking gradient-ascent steps on the exact efficiency through
the closed form. On the bundled pair's real laws this closes most of the remaining gap to the
optimum ``1 + min_S [p(S) - prod_k q_k(S)]`` (docs/algorithms.md §3.5).

Tokens need not have free laws of their own either: with ``table`` = B the race tabulates B + 2
level laws and each token mixes the two entries around its own ratio ``log(p / mean q)``
(``fit_race``); the fit then runs on the table's masses.

Cost per node with two or more alive drafts: O(K V) to map the tokens onto the table and back,
plus O(T J B K) for a fit of T steps on J levels (O(T J V K) with one law per token, ``table=0``);
O(K^2 J) per token tuple; gradient steps cost a small multiple of a fit step each.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LevelRace:
    """A fitted level race at one node and the exact law of its selected token.

    Token y's level law is a mixture of two tabulated laws:
    ``F_y = (1 - theta_y) table[lo_y] + theta_y table[hi_y]`` (with one law per token: ``lo = hi
    = y``, ``theta = 0``).
    """

    table: jax.Array  # [G, J]: tabulated level laws (rows sum to 1)
    lo: jax.Array  # int32[V]
    hi: jax.Array  # int32[V]
    theta: jax.Array  # [V] in [0, 1]
    q_sel: jax.Array  # [V]: q_I, the law of the selected token
    single: jax.Array  # bool[]: one alive draft (the rule is SpS: select it)

    def token_law(self, x: jax.Array) -> jax.Array:
        """``F_x [..., J]``: the level laws of tokens ``x``."""
        theta = self.theta[x][..., None]
        return (1.0 - theta) * self.table[self.lo[x]] + theta * self.table[self.hi[x]]

    @property
    def law(self) -> jax.Array:
        """``[V, J]``: F_y(j), each token's level law (materialised on request only)."""
        return self.token_law(jnp.arange(self.lo.shape[0]))


def level_grid(num_levels: int, num_drafts: int) -> np.ndarray:
    """``t_1 .. t_{J-1}`` (float64, static): geometric around the race's time scale.

    With the rates normalised so that one draft's clock has rate 1 on average (``sum q lam = 1``),
    the winning clock of m drafts rings near ``1 / m``; the grid spans six decades around it.
    """
    if num_levels < 2:
        return np.zeros((0,))
    center = 1.0 / num_drafts
    return center * np.logspace(-3.0, 3.0, num_levels - 1)


def level_laws(rates: jax.Array, grid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(F [V, J], after [V, J])``: P(level = j) and P(level > j) for each token's clock.

    Level j covers the clock times ``[t_{j-1}, t_j)`` (``t_0 = 0``, ``t_J = inf``). Every entry is
    one elementwise expression of ``lam`` and the level's two ends (no concatenation or shift of
    [V, J] arrays: XLA fuses it into a single pass).
    """
    dtype = rates.dtype
    t = grid.astype(dtype)  # [J-1]
    zero = jnp.zeros((1,), dtype)
    lower = jnp.concatenate([zero, t])  # t_{j-1}, [J]
    upper = jnp.concatenate([t, zero])  # t_j (a placeholder for the last, unbounded level)
    last = jnp.arange(lower.shape[0]) == lower.shape[0] - 1  # [J]
    gaps = upper - lower  # t_j - t_{j-1}
    lam = rates[:, None]
    start = jnp.exp(-lam * lower[None, :])  # P(level >= j)
    # The last level takes the rest: P(level >= J).
    law = jnp.where(last[None, :], start, start * -jnp.expm1(-lam * gaps[None, :]))
    after = jnp.where(last[None, :], 0.0, jnp.exp(-lam * upper[None, :])).astype(dtype)
    return law, after


def _gauss_legendre(num_drafts: int, dtype) -> tuple[jax.Array, jax.Array]:
    """Nodes and weights on [0, 1], exact for polynomials of degree <= K - 1."""
    nodes, weights = np.polynomial.legendre.leggauss(max(1, math.ceil(num_drafts / 2)))
    return jnp.asarray((nodes + 1) / 2, dtype), jnp.asarray(weights / 2, dtype)


def _win_weights(a: jax.Array, b: jax.Array, alive: jax.Array) -> jax.Array:
    """``c [K, J]``: ``int_0^1 prod_{i != k, alive} (b_i + a_i t) dt`` for a, b [K, J]."""
    num_drafts = a.shape[0]
    nodes, weights = _gauss_legendre(num_drafts, a.dtype)
    factor = b[..., None] + a[..., None] * nodes[None, None, :]  # [K, J, G], each >= 0
    factor = jnp.where(alive[:, None, None], factor, 1.0)
    others = ~jnp.eye(num_drafts, dtype=bool)  # [k, i]
    prod = jnp.prod(jnp.where(others[:, :, None, None], factor[None], 1.0), axis=1)  # [K, J, G]
    return jnp.sum(prod * weights[None, None, :], axis=-1)


def _above(num_levels: int, dtype) -> jax.Array:
    """The 0/1 matrix ``[i, j] = (i > j)``: ``law @ above`` sums each law over the levels above."""
    return jnp.asarray(np.tril(np.ones((num_levels, num_levels)), k=-1), dtype)


def _after(law: jax.Array) -> jax.Array:
    """``P(level > j)`` [..., J] from level laws [..., J] (sums of non-negative terms; a matmul,
    which XLA runs far faster than a reversed cumulative sum)."""
    return law @ _above(law.shape[-1], law.dtype)


def _draft_weights(law: jax.Array, q: jax.Array, alive: jax.Array) -> jax.Array:
    """``w [K, G]``: ``w_k(g) = sum_j F_g(j) c_k(j)``, the chance that draft k wins given that its
    token has level law ``F_g``, for level laws ``law`` [G, J] and the drafts' group masses ``q``
    [K, G] (``q_k(g)``: draft k's chance of a token of group g).

    One pass over [G, J] for the level sums: ``a = q @ law`` [K, J] is a draft's chance of level
    j, and its chance of a level above j is ``a @ above`` (the same sums of non-negative terms in
    another order), so no [G, J] array of P(level > j) is needed.
    """
    a = q @ law  # [K, J]: a draft's chance of level j
    b = a @ _above(law.shape[-1], law.dtype)  # [K, J]: of a level above j
    win = _win_weights(a, b, alive)  # [K, J]
    return win @ law.T  # [K, G]


def _selected(q: jax.Array, weights: jax.Array, alive: jax.Array) -> jax.Array:
    """``sum_k alive_k q_k w_k`` [V]: q_I from the drafts' laws and win weights, both [K, V]."""
    return jnp.sum(jnp.where(alive[:, None], q * weights, 0.0), axis=0)


def race_law_from_levels(law: jax.Array, q: jax.Array, alive: jax.Array) -> jax.Array:
    """The exact law ``q_I [V]`` of the token the race selects (a sum of non-negative terms), for
    level laws ``law`` [V, J]. With ``law`` [G, J] one law per group and ``q`` [K, G] the drafts'
    group masses it is the selected token's chance of each group."""
    return _selected(q, _draft_weights(law, q, alive), alive)


def race_law(rates: jax.Array, q: jax.Array, alive: jax.Array, grid: jax.Array) -> jax.Array:
    """``q_I [V]`` of the exponential-clock race with rates ``lam`` [V] on ``grid``."""
    return race_law_from_levels(level_laws(rates, grid)[0], q, alive)


RATIO_RANGE = 6.0  # the table's nodes span log(p / q) in [-6, 6]; the ends clip


def token_mixtures(p: jax.Array, q_mean: jax.Array, nodes: int):
    """``(lo int32[V], hi int32[V], theta [V])``: each token's place among ``nodes + 2`` tabulated
    level laws.

    Nodes 0 .. B-1 sit at equal steps of ``log(p / q_mean)`` on ``[-RATIO_RANGE, RATIO_RANGE]``; a
    token between two of them mixes their laws linearly in its log ratio (clipped at the ends).
    Node B holds the tokens with ``p = 0`` that a draft proposes, node B + 1 those no alive draft
    proposes (``q_mean = 0``; the race never selects them), each with ``theta = 0``. O(V), no sort.
    """
    proposed = q_mean > 0
    ratio = jnp.log(jnp.where(p > 0, p, 1.0)) - jnp.log(jnp.where(proposed, q_mean, 1.0))
    width = 2.0 * RATIO_RANGE / (nodes - 1)
    u = jnp.clip((ratio + RATIO_RANGE) / width, 0.0, nodes - 1.0)
    lo = jnp.clip(jnp.floor(u), 0, nodes - 2).astype(jnp.int32)
    theta = jnp.clip(u - lo, 0.0, 1.0).astype(p.dtype)
    special = jnp.where(proposed, nodes, nodes + 1).astype(jnp.int32)
    mixed = proposed & (p > 0)
    lo = jnp.where(mixed, lo, special)
    hi = jnp.where(mixed, lo + 1, special)
    return lo, hi, jnp.where(mixed, theta, 0.0)


def race_selection(race: LevelRace, x: jax.Array, alive: jax.Array) -> jax.Array:
    """``sel [K]``: P(the race selects draft k | tokens ``x`` int32[K])."""
    law = race.token_law(x)  # [K, J]
    after = _after(law)
    win = _win_weights(law, after, alive)
    sel = jnp.where(alive, jnp.sum(law * win, axis=1), 0.0)
    first = jax.nn.one_hot(jnp.argmax(alive), x.shape[0], dtype=sel.dtype)
    return jnp.where(race.single, first, sel)


def _efficiency(p, q_sel):
    return jnp.sum(jnp.minimum(p, q_sel))


def _reduced_law(law, q_g, diag, off, alive):
    """The selected token's mass on each table entry, ``sum_y wt_y(i) q_I(y)`` [G], for the
    tabulated laws ``law`` [G, J]: with ``wt_y`` each token's mixture weights, ``q_I(y) = sum_k
    q_k(y) sum_i wt_y(i) w_k(i)``, so it is ``sum_k (M_k w_k)(i)`` with the tridiagonal
    ``M_k[i, i'] = sum_y q_k(y) wt_y(i) wt_y(i')`` (``diag``, and ``off`` [K, G] for i' = i + 1)."""
    w = _draft_weights(law, q_g, alive)  # [K, G]
    zero = jnp.zeros_like(w[:, :1])
    up = jnp.concatenate([w[:, 1:], zero], axis=1)  # w_k(i + 1)
    down = jnp.concatenate([zero, (off * w)[:, :-1]], axis=1)  # off_k(i - 1) w_k(i - 1)
    return jnp.sum(jnp.where(alive[:, None], diag * w + off * up + down, 0.0), axis=0)


def _fit_masses(
    p: jax.Array, q: jax.Array, weight: jax.Array, table: int, tabulated: bool, num_laws: int
):
    """``(lo, hi, theta, p_g [G], q_g [K, G], diag [K, G], off [K, G])``: each token's place in
    the fitted laws and the masses the fit runs on (one law per token unless ``tabulated``)."""
    num_drafts, vocab = q.shape
    dtype = p.dtype
    if not tabulated:
        index = jnp.arange(vocab, dtype=jnp.int32)
        return index, index, jnp.zeros((vocab,), dtype), p, q, q, jnp.zeros_like(q)
    lo, hi, theta = token_mixtures(p, weight @ q, table)
    rest, mix = (1.0 - theta)[:, None], theta[:, None]
    q_t = q.T  # [V, K]
    at_lo = jnp.concatenate([p[:, None] * rest, q_t * rest, q_t * rest**2, q_t * rest * mix], 1)
    at_hi = jnp.concatenate([p[:, None] * mix, q_t * mix, q_t * mix**2], 1)
    lo_sums = jax.ops.segment_sum(at_lo, lo, num_laws)  # [G, 1 + 3K]
    hi_sums = jax.ops.segment_sum(at_hi, hi, num_laws)  # [G, 1 + 2K]
    k = num_drafts
    p_g = lo_sums[:, 0] + hi_sums[:, 0]
    q_g = (lo_sums[:, 1 : 1 + k] + hi_sums[:, 1 : 1 + k]).T
    diag = (lo_sums[:, 1 + k : 1 + 2 * k] + hi_sums[:, 1 + k :]).T
    off = lo_sums[:, 1 + 2 * k :].T
    return lo, hi, theta, p_g, q_g, diag, off


def _normalise(rates: jax.Array, q_mean: jax.Array) -> jax.Array:
    """``[G]``: the rates scaled so that ``sum q_mean rates = 1`` (unchanged if that sum is 0)."""
    scale = jnp.sum(q_mean * rates)
    return rates / jnp.where(scale > 0, scale, 1.0)


def _fixed_point(
    p_g: jax.Array,
    q_g: jax.Array,
    diag: jax.Array,
    off: jax.Array,
    weight: jax.Array,
    alive: jax.Array,
    grid: jax.Array,
    fit_steps: int,
    dtype,
) -> tuple[jax.Array, jax.Array]:
    """``(rates [G], value [])``: the best rates of ``fit_steps`` fixed-point steps ``lam <- lam
    p / q_I`` from ``lam = p / mean q``, and their efficiency."""
    q_mean = weight @ q_g
    proposed = q_mean > 0
    rates0 = _normalise(jnp.where(proposed, p_g / jnp.where(proposed, q_mean, 1.0), 0.0), q_mean)

    def step(_, carry):
        rates, best_rates, best_value = carry
        law = _reduced_law(level_laws(rates, grid)[0], q_g, diag, off, alive)
        value = _efficiency(p_g, law)
        better = value > best_value
        best_rates = jnp.where(better, rates, best_rates)
        best_value = jnp.where(better, value, best_value)
        ratio = jnp.where(law > 0, p_g / jnp.where(law > 0, law, 1.0), 1.0)
        return _normalise(rates * ratio, q_mean), best_rates, best_value

    init = (rates0, rates0, jnp.asarray(-1.0, dtype))
    return jax.lax.fori_loop(0, fit_steps, step, init)[1:]


def _ascend(
    law0: jax.Array,
    value0: jax.Array,
    p_g: jax.Array,
    q_g: jax.Array,
    diag: jax.Array,
    off: jax.Array,
    alive: jax.Array,
    grad_steps: int,
    step_size: float,
    dtype,
) -> jax.Array:
    """``[G, J]``: the best level laws ``softmax(L)`` of ``grad_steps`` Adam ascent steps on the
    efficiency from ``law0`` (efficiency ``value0``), the last iterate included."""
    tiny = jnp.finfo(dtype).tiny
    logits0 = jnp.log(jnp.maximum(law0, tiny))

    def objective(logits):
        law = jax.nn.softmax(logits, axis=-1)
        return _efficiency(p_g, _reduced_law(law, q_g, diag, off, alive))

    value_and_grad = jax.value_and_grad(objective)

    def step(i, carry):
        logits, m, v, best, best_logits = carry
        value, grad = value_and_grad(logits)
        better = value > best
        best = jnp.where(better, value, best)
        best_logits = jnp.where(better, logits, best_logits)
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
        t = (i + 1).astype(dtype)
        m_hat = m / (1.0 - 0.9**t)
        v_hat = v / (1.0 - 0.999**t)
        logits = logits + step_size * m_hat / (jnp.sqrt(v_hat) + tiny**0.5)
        return logits, m, v, best, best_logits

    zeros = jnp.zeros_like(logits0)
    init = (logits0, zeros, zeros, value0, logits0)
    logits, _, _, best, best_logits = jax.lax.fori_loop(0, grad_steps, step, init)
    # The last iterate has not been scored yet.
    last = objective(logits)
    return jax.nn.softmax(jnp.where(last > best, logits, best_logits), axis=-1)


def _fit_laws(
    p: jax.Array,
    q: jax.Array,
    alive: jax.Array,
    weight: jax.Array,
    grid: jax.Array,
    fit_steps: int,
    grad_steps: int,
    step_size: float,
    table: int,
    tabulated: bool,
    num_laws: int,
):
    """``(law [G, J], lo int32[V], hi int32[V], theta [V], q_sel [V])``: the fitted race at a node
    with two or more alive drafts."""
    lo, hi, theta, *reduced = _fit_masses(p, q, weight, table, tabulated, num_laws)
    rates, value = _fixed_point(*reduced, weight, alive, grid, fit_steps, p.dtype)
    law, _ = level_laws(rates, grid)
    if grad_steps:
        law = _ascend(law, value, *reduced, alive, grad_steps, step_size, p.dtype)
    # q_I per token: draft k's win weight at token y is its tabulated weights' mixture.
    w = _draft_weights(law, reduced[1], alive)  # [K, G]
    w_y = w[:, lo] if not tabulated else (1.0 - theta)[None] * w[:, lo] + theta[None] * w[:, hi]
    return law, lo, hi, theta, _selected(q, w_y, alive)


def _single_laws(q: jax.Array, alive: jax.Array, num_laws: int, num_levels: int, dtype):
    """``(law [G, J], lo int32[V], hi int32[V], theta [V], q_sel [V])``: the race at a node with
    one alive draft (uniform level laws; q_I is that draft's law)."""
    vocab = q.shape[1]
    law = jnp.full((num_laws, num_levels), 1.0 / num_levels, dtype)
    index = jnp.minimum(jnp.arange(vocab, dtype=jnp.int32), num_laws - 1)
    return law, index, index, jnp.zeros((vocab,), dtype), q[jnp.argmax(alive)]


def fit_race(
    p: jax.Array,
    q: jax.Array,
    alive: jax.Array,
    num_levels: int,
    fit_steps: int,
    grad_steps: int = 0,
    step_size: float = 0.3,
    batch_axis: str | None = None,
    table: int = 0,
) -> LevelRace:
    """Fit a level race to p at one node (the fit depends on (p, q, alive) only).

    Rates by ``fit_steps`` fixed-point steps ``lam <- lam p / q_I`` from ``lam = p / mean q``
    (the best efficiency kept). With ``grad_steps`` > 0 the level laws are then freed from the
    exponential-clock form: logits ``F = softmax(L)``, started at the fitted clocks, take
    ``grad_steps`` Adam ascent steps on the efficiency ``sum min(p, q_I)`` (its gradient through
    the closed form), again keeping the best. Any level laws are exact; the fit only decides the
    efficiency.

    With ``table`` = B >= 2 (and V >= B + 2) the fit does not give each token its own law: it fits
    B + 2 tabulated laws, B of them at equal steps of ``log(p / mean q)``, and token y's law is the
    linear mixture of the two entries around its own ratio (:func:`token_mixtures`). For identical
    drafts the best law of a token depends on its ratio alone, so little efficiency is lost; the fit
    then runs on the table's masses at O(K J B) per step, and O(K V) in all maps the tokens to it
    and back (no [V, J] array). The law stays exact: the closed form only needs each token's level
    law, and a mixture of two level laws is one.

    Args:
      p: [V] target; q: [K, V] draft laws; alive: bool[K] (at least one true).
      num_levels: J >= 1; fit_steps: T >= 1 evaluations of the law; grad_steps >= 0 (static).
      batch_axis: the name of a ``vmap`` axis this call is mapped over (e.g. the rows of a
        batch), or None. Under ``vmap`` the ``lax.cond`` that skips the fit at a node with one
        alive draft becomes a select that computes the fit for every row; with the axis named,
        the fit runs (for every row) only when some row needs it, and each row still gets its
        own result (the same as without the name).
      table: B, 0 or >= 2 (static): the number of tabulated laws (0: one law per token).
    """
    num_drafts, vocab = q.shape
    dtype = p.dtype
    grid = jnp.asarray(level_grid(num_levels, num_drafts), dtype)
    num_alive = jnp.sum(alive)
    weight = alive.astype(dtype) / jnp.maximum(num_alive, 1).astype(dtype)
    tabulated = table >= 2 and table + 2 <= vocab
    num_laws = table + 2 if tabulated else vocab

    def fit(_):
        return _fit_laws(
            p, q, alive, weight, grid, fit_steps, grad_steps, step_size, table, tabulated, num_laws
        )

    def single(_):
        return _single_laws(q, alive, num_laws, num_levels, dtype)

    need = num_alive >= 2
    if batch_axis is None:
        out = jax.lax.cond(need, fit, single, None)
    else:

        def fit_where_needed(_):
            return jax.tree.map(lambda a, b: jnp.where(need, a, b), fit(None), single(None))

        any_row = jax.lax.psum(need.astype(jnp.int32), batch_axis) > 0
        out = jax.lax.cond(any_row, fit_where_needed, single, None)
    law, lo, hi, theta, q_sel = out
    return LevelRace(table=law, lo=lo, hi=hi, theta=theta, q_sel=q_sel, single=~need)
