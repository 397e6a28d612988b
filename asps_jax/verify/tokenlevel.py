"""Token-level multi-draft selection schemes at one tree node, in outcome-law form.

At a node with target ``p`` and m alive drafts showing tokens ``x_k ~ q_k`` (independent), a scheme
emits one token Y whose conditional law given the tokens is

    pi(y | x) = sum_k slot[k] * [x_k == y] + (1 - sum_k slot[k]) * residual(y)

``slot[k]`` is the probability that draft k's token is emitted by an accept test, ``residual`` the
normalised law used when every test fails. Each scheme returns this :class:`NodeOutcome`, so the
same object drives the sampler (:func:`sample_outcome`) and the tests' exact enumeration
(:func:`outcome_law`); dead drafts (``alive[k]`` false) get ``slot[k] = 0`` and are ignored. With
a single alive draft every scheme is single-draft SpS. Arithmetic follows the input dtype (float32
from the public API, float64 in the enumeration tests). Probabilities are handled in linear space:
the schemes multiply draft laws, and float32 underflow of tiny masses only shifts mass to the
residual, whose law is recomputed from the same numbers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from asps_jax.draws import draw_from_weights
from asps_jax.verify.level_race import LevelRace, fit_race, race_selection
from asps_jax.verify.selection import RuleConfig, tournament_rules, tournament_selection


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NodeOutcome:
    slot: jax.Array  # [K]: P(emit draft k's token by an accept test | tokens)
    residual: jax.Array  # [V]: normalised law of the token emitted when every test fails
    num_fallbacks: jax.Array  # int32[]: LP solves replaced by the fixed-order rule


def _ratio_accept(num: jax.Array, den: jax.Array) -> jax.Array:
    """``min(1, num / den)`` without dividing by zero: den = 0 < num means certain acceptance,
    num = 0 never accepts (also when den = 0: a token of target probability 0 is never emitted)."""
    ratio = jnp.where(num >= den, 1.0, num / jnp.where(den > 0, den, 1.0))
    return jnp.where(num > 0, ratio, 0.0).astype(num.dtype)


def _normalise_or(r: jax.Array, fallback: jax.Array) -> jax.Array:
    """``r / sum(r)``, or ``fallback`` when r has no mass (a probability-zero event, §1)."""
    tot = jnp.sum(r)
    return jnp.where(tot > 0, r / jnp.where(tot > 0, tot, 1.0), fallback)


def specinfer(p, q, x, alive) -> NodeOutcome:
    """SpecInfer recursive rejection sampling with replacement (§3.2; arXiv 2305.09781).

    p: [V]; q: [K, V] (drafts may have different laws); x: int32[K]; alive: bool[K].
    Identical tokens are *not* deduplicated: after the first rejection of x, t(x) = 0, so the
    copies are rejected with certainty, as the exactness proof requires.
    """

    def test(carry, inputs):
        t, remain = carry
        q_k, x_k, alive_k = inputs
        acc = jnp.where(alive_k, _ratio_accept(t[x_k], q_k[x_k]), 0.0)
        t_next = _normalise_or(jnp.maximum(t - q_k, 0.0), t)
        return (jnp.where(alive_k, t_next, t), remain * (1.0 - acc)), remain * acc

    (t, _), slot = jax.lax.scan(test, (p, jnp.ones((), p.dtype)), (q, x, alive))
    return NodeOutcome(slot=slot, residual=t, num_fallbacks=jnp.zeros((), jnp.int32))


def specinfer_without_replacement(p, q, x, alive) -> NodeOutcome:
    """RRS without replacement (§3.3; Jeon et al. 2024) for distinct tokens drawn by Gumbel-top-k.

    Draft k's proposal is q_k restricted to the tokens not drawn before it, renormalised. A rejected
    token gets zero residual mass, so removing it from later proposals costs nothing. A token
    repeated from an earlier alive draft (impossible without replacement) is never accepted:
    ``verify_drafts`` refuses such concrete input, and traced input gets this rule.
    """
    vocab = p.shape[-1]

    def test(carry, inputs):
        t, remain, drawn = carry
        q_k, x_k, alive_k = inputs
        prop = jnp.where(drawn, 0.0, q_k)
        has_mass = jnp.sum(prop) > 0
        prop = _normalise_or(prop, prop)
        fresh = ~drawn[x_k]
        acc = jnp.where(alive_k & has_mass & fresh, _ratio_accept(t[x_k], prop[x_k]), 0.0)
        t_next = _normalise_or(jnp.maximum(t - prop, 0.0), t)
        use = alive_k & has_mass
        drawn = drawn | (alive_k & (jnp.arange(vocab) == x_k))
        return (jnp.where(use, t_next, t), remain * (1.0 - acc), drawn), remain * acc

    init = (p, jnp.ones((), p.dtype), jnp.zeros((vocab,), bool))
    (t, _, _), slot = jax.lax.scan(test, init, (q, x, alive))
    return NodeOutcome(slot=slot, residual=t, num_fallbacks=jnp.zeros((), jnp.int32))


def spectr_division_factor(p, q, alive, num_iters: int = 16) -> jax.Array:
    """Smallest feasible SpecTr division factor rho in [1, m] by fixed-iteration bisection (§3.4).

    With ``beta_k(rho) = sum_y min(q_k, p / rho)`` and ``w_k = prod_{j<k alive} (1 - beta_j)``, rho
    is feasible iff ``sum_k w_k <= rho``: then the accept mass ``sum_k w_k min(q_k, p / rho)`` stays
    below p. For i.i.d. drafts this is SpecTr's ``1 - (1 - beta)^m <= rho beta``; for different
    laws it is the same bound term by term. The upper end is always kept feasible (rho = m is), so
    an early stop costs efficiency only; 16 halvings leave rho within (m - 1) / 2^16 of the optimum.
    """
    m = jnp.sum(alive).astype(p.dtype)

    def feasible(rho):
        beta = jnp.sum(jnp.minimum(q, p[None] / rho), axis=-1)  # [K]
        w = jnp.cumprod(jnp.where(alive, 1.0 - beta, 1.0))
        w = jnp.concatenate([jnp.ones((1,), p.dtype), w[:-1]])
        return jnp.sum(jnp.where(alive, w, 0.0)) <= rho

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        ok = feasible(mid)
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    _, hi = jax.lax.fori_loop(0, num_iters, halve, (jnp.ones((), p.dtype), jnp.maximum(m, 1.0)))
    return hi


def spectr(p, q, x, alive) -> NodeOutcome:
    """SpecTr k-sequential selection (K-SEQ, §3.4; arXiv 2310.15141) with the smallest feasible rho.

    Draft k is accepted with probability ``min(1, p(x_k) / (rho q_k(x_k)))``; if all fail the token
    comes from ``p - sum_k w_k min(q_k, p / rho)``, whose mass is ``prod_k (1 - beta_k)``.
    """
    rho = spectr_division_factor(p, q, alive)
    capped = jnp.minimum(q, p[None] / rho)  # [K, V]
    beta = jnp.sum(capped, axis=-1)
    w = jnp.cumprod(jnp.where(alive, 1.0 - beta, 1.0))
    w = jnp.where(alive, jnp.concatenate([jnp.ones((1,), p.dtype), w[:-1]]), 0.0)
    qx = jnp.take_along_axis(q, x[:, None], axis=-1)[:, 0]
    acc = jnp.where(alive, _ratio_accept(p[x], rho * qx), 0.0)
    before = jnp.concatenate([jnp.ones((1,), p.dtype), jnp.cumprod(1.0 - acc)[:-1]])
    residual = jnp.maximum(p - jnp.sum(w[:, None] * capped, axis=0), 0.0)
    return NodeOutcome(
        slot=before * acc,
        residual=_normalise_or(residual, p),
        num_fallbacks=jnp.zeros((), jnp.int32),
    )


def importance_sampling(p, q, x, alive, cfg: RuleConfig) -> NodeOutcome:
    """Canonical decomposition (§3.6): IS selection, then SpS of the selected token against q_I.

    The selected token Z (draft k with probability ``sel[k]``) is accepted with probability
    ``min(1, p(Z) / q_I(Z))``; otherwise the token comes from ``(p - q_I)_+``.
    """
    return importance_sampling_outcome(importance_sampling_rules(p, q, alive, cfg), p, q, x, alive)


def importance_sampling_rules(p, q, alive, cfg: RuleConfig):
    """The token-independent part of :func:`importance_sampling`: the level race's fitted rates
    (:class:`LevelRace`), or the pairwise tournament's rules (the LP solves)."""
    if cfg.rule == "level_race":
        return fit_race(
            p,
            q,
            alive,
            cfg.levels,
            cfg.fit_steps,
            cfg.grad_steps,
            batch_axis=cfg.batch_axis,
            table=cfg.table,
        )
    return tournament_rules(p, q, alive, cfg)


