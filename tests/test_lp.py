"""The fixed-iteration pairwise selection LP (asps_jax/verify/lp.py) against scipy's HiGHS."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from multidraft_reference import pairwise_lp_optimum

from asps_jax.verify.lp import selection_mass, solve_pairwise_lp
from asps_jax.verify.selection import RuleConfig, build_pairwise, keep_first


def _instances(rng, count, block, extra=3):
    """Block LPs of the truncated-LP rule for random K = 2 nodes (identical or not)."""
    out = []
    for i in range(count):
        vocab = block + extra
        p = rng.dirichlet(np.full(vocab, 0.7))
        qa = rng.dirichlet(np.full(vocab, 0.7))
        qb = qa if i % 2 else rng.dirichlet(np.full(vocab, 0.7))
        a = np.outer(qa[:block], qb[:block])
        np.fill_diagonal(a, 0.0)
        below_a, below_b = qa[block:].sum(), qb[block:].sum()
        base = qa[:block] * qb[:block] + qa[:block] * below_b + below_a * qb[:block] + a.sum(0)
        out.append((p[:block], base, a))
    return [np.stack(x) for x in zip(*out)]


@pytest.mark.parametrize("block", [3, 5, 8])
def test_pdhg_matches_highs(block):
    rng = np.random.default_rng(block)
    target, base, coupling = _instances(rng, 40, block)
    optimum = np.array([pairwise_lp_optimum(*args) for args in zip(target, base, coupling)])
    fixed = np.broadcast_to(np.triu(np.ones((block, block)), 1), coupling.shape)
    with jax.enable_x64(True):
        solve = jax.jit(jax.vmap(lambda t, b, a, w: solve_pairwise_lp(t, b, a, w, tol=1e-9)))
        sol = solve(*(jnp.asarray(x) for x in (target, base, coupling, fixed)))
        weights, primal, dual = (np.asarray(x) for x in (sol.weights, sol.primal, sol.dual))
        converged = np.asarray(sol.converged)
    assert np.all((weights >= 0) & (weights <= 1))
    # The dual is a certified bound and the primal the exact value of the returned weights.
    assert np.all(dual >= optimum - 1e-12)
    assert np.all(primal <= optimum + 1e-12)
    np.testing.assert_allclose(primal[converged], optimum[converged], atol=2e-9)
    assert converged.mean() >= 0.9, converged.mean()


def test_pdhg_float32_certificate():
    rng = np.random.default_rng(7)
    target, base, coupling = _instances(rng, 60, 5)
    optimum = np.array([pairwise_lp_optimum(*args) for args in zip(target, base, coupling)])
    fixed = np.broadcast_to(np.triu(np.ones((5, 5)), 1), coupling.shape)
    args = (jnp.asarray(x, jnp.float32) for x in (target, base, coupling, fixed))
    sol = jax.jit(jax.vmap(lambda t, b, a, w: solve_pairwise_lp(t, b, a, w)))(*args)
    converged = np.asarray(sol.converged)
    assert converged.mean() >= 0.9
    # Converged means certified within tol (plus float32 rounding of the objective).
    assert np.all(optimum[converged] - np.asarray(sol.primal)[converged] <= 1e-5 + 1e-6)
    assert np.all(np.asarray(sol.dual) >= optimum - 1e-5)


def test_zero_iterations_is_not_converged():
    rng = np.random.default_rng(3)
    target, base, coupling = _instances(rng, 20, 5)
    fixed = np.broadcast_to(np.triu(np.ones((5, 5)), 1), coupling.shape)
    with jax.enable_x64(True):
        args = (jnp.asarray(x) for x in (target, base, coupling, fixed))
        solve = jax.jit(jax.vmap(lambda t, b, a, w: solve_pairwise_lp(t, b, a, w, num_iters=0)))
        sol = solve(*args)
        assert not np.all(np.asarray(sol.converged))
        np.testing.assert_array_equal(np.asarray(sol.weights), fixed)


@pytest.mark.parametrize(
    "rule,block,alphabet",
    [("truncated_lp", 3, 5), ("sir", 5, 5), ("fixed_order", 1, 4), ("truncated_lp", 2, 2)],
)
def test_induced_law_matches_pair_enumeration(rule, block, alphabet):
    """q_I of build_pairwise equals sum over all token pairs of the selection the rule makes."""
    rng = np.random.default_rng(11)
    vocab = 7
    p, qa, qb = (rng.dirichlet(np.full(vocab, 0.8)) for _ in range(3))
    cfg = RuleConfig(rule=rule, block=block, alphabet=alphabet)
    with jax.enable_x64(True):
        pairs = jnp.asarray([(a, b) for a in range(vocab) for b in range(vocab)])

        @jax.jit
        def run(p, qa, qb):
            rule_, law, _ = build_pairwise(p, qa, qb, cfg)
            keep = jax.vmap(lambda ab: keep_first(rule_, ab[0], ab[1]))(pairs)
            return rule_.level, law, keep

        level, law, keep = (np.asarray(a) for a in run(*(jnp.asarray(a) for a in (p, qa, qb))))
    expected = np.zeros(vocab)
    for (a, b), k in zip(pairs.tolist(), keep):
        expected[a] += qa[a] * qb[b] * k
        expected[b] += qa[a] * qb[b] * (1 - k)
    assert np.all((keep >= 0) & (keep <= 1))
    np.testing.assert_allclose(law, expected, atol=1e-14)
    # Levels follow p / mean(qa, qb) (block on top); outside the block the higher level wins and
    # tokens of one level (a bucket of the ratio) split the pair 1/2.
    ratio = p / ((qa + qb) / 2)
    assert np.all(np.diff(level[np.argsort(-ratio)]) <= 0)
    for a in range(vocab):
        for b in range(vocab):
            if a != b and min(level[a], level[b]) < 256:
                expected = 0.5 if level[a] == level[b] else float(level[a] > level[b])
                assert keep[a * vocab + b] == expected


def test_selection_mass_has_no_cancellation():
    """The pair part of q_I from non-negative terms: a token that always loses gets exactly 0."""
    coupling = jnp.asarray([[0.0, 0.5], [0.25, 0.0]])
    weights = jnp.asarray([[0.0, 0.0], [1.0, 0.0]])  # token 0 always loses
    np.testing.assert_array_equal(np.asarray(selection_mass(weights, coupling)), [0.0, 0.75])
