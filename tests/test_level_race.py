"""The level race (asps_jax/verify/level_race.py, docs/algorithms.md §3.10): its selection law and
q_I against an independent NumPy enumeration of the levels, the exactness of the emitted law by
enumeration (float64) on hard nodes and along K chains, mutations that the checks catch, and the
single-alive-draft case."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from multidraft_laws import node_law
from multidraft_reference import continuation_error, random_laws, tree_law

from asps_jax.verify import level_race, tokenlevel
from asps_jax.verify.selection import RuleConfig

RACE = RuleConfig("level_race", levels=3, fit_steps=4)


def _reference_selection(law, xs, alive):
    """P(select k | x) [M, K] by enumerating every level tuple (NumPy float64, independent):
    ``law[y, j]`` is token y's level law; the lowest level wins, ties uniformly."""
    levels = law.shape[1]
    live = np.nonzero(alive)[0]
    out = np.zeros(xs.shape, np.float64)
    for row, x in enumerate(xs):
        for lv in itertools.product(range(levels), repeat=len(live)):
            mass = np.prod([law[x[k], j] for k, j in zip(live, lv)])
            winners = [k for k, j in zip(live, lv) if j == min(lv)]
            for k in winners:
                out[row, k] += mass / len(winners)
    return out


def test_level_laws_are_bucketed_exponential_clocks():
    """F_y(j) = exp(-lam t_{j-1}) - exp(-lam t_j) (t_0 = 0, t_J = inf), also for lam = 0."""
    rates = np.array([0.0, 1e-3, 0.7, 5.0, 1e4])
    grid = level_race.level_grid(6, 3)
    assert np.all(np.diff(grid) > 0) and grid[0] > 0
    with jax.enable_x64(True):
        law, after = (
            np.asarray(a) for a in level_race.level_laws(jnp.asarray(rates), jnp.asarray(grid))
        )
    bounds = np.concatenate([[0.0], grid])
    survive = np.concatenate([np.exp(-np.outer(rates, bounds)), np.zeros((5, 1))], axis=1)
    # (the reference subtracts: rtol 1e-9 covers its cancellation at small rates)
    np.testing.assert_allclose(law, survive[:, :-1] - survive[:, 1:], rtol=1e-9, atol=1e-300)
    np.testing.assert_allclose(after, survive[:, 1:], rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(law.sum(1), 1.0, atol=1e-15)
    assert np.all(law >= 0)


def _tuples(num_drafts, vocab):
    return np.array(list(itertools.product(range(vocab), repeat=num_drafts)), np.int64)


def _tuple_probs(qs, xs, alive):
    probs = np.ones(len(xs))
    for k in range(qs.shape[0]):
        probs *= qs[k][xs[:, k]] if alive[k] else xs[:, k] == 0
    return probs


def _race64(p, qs, alive, levels=3, fit_steps=4, grad_steps=0, table=0):
    with jax.enable_x64(True):
        args = (jnp.asarray(p), jnp.asarray(qs), jnp.asarray(alive))
        fit = jax.jit(level_race.fit_race, static_argnums=(3, 4, 5), static_argnames="table")
        race = fit(*args, levels, fit_steps, grad_steps, table=table)
        xs = jnp.asarray(_tuples(qs.shape[0], len(p)))
        sel = jax.jit(jax.vmap(lambda x: level_race.race_selection(race, x, args[2])))(xs)
        return jax.tree.map(np.asarray, race), np.asarray(sel)


def _hard_nodes(rng, num_drafts, vocab):
    """(name, p, qs): zeros in p and q, p = q, point masses, extreme ratios, distinct laws."""
    p = rng.dirichlet(np.ones(vocab))
    q = rng.dirichlet(np.full(vocab, 0.5))
    sparse_p = p.copy()
    sparse_p[0] = 0.0
    sparse_p /= sparse_p.sum()
    sparse_q = q.copy()
    sparse_q[1] = 0.0
    sparse_q /= sparse_q.sum()
    point = np.eye(vocab)[vocab - 1]
    extreme = np.full(vocab, 1e-12)
    extreme[0] = 1.0
    extreme /= extreme.sum()
    distinct = np.stack([rng.dirichlet(np.full(vocab, 0.7)) for _ in range(num_drafts)])
    distinct[-1] = sparse_q
    return [
        ("dense", p, np.stack([q] * num_drafts)),
        ("zeros", sparse_p, np.stack([sparse_q] * num_drafts)),
        ("p_equals_q", q, np.stack([q] * num_drafts)),
        ("point_target", point, np.stack([q] * num_drafts)),
        ("point_draft", p, np.stack([point] * num_drafts)),
        ("extreme_ratio", sparse_p, np.stack([extreme] * num_drafts)),
        ("extreme_target", extreme, np.stack([q] * num_drafts)),
        ("distinct", sparse_p, distinct),
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "num_drafts,vocab,grad_steps,table",
    [(2, 4, 0, 0), (3, 4, 5, 0), (4, 3, 0, 0), (2, 5, 0, 2), (3, 4, 5, 2), (2, 6, 0, 3)],
)
def test_selection_and_law_match_level_enumeration(num_drafts, vocab, grad_steps, table):
    """sel and q_I of the library equal the enumeration of all level tuples, for the fitted level
    laws (any level laws are exact; these are the ones the rule uses), per-token laws and
    tabulated ones (``table``: each token mixes two of table + 2 laws)."""
    rng = np.random.default_rng(num_drafts)
    for name, p, qs in _hard_nodes(rng, num_drafts, vocab):
        for alive in (np.ones(num_drafts, bool), np.arange(num_drafts) != 1):
            race, sel = _race64(p, qs, alive, grad_steps=grad_steps, table=table)
            assert race.table.shape[0] == (table + 2 if table else vocab)
            xs = _tuples(num_drafts, vocab)
            if alive.sum() >= 2:
                np.testing.assert_allclose(race.law.sum(1), 1.0, atol=1e-14)
            expected = _reference_selection(race.law, xs, alive)
            np.testing.assert_allclose(sel, expected, atol=1e-13, err_msg=name)
            probs = _tuple_probs(qs, xs, alive)
            law = np.zeros(vocab)
            for k in range(num_drafts):
                np.add.at(law, xs[:, k], probs * expected[:, k])
            np.testing.assert_allclose(race.q_sel, law, atol=1e-13, err_msg=name)
            assert np.all(race.law >= 0) and np.all(race.q_sel >= 0)


@pytest.mark.parametrize("num_drafts,vocab", [(2, 4), (3, 4), (4, 3)])
@pytest.mark.parametrize(
    "scheme", ["is_race_j3", "is_default", "is_race_j1", "is_race_table2", "optimal_table2"]
)
def test_node_law_is_exact(num_drafts, vocab, scheme):
    """sum_x Q(x) pi(. | x) == p (float64, <= 1e-10) on the hard nodes, all or some drafts alive;
    and a token with p = 0 is never emitted."""
    rng = np.random.default_rng(10 + num_drafts)
    xs = _tuples(num_drafts, vocab)
    law_fn = node_law(scheme, vocab)
    for name, p, qs in _hard_nodes(rng, num_drafts, vocab):
        for alive in (np.ones(num_drafts, bool), np.arange(num_drafts) == 2 % num_drafts):
            laws = law_fn(p, qs, xs, alive)
            probs = _tuple_probs(qs, xs, alive)
            assert np.all(laws >= 0)
            np.testing.assert_allclose(laws.sum(1), 1.0, atol=1e-12)
            err = np.max(np.abs(probs @ laws - p))
            assert err <= 1e-10, (name, alive, err)
            assert np.all(laws[probs > 0][:, p == 0] == 0), name


def test_acceptance_is_sum_min_p_qsel():
    """The root acceptance of the race is P(Y in drafts) >= sum_y min(p, q_I) (exact part)."""
    rng = np.random.default_rng(3)
    vocab, num_drafts = 4, 3
    p, q = rng.dirichlet(np.ones(vocab)), rng.dirichlet(np.ones(vocab))
    qs = np.stack([q] * num_drafts)
    race, _ = _race64(p, qs, np.ones(num_drafts, bool))
    laws = node_law("is_race_j3", vocab)(p, qs, _tuples(num_drafts, vocab), np.ones(3, bool))
    xs = _tuples(num_drafts, vocab)
    probs = _tuple_probs(qs, xs, np.ones(3, bool))
    accepted = sum(probs[r] * laws[r, list(set(xs[r].tolist()))].sum() for r in range(len(xs)))
    assert accepted >= np.minimum(p, race.q_sel).sum() - 1e-12


TREE_CONFIGS = [(2, 3, 2), (2, 4, 2), (3, 3, 2), (3, 4, 1), (4, 3, 1), (4, 3, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["is_race_j3", "is_default", "is_race_table2"])
def test_tree_enumeration(scheme):
    """Along K chains (identical and distinct drafts, sparse laws, a chain that ends early): the
    emitted string continued by the target has law p (float64)."""
    for i, (num_drafts, vocab, n) in enumerate(TREE_CONFIGS):
        rng = np.random.default_rng(40 + i)
        target = random_laws(rng, vocab, n + 1, sparse=0.25)
        first = random_laws(rng, vocab, n, alpha=0.7)
        drafts = [
            first if (i + k) % 2 else random_laws(rng, vocab, n, alpha=0.7, sparse=0.3)
            for k in range(num_drafts)
        ]
        lengths = [n] * num_drafts
        if n == 2:
            lengths[-1] = 1
        law, marginal = tree_law(node_law(scheme, vocab), target, drafts, n, lengths)
        assert abs(sum(law.values()) - 1.0) < 1e-12
        assert marginal <= 1e-10, (num_drafts, vocab, n, marginal)
        assert continuation_error(law, target, n) <= 1e-10


def _node_error(p, qs, prepared_fn):
    """max |sum_x Q(x) pi(.|x) - p| for a node whose rule comes from ``prepared_fn`` (float64)."""
    num_drafts, vocab = qs.shape
    alive = np.ones(num_drafts, bool)
    xs = _tuples(num_drafts, vocab)
    with jax.enable_x64(True):
        pj, qj, aj = jnp.asarray(p), jnp.asarray(qs), jnp.asarray(alive)
        prepared = prepared_fn(pj, qj, aj)

        def law(x):
            outcome = tokenlevel.importance_sampling_outcome(prepared, pj, qj, x, aj)
            return tokenlevel.outcome_law(outcome, x)

        laws = np.asarray(jax.vmap(law)(jnp.asarray(xs)))
    return np.max(np.abs(_tuple_probs(qs, xs, alive) @ laws - p))


@pytest.mark.slow
def test_mutations_are_caught(monkeypatch):
    """The enumeration check fails when the tie term is taken from the wrong level, or when q_I
    comes from rates of a different fit."""
    rng = np.random.default_rng(8)
    p, q = rng.dirichlet(np.ones(4)), rng.dirichlet(np.full(4, 0.5))
    qs = np.stack([q] * 3)
    fit = lambda steps: lambda pj, qj, aj: level_race.fit_race(pj, qj, aj, 3, steps)  # noqa: E731
    assert _node_error(p, qs, fit(4)) <= 1e-12

    # q_I of a one-step fit, selection by the four-step rates.
    def mixed(pj, qj, aj):
        return dataclasses.replace(fit(4)(pj, qj, aj), q_sel=fit(1)(pj, qj, aj).q_sel)

    assert _node_error(p, qs, mixed) > 1e-4
    # Ties counted against the level above: b_i = P(level_i >= j) instead of P(level_i > j).
    original = level_race._win_weights

    def wrong_level(a, b, alive):
        return original(a, a + b, alive)

    monkeypatch.setattr(level_race, "_win_weights", wrong_level)
    assert _node_error(p, qs, fit(4)) > 1e-4


def test_single_alive_draft_skips_the_fit():
    """One alive draft: the rule selects it and q_I = q_k exactly (no fit)."""
    rng = np.random.default_rng(2)
    p, q0, q1 = (rng.dirichlet(np.ones(5)) for _ in range(3))
    race, sel = _race64(p, np.stack([q0, q1]), np.array([False, True]))
    np.testing.assert_array_equal(race.q_sel, q1)
    np.testing.assert_array_equal(sel, np.tile([0.0, 1.0], (25, 1)))


@pytest.mark.slow
def test_tabulated_mixture_mutation_is_caught():
    """With tabulated laws, q_I is exact only for the mixtures the selection uses: the selection
    with every token on its lower table entry (theta = 0) is off."""
    rng = np.random.default_rng(0)
    p, q = rng.dirichlet(np.full(6, 0.5)), rng.dirichlet(np.full(6, 0.5))
    qs = np.stack([q] * 2)
    fit = lambda pj, qj, aj: level_race.fit_race(pj, qj, aj, 3, 4, table=3)  # noqa: E731
    assert _node_error(p, qs, fit) <= 1e-12
    race = fit(*(jnp.asarray(a) for a in (p, qs, np.ones(2, bool))))
    assert 0 < float(np.min(np.where(race.theta > 0, race.theta, 1))) < 1  # tokens do mix

    def lower_only(pj, qj, aj):
        race = fit(pj, qj, aj)
        return dataclasses.replace(race, theta=jnp.zeros_like(race.theta))

    assert _node_error(p, qs, lower_only) > 1e-4


@pytest.mark.slow
def test_tabulated_fit_keeps_the_efficiency():
    """On 64 random nodes (V = 512, K = 2 and 4 identical drafts, flat and peaked laws) the fit on
    64 tabulated laws reaches within 0.005 of the per-token fit's mean efficiency
    sum_y min(p, q_I), and never below the single-draft overlap sum_y min(p, q)."""
    rng = np.random.default_rng(0)
    vocab, nodes = 512, 64
    scale = np.where(np.arange(nodes) % 2, 1.0, 3.0)[:, None]
    lq = scale * rng.standard_normal((nodes, vocab))
    lp = lq + rng.standard_normal((nodes, vocab))
    p = np.exp(lp - lp.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    q = np.exp(lq - lq.max(1, keepdims=True))
    q /= q.sum(1, keepdims=True)
    for num_drafts in (2, 4):
        qs = np.repeat(q[:, None], num_drafts, 1)
        alive = np.ones((nodes, num_drafts), bool)

        def efficiency(table, qs=qs, alive=alive):
            fn = lambda p, q, a: level_race.fit_race(p, q, a, 16, 15, table=table).q_sel  # noqa: E731
            q_sel = jax.jit(jax.vmap(fn))(*(jnp.asarray(a, jnp.float32) for a in (p, qs, alive)))
            return np.minimum(p, np.asarray(q_sel, np.float64)).sum(1)

        tabulated, per_token = efficiency(64), efficiency(0)
        assert np.mean(tabulated) >= np.mean(per_token) - 0.005, (num_drafts, tabulated.mean())
        assert np.all(tabulated >= np.minimum(p, q).sum(1) - 1e-4)