def importance_sampling_outcome(prepared, p, q, x, alive) -> NodeOutcome:
    """The token-dependent part of :func:`importance_sampling`.

    A token is accepted only where its induced mass is positive: ``q_I(x) = 0`` (a selection whose
    law underflowed) is a rejection, never a certain acceptance.
    """
    if isinstance(prepared, LevelRace):
        sel = race_selection(prepared, x, alive)
        q_sel, fallbacks = prepared.q_sel, jnp.zeros((), jnp.int32)
    else:
        rules, rounds, q_sel, fallbacks = prepared
        sel = tournament_selection(rules, rounds, x, alive)
    acc = jnp.where(q_sel[x] > 0, _ratio_accept(p[x], q_sel[x]), 0.0)
    residual = _normalise_or(jnp.maximum(p - q_sel, 0.0), p)
    return NodeOutcome(slot=sel * acc, residual=residual, num_fallbacks=fallbacks)


def outcome_law(outcome: NodeOutcome, x: jax.Array) -> jax.Array:
    """``pi(. | x)`` [V] of a node outcome (for exact enumeration)."""
    rest = jnp.maximum(1.0 - jnp.sum(outcome.slot), 0.0)
    return (rest * outcome.residual).at[x].add(outcome.slot)


def sample_outcome(key: jax.Array, outcome: NodeOutcome, x: jax.Array) -> jax.Array:
    """Draw the emitted token: one exact draw over the K accept slots and 'all rejected', and one
    over the residual (used only when every accept test failed)."""
    key_slot, key_res = jax.random.split(key)
    rest = jnp.maximum(1.0 - jnp.sum(outcome.slot), 0.0)
    choice = draw_from_weights(key_slot, jnp.concatenate([outcome.slot, rest[None]]))
    recovered = draw_from_weights(key_res, outcome.residual)
    k = jnp.minimum(choice, x.shape[0] - 1)
    return jnp.where(choice < x.shape[0], x[k], recovered).astype(jnp.int32)


def sample_choice(key: jax.Array, outcome: NodeOutcome, x: jax.Array, alive: jax.Array):
    """The emitted token's law split without any V-sized draw: ``(choice, outside)``.

    ``choice`` in [0, K] is drawn exactly: ``k < K`` means "emit ``x_k``" (its accept slot plus,
    for the first alive draft showing that token, the residual's mass on it); ``K`` means "a
    residual token that no alive draft shows", whose law is ``outside`` [V] (the residual with the
    alive drafts' tokens removed, unnormalised), drawn by the caller. Same law as
    :func:`sample_outcome`: ``pi(y | x) = sum_k slot_k [x_k = y] + rest * residual(y)``.
    """
    num = x.shape[0]
    rest = jnp.maximum(1.0 - jnp.sum(outcome.slot), 0.0)
    earlier = jnp.tril(jnp.ones((num, num), bool), -1)  # earlier[k, j]: j < k
    repeat = jnp.any(earlier & alive[None, :] & (x[None, :] == x[:, None]), axis=-1)
    first = alive & ~repeat
    mass = outcome.slot + jnp.where(first, rest * outcome.residual[x], 0.0)
    shown = jnp.zeros(outcome.residual.shape, bool).at[x].max(alive)
    outside = jnp.where(shown, 0.0, outcome.residual)
    other = rest * jnp.sum(outside)
    choice = draw_from_weights(key, jnp.concatenate([mass, other[None]]))
    return choice, outside
