"""Multi-draft verification: exact enumeration, statistical tests through verify_drafts, the
paper's three-letter example, optimal_acceptance, the efficiency ordering and bad input."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from multidraft_laws import SCHEMES, is_cfg, is_law_fn, node_law, root_acceptance
from multidraft_reference import (
    brute_force_acceptance,
    continuation_error,
    mean_length,
    ot_lp_optimum,
    random_laws,
    string_prob,
    tree_law,
    without_replacement_weights,
)
from scipy import stats

import asps_jax
from asps_jax import draws as draws_mod
from asps_jax.verify import api, checks, multi, registry, tokenlevel
from asps_jax.verify.acceptance import (
    identical_drafts_acceptance,
    optimal_acceptance,
    sorted_prefix_acceptance,
)


def _models(seed, num_drafts, vocab, n, identical, sparse=0.0):
    rng = np.random.default_rng(seed)
    target = random_laws(rng, vocab, n + 1, sparse=sparse)
    first = random_laws(rng, vocab, n, alpha=0.7)
    drafts = [
        first if identical else random_laws(rng, vocab, n, alpha=0.7, sparse=sparse)
        for _ in range(num_drafts)
    ]
    drafts[0] = first
    return target, drafts


CONFIGS = [
    (k, v, n, ident) for k in (2, 3) for v in (3, 4, 5) for n in (1, 2) for ident in (True, False)
]


FULL_GRID = ("specinfer", "spectr", "optimal_g20", "is_lp_s2_m3", "is_default")
ENUMERATED = FULL_GRID + (
    "is_fixed_order_m3",
    "is_sir_m3",
    "is_lp_no_iters",
    "is_race_j3",
    "pairwise_lp16",
)


@pytest.mark.slow
@pytest.mark.parametrize("name", ENUMERATED)
def test_exact_enumeration(name):
    """For every scheme: law of the emitted string continued by the target == p (float64).

    The main schemes run the whole grid; the other IS rules (same code paths, other weights) run
    the V = 5 part of it.
    """
    for i, (num_drafts, vocab, n, identical) in enumerate(CONFIGS):
        if name not in FULL_GRID and vocab != 5:
            continue
        target, drafts = _models(100 + i, num_drafts, vocab, n, identical, sparse=0.25 * (i % 2))
        lengths = [n] * num_drafts
        if n == 2 and not identical:
            lengths[-1] = 1  # a chain that ended early (EOS)
        law, marginal = tree_law(node_law(name, vocab), target, drafts, n, lengths)
        assert abs(sum(law.values()) - 1.0) < 1e-12
        assert marginal <= 1e-12, (num_drafts, vocab, n, identical, marginal)
        err = continuation_error(law, target, n)
        assert err <= 1e-12, (num_drafts, vocab, n, identical, err)


@pytest.mark.slow
def test_exact_enumeration_without_replacement():
    for i, (num_drafts, vocab, n) in enumerate(
        (k, v, n) for k in (2, 3) for v in (3, 4, 5) for n in (1, 2)
    ):
        target, drafts = _models(300 + i, num_drafts, vocab, n, identical=i % 2 == 0)
        q_root = drafts[0][0]
        for d in drafts:  # one root law, drawn without replacement; continuations independent
            d[0] = q_root
        wor, rrs = node_law("specinfer_wor", vocab), node_law("specinfer", vocab)
        law, marginal = tree_law(
            rrs,
            target,
            drafts,
            n,
            root_law=wor,
            root_weights=without_replacement_weights(q_root, num_drafts),
        )
        assert marginal <= 1e-12
        assert continuation_error(law, target, n) <= 1e-12


# --- Statistical tests through the public API, vmapped over 10^5 keys ---

STAT_K, STAT_N, STAT_V, STAT_KEYS = 3, 2, 4, 100_000
STAT_LENGTHS = np.array([2, 2, 1], np.int32)  # chain 2 ended after one token


def _stat_models(without_replacement=False):
    target, drafts = _models(7, STAT_K, STAT_V, STAT_N, identical=False)
    if without_replacement:
        for d in drafts:
            d[0] = drafts[0][0]
    return target, drafts


def _sample_drafts(key, drafts, target, without_replacement):
    """Draft chains (root draws i.i.d. or without replacement), with their laws and the target."""
    key_root, key_next = jax.random.split(key)
    q0 = jnp.log(jnp.asarray(np.stack([d[0] for d in drafts]), jnp.float32))  # [K, V]
    q1 = jnp.log(jnp.asarray(np.stack([d[1] for d in drafts]), jnp.float32))  # [K, V, V]
    if without_replacement:
        x0 = multi.sample_without_replacement(key_root, q0[0], STAT_K)
    else:
        x0 = jax.random.categorical(key_root, q0)
    lq1 = q1[jnp.arange(STAT_K), x0]  # [K, V]
    x1 = jax.random.categorical(key_next, lq1)
    p0, p1, p2 = (jnp.log(jnp.asarray(t, jnp.float32)) for t in target)
    lp = jnp.stack([jnp.broadcast_to(p0, (STAT_K, STAT_V)), p1[x0], p2[x0, x1]], axis=1)
    return jnp.stack([x0, x1], 1), jnp.stack([q0, lq1], 1), lp


@functools.cache
def _statistical_draws(method, options, without_replacement=False):
    """STAT_KEYS vmapped calls of ``method`` (``options``: sorted (name, value) pairs) in one
    jit, run once per module: test_statistical_verify_drafts and
    test_statistical_tail_emitted_law check the same run (the length and the continued law, the
    emitted law). Returns NumPy (emitted tokens, num_tokens, draft_index, draft tokens,
    num_fallbacks)."""
    options = dict(options)
    target, drafts = _stat_models(without_replacement)

    def one(key):
        key_draft, key_verify = jax.random.split(key)
        tokens, lq, lp = _sample_drafts(key_draft, drafts, target, without_replacement)
        if method in asps_jax.verify.DRAFTS_METHODS:
            verdict = asps_jax.verify_drafts(
                key_verify, tokens, lq, lp, method=method, draft_length=STAT_LENGTHS, **options
            )
        else:  # not (yet) routed by verify_drafts: call the registered verifier directly
            verdict = registry.REGISTRY[method].verifier(
                key_verify, tokens, lq, lp, jnp.asarray(STAT_LENGTHS), **options
            )
        return verdict, tokens

    keys = jax.random.split(jax.random.key(2024), STAT_KEYS)
    verdict, tokens = jax.jit(jax.vmap(one))(keys)
    arrays = (verdict.tokens, verdict.num_tokens, verdict.draft_index, tokens)
    return tuple(np.asarray(a) for a in arrays) + (np.asarray(verdict.num_fallbacks),)


@functools.cache
def _stat_tree_law(law_name):
    """The reference walker's exact law (float64 enumeration, tail="asps") of the emitted string
    on the statistical models; computed once per scheme for the tests that compare with it."""
    target, drafts = _stat_models()
    law, _ = tree_law(node_law(law_name, STAT_V), target, drafts, STAT_N, STAT_LENGTHS, tail=True)
    return law


def _run_statistical(method, options, without_replacement=False):
    target, _ = _stat_models(without_replacement)
    draws = _statistical_draws(method, tuple(sorted(options.items())), without_replacement)
    out, length, index, tokens, fallbacks = (a.copy() for a in draws)
    # Structure: 1 <= L <= length of the committed chain + 1, the prefix follows that chain.
    assert np.all((length >= 1) & (length <= STAT_LENGTHS[index] + 1))
    assert np.all(out[np.arange(STAT_N + 1) >= length[:, None]] == -1)
    for depth in range(STAT_N):
        rows = length > depth + 1
        assert np.all(out[rows, depth] == tokens[rows, index[rows], depth])
    # Continue every emitted string with the target (NumPy) and compare with p by chi-square.
    rng = np.random.default_rng(5)
    full = out.copy()
    for depth in range(STAT_N + 1):
        rows = length <= depth
        laws = target[depth][tuple(full[rows, :depth].T)] if depth else target[0][None]
        cum = np.cumsum(np.broadcast_to(laws, (rows.sum(), STAT_V)), axis=1)
        draws = (rng.random((rows.sum(), 1)) > cum).sum(1)
        full[rows, depth] = np.minimum(draws, STAT_V - 1)
    codes = np.ravel_multi_index(full.T, (STAT_V,) * (STAT_N + 1))
    counts = np.bincount(codes, minlength=STAT_V ** (STAT_N + 1))
    strings = itertools.product(range(STAT_V), repeat=STAT_N + 1)
    expected = STAT_KEYS * np.array([string_prob(target, z) for z in strings])
    pvalue = stats.chisquare(counts, expected).pvalue
    assert pvalue > 1e-4, (method, options, pvalue)
    return length, fallbacks


# Few LP iterations here: the solves are vmapped 10^5 times, and a mix of LP weights and counted
# fallbacks is exactly what must stay unbiased. At V = 4 "is" with the truncated LP (s = 5, alphabet
# 40) solves the full pairwise LP, i.e. the scheme "stat_lp" of the enumeration. The default "is"
# rule and "optimal" are level races (distinct draft laws here).
STAT_METHODS = [
    ("specinfer", {}, "specinfer"),
    ("spectr", {}, "spectr"),
    ("is", {}, "is_default"),
    ("is", {"rule": "truncated_lp", "lp_iters": 60}, "stat_lp"),
    ("optimal", {"grad_steps": 20}, "optimal_g20"),
]


@pytest.mark.slow
@pytest.mark.optimized  # the law run outweighs its compile (tests/conftest.py)
@pytest.mark.parametrize("method,options,law_name", STAT_METHODS)
def test_statistical_verify_drafts(method, options, law_name):
    """10^5 vmapped calls: emitted strings continued by the target follow p (chi-square), and the
    mean emitted length matches the exact E[L] of the same scheme by enumeration."""
    length, fallbacks = _run_statistical(method, options)
    if law_name == "stat_lp":
        assert 0 < fallbacks.mean() < 2  # both paths taken
    else:
        assert np.all(fallbacks == 0)
    # verify_drafts' default tail="asps": the last alive chain is verified by ASpS.
    law = _stat_tree_law(law_name)
    sem = length.std() / np.sqrt(STAT_KEYS)
    assert abs(length.mean() - mean_length(law)) < 5 * sem, (length.mean(), mean_length(law))


@pytest.mark.slow
@pytest.mark.optimized  # the law run outweighs its compile (tests/conftest.py)
def test_statistical_without_replacement():
    length, _ = _run_statistical("specinfer_wor", {}, without_replacement=True)
    assert length.mean() > 1.0


# --- Acceptance probabilities (exact, float64) ---


_optimal_acceptance = jax.jit(optimal_acceptance)


def _optimal_acceptance64(p, qs):
    with jax.enable_x64(True):
        return float(_optimal_acceptance(jnp.log(jnp.asarray(p)), jnp.log(jnp.asarray(qs))))


@pytest.mark.slow
@pytest.mark.parametrize("q2,expected", [(0.1, 0.8567), (0.2, 1.0), (0.3, 1.0), (0.45, 1.0)])
def test_three_letter_example_optimal(q2, expected):
    """Khisti et al.'s example: uniform target, q = [1/3, q2, 2/3 - q2], K = 2, n = 1."""
    p = np.full(3, 1 / 3)
    q = np.array([1 / 3, q2, 2 / 3 - q2])
    qs = np.stack([q, q])
    assert root_acceptance("pairwise_lp16", p, qs) == pytest.approx(expected, abs=5e-5)
    assert expected - 2e-3 <= root_acceptance("optimal", p, qs) <= expected + 1e-9
    assert _optimal_acceptance64(p, qs) == pytest.approx(expected, abs=5e-5)


def test_three_letter_example_spectr_specinfer():
    p = np.full(3, 1 / 3)
    q = np.array([1 / 3, 0.2, 2 / 3 - 0.2])
    qs = np.stack([q, q])
    assert root_acceptance("spectr", p, qs) == pytest.approx(0.9224, abs=5e-5)
    assert root_acceptance("specinfer", p, qs) == pytest.approx(0.8933, abs=5e-5)


@pytest.mark.slow
def test_single_alive_draft_is_sps():
    """With one alive draft every scheme is single-draft SpS (accept min(1, p/q), else (p-q)_+)."""
    rng = np.random.default_rng(4)
    p, q0, q1 = (rng.dirichlet(np.ones(5)) for _ in range(3))
    qs = np.stack([q0, q1])
    xs = np.array(list(itertools.product(range(5), repeat=2)), np.int64)
    residual = np.maximum(p - q1, 0) / np.maximum(p - q1, 0).sum()
    acc = np.minimum(1, p / q1)
    expected = (1 - acc[xs[:, 1]])[:, None] * residual
    expected[np.arange(len(xs)), xs[:, 1]] += acc[xs[:, 1]]
    for name in FULL_GRID:
        laws = node_law(name, 5)(p, qs, xs, np.array([False, True]))
        np.testing.assert_allclose(laws, expected, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("num_drafts", [2, 3])
def test_optimal_acceptance_matches_lp_and_brute_force(num_drafts):
    rng = np.random.default_rng(num_drafts)
    for vocab in (3, 4, 5):
        for identical in (True, False):
            p = rng.dirichlet(np.ones(vocab))
            q = rng.dirichlet(np.full(vocab, 0.6))
            qs = np.stack(
                [q if identical else rng.dirichlet(np.ones(vocab)) for _ in range(num_drafts)]
            )
            qs[0] = q
            value = _optimal_acceptance64(p, qs)
            assert value == pytest.approx(brute_force_acceptance(p, list(qs)), abs=1e-9)
            assert value == pytest.approx(ot_lp_optimum(p, list(qs)), abs=1e-9)


def _identical64(p, q, num_drafts):
    with jax.enable_x64(True):
        lp, lq = jnp.log(jnp.asarray(p)), jnp.log(jnp.asarray(q))
        return float(jax.jit(identical_drafts_acceptance, static_argnums=2)(lp, lq, num_drafts))


@pytest.mark.slow
def test_sorted_prefix_is_exact_for_identical_drafts():
    """The O(V log V) prefix form against all 2^V subsets (V = 12), and vs HiGHS at V = 40."""
    from multidraft_reference import pairwise_lp_optimum

    rng = np.random.default_rng(9)
    for num_drafts in (2, 3, 4):
        p, q = rng.dirichlet(np.full(12, 0.5)), rng.dirichlet(np.full(12, 0.5))
        q[3] = 0.0  # a token the draft never proposes
        q /= q.sum()
        qs = np.stack([q] * num_drafts)
        with jax.enable_x64(True):
            args = (jnp.log(jnp.asarray(p)), jnp.log(jnp.asarray(qs)))
            value = float(jax.jit(sorted_prefix_acceptance)(*args))
        assert value == pytest.approx(brute_force_acceptance(p, list(qs)), abs=1e-12)
        assert _identical64(p, q, num_drafts) == pytest.approx(value, abs=1e-12)
    p, q = rng.dirichlet(np.ones(40)), rng.dirichlet(np.ones(40))
    coupling = np.outer(q, q) * (1 - np.eye(40))
    expected = pairwise_lp_optimum(p, q * q + coupling.sum(0), coupling)
    assert _optimal_acceptance64(p, np.stack([q, q])) == pytest.approx(expected, abs=1e-9)
    assert _identical64(p, q, 2) == pytest.approx(expected, abs=1e-9)
    assert _identical64(p, q, 1) == pytest.approx(np.minimum(p, q).sum(), abs=1e-12)
    # Batched leading axes, float32.
    uniform = jnp.full((2, 3, 2, 40), 1 / 40)
    batch = _optimal_acceptance(jnp.log(uniform[:, :, 0]), jnp.log(uniform))
    assert batch.shape == (2, 3)
    np.testing.assert_allclose(np.asarray(batch), 1.0, atol=1e-6)
    batch = identical_drafts_acceptance(jnp.log(uniform[:, :, 0]), jnp.log(uniform[:, :, 1]), 3)
    assert batch.shape == (2, 3)
    np.testing.assert_allclose(np.asarray(batch), 1.0, atol=1e-6)
    with pytest.raises(ValueError, match="shape of target_logprobs"):
        identical_drafts_acceptance(jnp.zeros((2, 5)), jnp.zeros((2, 4)), 2)
    with pytest.raises(ValueError, match="num_drafts must be >= 1"):
        identical_drafts_acceptance(jnp.zeros(5), jnp.zeros(5), 0)


@pytest.mark.slow
def test_acceptance_ordering_on_random_nodes(capsys):
    """200 random K = 2 identical-draft nodes: optimal >= IS(truncated LP) >= SpecTr >= SpecInfer
    >= single-draft SpS on average, and no scheme above the closed-form optimum."""
    rng = np.random.default_rng(2025)
    vocab = 8
    names = ["pairwise_lp16", "optimal", "is_default", "spectr", "specinfer"]
    table = {name: [] for name in names + ["sps", "bound"]}
    for _ in range(200):
        p, q = rng.dirichlet(np.ones(vocab)), rng.dirichlet(np.ones(vocab))
        qs = np.stack([q, q])
        for name in names:
            table[name].append(root_acceptance(name, p, qs))
        table["sps"].append(np.minimum(p, q).sum())
        table["bound"].append(_optimal_acceptance64(p, qs))
    table = {k: np.array(v) for k, v in table.items()}
    with capsys.disabled():
        print("\n| scheme (K=2, identical, V=8, 200 nodes) | mean acceptance |")
        print("|---|---|")
        for name in ["bound"] + names + ["sps"]:
            print(f"| {name} | {table[name].mean():.4f} |")
    means = [table[name].mean() for name in names + ["sps"]]
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(means)), means
    for name in names + ["sps"]:
        assert np.all(table[name] <= table["bound"] + 1e-9), name
    # K = 2, V <= 16: the pairwise LP is optimal; the level race "optimal" is within 0.002.
    assert np.mean(np.abs(table["pairwise_lp16"] - table["bound"]) <= 1e-6) >= 0.98
    assert np.mean(table["bound"] - table["optimal"]) <= 2e-3


# --- Bad input and the solver fallback ---


def _small_inputs(num_drafts=2, n=2, vocab=5):
    rng = np.random.default_rng(0)
    lq = np.log(rng.dirichlet(np.ones(vocab), size=(num_drafts, n))).astype(np.float32)
    lp = np.log(rng.dirichlet(np.ones(vocab), size=(num_drafts, n + 1))).astype(np.float32)
    tokens = rng.integers(0, vocab, size=(num_drafts, n)).astype(np.int32)
    return tokens, lq, lp


@pytest.mark.parametrize(
    "method,options,match",
    [
        ("is", {"rule": "greedy"}, "rule"),
        ("is", {"rule": "truncated_lp", "s": 6, "alphabet": 5}, "larger than the alphabet"),
        ("is", {"rule": "truncated_lp", "s": 4, "alphabet": 3}, "larger than the alphabet"),
        ("is", {"rule": "truncated_lp", "alphabet": 6}, "larger than the vocabulary"),
        ("is", {"rule": "truncated_lp", "alphabet": 0}, "alphabet"),
        ("is", {"rule": "truncated_lp", "s": 0}, "s must be"),
        ("is", {"rule": "sir", "s": 2}, "s applies"),
        ("is", {"rule": "truncated_lp", "lp_iters": -1}, "lp_iters"),
        ("is", {"s": 3}, "pairwise rules"),
        ("is", {"lp_iters": 10}, "pairwise rules"),
        ("is", {"levels": 0}, "levels must be an int >= 1"),
        ("is", {"levels": 4.0}, "levels must be an int"),
        ("is", {"fit_steps": 0}, "fit_steps must be an int >= 1"),
        ("is", {"rule": "sir", "levels": 4}, "level_race' only"),
        ("is", {"temperature": 1.0}, "unknown option"),
        ("optimal", {"s": 3}, "LP option"),
        ("optimal", {"lp_iters": 60}, "LP option"),
        ("optimal", {"grad_steps": -1}, "grad_steps must be an int >= 0"),
        ("optimal", {"rule": "sir"}, "unknown option"),
        ("specinfer", {"rule": "sir"}, "takes no options"),
        ("spectr", {"s": 2}, "takes no options"),
    ],
)
def test_bad_options(method, options, match):
    tokens, lq, lp = _small_inputs()
    with pytest.raises(ValueError, match=match):
        asps_jax.verify_drafts(jax.random.key(0), tokens, lq, lp, method=method, **options)


def test_bad_shapes():
    tokens, lq, lp = _small_inputs()
    with pytest.raises(ValueError, match="K >= 1"):
        asps_jax.verify_drafts(jax.random.key(0), tokens[:0], lq[:0], lp[:0], method="is")
    with pytest.raises(ValueError, match="num_drafts"):
        multi.sample_without_replacement(jax.random.key(0), jnp.zeros(3), 4)
    with pytest.raises(ValueError, match="draft_logprobs"):
        optimal_acceptance(jnp.zeros((2, 5)), jnp.zeros((3, 2, 5)))


@pytest.mark.slow
def test_lp_fallback_is_counted_and_uses_the_fixed_order_law():
    """A solve that does not converge (here: zero iterations) falls back to the fixed-order rule,
    counted in num_fallbacks; the law is then exactly the fixed-order law (and exact, see the
    enumeration of ``is_lp_no_iters``)."""
    tokens, lq, lp = _small_inputs()
    run = jax.jit(
        jax.vmap(
            lambda key: asps_jax.verify_drafts(
                key, tokens, lq, lp, method="is", rule="truncated_lp", lp_iters=0
            )
        )
    )
    verdict = run(jax.random.split(jax.random.key(1), 64))
    assert np.all(np.asarray(verdict.num_fallbacks) >= 1)
    rng = np.random.default_rng(12)
    p, q = rng.dirichlet(np.ones(5)), rng.dirichlet(np.ones(5))
    qs = np.stack([q, q])
    xs = np.array(list(itertools.product(range(5), repeat=2)), np.int64)
    alive = np.ones(2, bool)
    fell_back = node_law("is_lp_no_iters", 5)(p, qs, xs, alive)
    fixed = node_law("is_fixed_order_m3", 5)(p, qs, xs, alive)
    with jax.enable_x64(True):
        cfg = is_cfg("truncated_lp", 5, 40, 0)(5)
        prepared = tokenlevel.importance_sampling_rules(
            jnp.asarray(p), jnp.asarray(qs), jnp.asarray(alive), cfg
        )
        n_fb = prepared[3]
    assert int(n_fb) == 1
    # Both are fixed-order rules over the same ranking when the alphabet covers V.
    SCHEMES["is_fixed_order_m5"] = lambda v: is_law_fn(is_cfg("fixed_order", 1, 5)(v))
    np.testing.assert_allclose(
        fell_back, node_law("is_fixed_order_m5", 5)(p, qs, xs, alive), atol=1e-14
    )
    assert fixed.shape == fell_back.shape


@pytest.mark.slow
def test_sample_without_replacement_law():
    """Gumbel-top-k: ordered pairs follow q(a) q(b) / (1 - q(a)) (chi-square, 10^5 keys)."""
    q = np.array([0.1, 0.2, 0.3, 0.4])
    draw = jax.jit(jax.vmap(lambda k: multi.sample_without_replacement(k, jnp.log(q), 2)))
    pairs = np.asarray(draw(jax.random.split(jax.random.key(3), 100_000)))
    assert np.all(pairs[:, 0] != pairs[:, 1])
    counts = np.bincount(pairs[:, 0] * 4 + pairs[:, 1], minlength=16)
    expected = np.array(
        [q[a] * q[b] / (1 - q[a]) if a != b else 0.0 for a in range(4) for b in range(4)]
    )
    off = expected > 0
    assert np.all(counts[~off] == 0)
    assert stats.chisquare(counts[off], 100_000 * expected[off]).pvalue > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("method", ["specinfer", "spectr", "is", "optimal"])
def test_edge_cases(method):
    """p == q accepts every draft token; chains of length 0 (or n = 0) emit one bonus token."""
    uniform = np.log(np.full((2, 3, 5), 0.2, np.float32))
    tokens = np.array([[1, 2], [1, 4]], np.int32)
    run = jax.jit(
        lambda key, length: asps_jax.verify_drafts(
            key, tokens, uniform[:, :2], uniform, method=method, draft_length=length
        )
    )
    full = run(jax.random.key(0), np.array([2, 2], np.int32))
    assert int(full.num_tokens) == 3
    assert np.asarray(full.tokens)[:2].tolist() == tokens[int(full.draft_index)].tolist()
    empty = run(jax.random.key(0), np.array([0, 0], np.int32))
    assert int(empty.num_tokens) == 1 and np.asarray(empty.tokens)[1:].tolist() == [-1, -1]
    if method == "specinfer":  # n = 0 never reaches a node: one method is enough
        none = asps_jax.verify_drafts(
            jax.random.key(0), tokens[:, :0], uniform[:, :0], uniform[:, :1], method=method
        )
        assert int(none.num_tokens) == 1 and 0 <= int(none.tokens[0]) < 5


def _load_bench_verify(monkeypatch):
    """benchmarks/bench_verify.py as a module (benchmarks/ is not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_verify.py"
    monkeypatch.syspath_prepend(str(path.parent))  # it imports harness by name
    spec = importlib.util.spec_from_file_location("bench_verify", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.slow
def test_bench_script_smoke(tmp_path, monkeypatch):
    """benchmarks/bench_verify.py through main([...]): a multi-draft method implies the --drafts
    suite; table rows and JSON for one method."""
    import json

    bench = _load_bench_verify(monkeypatch)
    out = tmp_path / "bench.json"
    argv = [
        "--quick",
        "--vocab",
        "16",
        "--methods",
        "specinfer",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 4] and all(r["median_us"] > 0 for r in rows)
    with pytest.raises(SystemExit):
        bench.main(["--methods", "nope"])
    with pytest.raises(SystemExit):  # asps is timed on one chain only
        bench.main(["--drafts", "--methods", "asps"])


@pytest.mark.slow
def test_bench_script_single_chain(tmp_path, monkeypatch):
    """Without --drafts the same script times verify_chain (K = 1)."""
    import json

    bench = _load_bench_verify(monkeypatch)
    out = tmp_path / "bench.json"
    argv = ["--quick", "--vocab", "16", "--methods", "asps", "--repeats", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["n"], r["batch"]) for r in rows] == [
        ("asps", n, b) for b in (1, 64) for n in (1, 8)
    ]
    assert all(r["K"] == 1 and r["V"] == 16 and r["fallbacks"] == 0 for r in rows)
    assert all(1 <= r["mean_tokens"] <= r["n"] + 1 for r in rows)
    assert all(r["ratio"] is None for r in rows)  # no sps row to divide by


# --- ASpS tail (docs/algorithms.md §3.10): exact enumeration, E[L] versus tail="sps" ---

TAIL_SCHEMES = ("specinfer", "spectr", "is_lp_s2_m3", "specinfer_wor")
TAIL_CONFIGS = [
    (k, n, ident, pad) for k in (2, 3) for n in (2, 3) for ident in (True, False) for pad in (0, 1)
]


def _tail_case(name, i, num_drafts, n, identical, pad, vocab=3):
    target, drafts = _models(700 + i, num_drafts, vocab, n, identical, sparse=0.3 * (i % 2))
    lengths = [n] * num_drafts
    if pad:  # padded chains: one ended after a token, one (K = 3) never started
        lengths[-1] = 1
        if num_drafts == 3:
            lengths[0] = 0
    kwargs = {}
    if name == "specinfer_wor":
        for d in drafts:
            d[0] = drafts[0][0]
        kwargs = dict(
            root_law=node_law("specinfer_wor", vocab),
            root_weights=without_replacement_weights(drafts[0][0], num_drafts),
        )
        name = "specinfer"
    return target, drafts, lengths, node_law(name, vocab), kwargs


@pytest.mark.slow
@pytest.mark.parametrize("name", TAIL_SCHEMES)
def test_tail_exact_enumeration_and_never_shorter(name):
    """Reference walker with the ASpS tail: the emitted string continued by the target is p
    (float64, <= 1e-10) for K = 2, 3, n = 2, 3, identical and distinct drafts, with and without
    padding; and E[L] with the tail is never below E[L] with tail="sps"."""
    for i, (num_drafts, n, identical, pad) in enumerate(TAIL_CONFIGS):
        if name == "specinfer_wor" and pad:
            continue  # without-replacement roots are drawn for every chain
        target, drafts, lengths, law_fn, kwargs = _tail_case(name, i, num_drafts, n, identical, pad)
        with_tail, marginal = tree_law(law_fn, target, drafts, n, lengths, tail=True, **kwargs)
        assert marginal <= 1e-10
        assert abs(sum(with_tail.values()) - 1.0) <= 1e-10
        err = continuation_error(with_tail, target, n)
        assert err <= 1e-10, (name, num_drafts, n, identical, pad, err)
        node_only, _ = tree_law(law_fn, target, drafts, n, lengths, **kwargs)
        assert mean_length(with_tail) >= mean_length(node_only) - 1e-12


def test_tail_enumeration_detects_a_wrong_tail(monkeypatch):
    """The check has teeth: a tail whose ASpS table uses another chain's draft law than the one
    the chain was drawn from is caught."""
    import multidraft_reference as ref

    target, drafts, lengths, law_fn, _ = _tail_case("specinfer", 0, 2, 2, False, 0)
    real = ref.asps_tail

    def mismatched(target_, draft, prefix, length):
        other = drafts[1] if draft is drafts[0] else drafts[0]
        return real(target_, draft, prefix, length, table_draft=other)

    monkeypatch.setattr(ref, "asps_tail", mismatched)
    bad, _ = tree_law(law_fn, target, drafts, 2, lengths, tail=True)
    assert continuation_error(bad, target, 2) > 1e-3


def test_tail_gain_on_tabular_models(capsys):
    """Exact E[L] with tail="asps" vs "sps" on random tabular models (K = 2, 3; n = 3; V = 3):
    never lower; the mean gain is printed."""
    rows = []
    for i in range(6):
        for num_drafts in (2, 3):
            target, drafts = _models(900 + i, num_drafts, 3, 3, identical=i % 2 == 0)
            law_fn = node_law("specinfer", 3)
            base = mean_length(tree_law(law_fn, target, drafts, 3)[0])
            tail = mean_length(tree_law(law_fn, target, drafts, 3, tail=True)[0])
            assert tail >= base - 1e-12
            rows.append((num_drafts, base, tail))
    with capsys.disabled():
        gains = np.array([t / b - 1 for _, b, t in rows])
        print(
            f"\nASpS tail vs sps tail, specinfer, exact E[L]: mean gain {gains.mean():.4%}, "
            f"max {gains.max():.4%}, min {gains.min():.4%} over {len(rows)} models"
        )


def _emitted_counts(out, length):
    """Counts of each emitted string (tuple) from verdict arrays."""
    counts = {}
    for row, m in zip(out.tolist(), length.tolist()):
        key = tuple(row[:m])
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("method,law_name", [("specinfer", "specinfer"), ("spectr", "spectr")])
def test_statistical_tail_emitted_law(method, law_name):
    """10^5 calls of verify_drafts (default tail="asps"): the emitted strings themselves follow
    the reference walker's exact law with the tail (chi-square), and never a string of zero
    probability."""
    # The very run of test_statistical_verify_drafts[method] (method's defaults, tail="asps"),
    # and its exact law.
    out, length, *_ = _statistical_draws(method, (), False)  # the cache key of _run_statistical
    counts = _emitted_counts(out, length)
    law = _stat_tree_law(law_name)
    assert set(counts) <= {s for s, m in law.items() if m > 0}
    strings = sorted(law)
    expected = np.array([law[s] for s in strings]) * STAT_KEYS
    observed = np.array([counts.get(s, 0) for s in strings])
    big = expected >= 5
    exp_bins = np.append(expected[big], expected[~big].sum())
    obs_bins = np.append(observed[big], observed[~big].sum())
    assert stats.chisquare(obs_bins, exp_bins).pvalue > 1e-4


@pytest.mark.slow
def test_tail_option_is_validated_and_sps_keeps_the_old_law():
    tokens, lq, lp = _small_inputs()
    for method in ALL_DRAFT_METHODS:
        with pytest.raises(ValueError, match="tail must be one of"):
            asps_jax.verify_drafts(
                jax.random.key(0),
                tokens[:, ::-1] * 0 + [[0, 1], [2, 3]],
                lq,
                lp,
                method=method,
                tail="block",
            )
    with pytest.raises(ValueError, match="unknown option 's2' \\(did you mean 's'"):
        asps_jax.verify_drafts(jax.random.key(0), tokens, lq, lp, method="is", tail="sps", s2=1)
    with pytest.raises(ValueError, match="takes no options"):
        asps_jax.verify_drafts(jax.random.key(0), tokens, lq, lp, method="spectr", tail="sps", s=1)
    # K = 1: tail="asps" is ASpS on the chain, tail="sps" is SpS (exact E[L] of each).
    target, drafts = _models(5, 1, 4, 2, identical=True)
    law_fn = node_law("specinfer", 4)
    keys = jax.random.split(jax.random.key(3), 40_000)
    for tail in ("asps", "sps"):

        def one(key, tail=tail):
            k1, k2 = jax.random.split(key)
            x0 = draws_mod.draw_categorical(k1, jnp.log(jnp.asarray(drafts[0][0], jnp.float32)))
            lq1 = jnp.log(jnp.asarray(drafts[0][1], jnp.float32))[x0]
            x1 = draws_mod.draw_categorical(k2, lq1)
            lp = jnp.log(jnp.asarray(np.stack([target[0], target[0], target[0]]), jnp.float32))
            lp = lp.at[1].set(jnp.log(jnp.asarray(target[1], jnp.float32))[x0])
            lp = lp.at[2].set(jnp.log(jnp.asarray(target[2], jnp.float32))[x0, x1])
            lq = jnp.stack([jnp.log(jnp.asarray(drafts[0][0], jnp.float32)), lq1])
            return asps_jax.verify_drafts(
                key, jnp.stack([x0, x1])[None], lq[None], lp[None], method="specinfer", tail=tail
            ).num_tokens

        length = np.asarray(jax.jit(jax.vmap(one))(keys))
        exact = mean_length(tree_law(law_fn, target, drafts, 2, tail=tail == "asps")[0])
        assert abs(length.mean() - exact) < 5 * length.std() / np.sqrt(len(keys)), tail


# --- Out-of-contract input (issue 15 defects 9, 10) and specinfer_wor repeats (issue 9) ---

ALL_DRAFT_METHODS = registry.names("drafts")


DEFECT_V, DEFECT_N = 10, 3


@functools.cache
def _defect_runner(method):
    """Jitted, vmapped over keys: ``fn(keys, tokens[K, n], lq[K, n, V], lp[K, n+1, V])``."""
    if method in api.CHAIN_METHODS:

        def one(key, tokens, lq, lp):
            return asps_jax.verify_chain(key, tokens[0], lq[0], lp[0], method=method)

    else:

        def one(key, tokens, lq, lp):
            return asps_jax.verify_drafts(key, tokens, lq, lp, method=method)

    return jax.jit(jax.vmap(one, in_axes=(0, None, None, None)))


@pytest.mark.slow
@pytest.mark.parametrize("method", api.CHAIN_METHODS + ALL_DRAFT_METHODS)
def test_zero_probability_and_out_of_range_tokens_are_never_emitted(method):
    """Issue 15 defects 9 and 10 under jit (traced ids): (a) q = p = point mass on token 1 and the
    draft token 0 (p(0) = q(0) = 0): token 0 is never emitted; (b) ids 7, 9, 100 and -5 with
    V = 10: only ids in [0, V) are emitted, and the chain ends before the bad id."""
    keys = jax.random.split(jax.random.key(0), 64)
    run = _defect_runner(method)
    point = np.full(DEFECT_V, -np.inf, np.float32)
    point[1] = 0.0
    lq = np.broadcast_to(point, (2, DEFECT_N, DEFECT_V))
    lp = np.broadcast_to(point, (2, DEFECT_N + 1, DEFECT_V))
    zero = np.array([[0, 1, 1], [1, 0, 1]] if method == "specinfer_wor" else [[0, 1, 1]] * 2)
    out = np.asarray(run(keys, zero, lq, lp).tokens)
    assert not np.any(out == 0), method
    assert np.all(out[:, 0] == 1)
    uniform = np.log(np.full((2, DEFECT_N + 1, DEFECT_V), 0.1, np.float32))
    bad = np.array([[7, 9, 100], [2, -5, 1]])
    verdict = run(keys, bad, uniform[:, :DEFECT_N], uniform)
    out = np.asarray(verdict.tokens)
    assert np.all(out < DEFECT_V), method
    assert np.all(np.asarray(verdict.num_tokens) <= 3)


def test_out_of_range_ids_and_dtypes_are_refused_when_concrete():
    lq = np.log(np.full((3, 10), 0.1, np.float32))
    lp = np.log(np.full((4, 10), 0.1, np.float32))
    for bad in ([7, 9, 100], [7, -1, 3]):
        with pytest.raises(ValueError, match=r"ids must lie in \[0, V=10\)"):
            asps_jax.verify_chain(jax.random.key(0), np.array(bad), lq, lp)
        with pytest.raises(ValueError, match="ids must lie"):
            asps_jax.verify_drafts(
                jax.random.key(0),
                np.array([bad, [1, 2, 3]]),
                np.stack([lq, lq]),
                np.stack([lp, lp]),
                method="specinfer",
            )
    with pytest.raises(ValueError, match="integer ids"):
        asps_jax.verify_chain(jax.random.key(0), np.array([1.0, 2.0, 3.0]), lq, lp)
    with pytest.raises(ValueError, match="floating point"):
        asps_jax.verify_chain(jax.random.key(0), np.array([1, 2, 3]), lq.astype(int), lp)


def test_specinfer_wor_repeated_root_token():
    """Concrete repeats are refused naming the token; traced ones are never accepted. Fed i.i.d.
    drafts (p = [.5, .3, .2], q = [.2, .3, .5], K = 2), the old rule accepted a repeat with
    certainty (emitted law at TV 0.15 from p); now the repeat's slot is 0."""
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.3, 0.5])
    lq = np.log(np.stack([np.stack([q])] * 2)).astype(np.float32)
    lp = np.log(np.stack([np.stack([p, p])] * 2)).astype(np.float32)
    with pytest.raises(ValueError, match="token 2 is repeated"):
        asps_jax.verify_drafts(
            jax.random.key(0), np.array([[2], [2]]), lq, lp, method="specinfer_wor"
        )
    # A chain with draft_length 0 does not count as a root draw.
    checks.check_distinct_roots(np.array([[2], [2]]), np.array([1, 0]), "verify_drafts")
    with jax.enable_x64(True):
        out = tokenlevel.specinfer_without_replacement(
            jnp.asarray(p), jnp.asarray(np.stack([q, q])), jnp.asarray([2, 2]), jnp.ones(2, bool)
        )
        slot = np.asarray(out.slot)
    assert slot[1] == 0.0 and slot[0] == pytest.approx(0.2 / 0.5)
    # Exact emitted law with i.i.d. (not without-replacement) drafts, n = 1, old vs new rule.
    xs = np.array(list(itertools.product(range(3), repeat=2)), np.int64)
    weights = q[xs[:, 0]] * q[xs[:, 1]]
    law = node_law("specinfer_wor", 3)(p, np.stack([q, q]), xs, np.ones(2, bool))
    emitted = weights @ law
    repeats = xs[:, 0] == xs[:, 1]
    # The old rule accepted the repeat (zero proposal mass, zero target mass) with certainty, so
    # its law on a repeated tuple was a point mass on the repeated token.
    old_law = law.copy()
    old_law[repeats] = np.eye(3)[xs[repeats, 0]]
    old = weights @ old_law
    assert 0.5 * np.abs(old - p).sum() == pytest.approx(0.15, abs=1e-12)
    # New: the repeat falls to the residual after the first rejection, as for a fresh token.
    for row in np.nonzero(repeats)[0]:
        assert law[row, xs[row, 0]] == pytest.approx(min(1.0, p[xs[row, 0]] / q[xs[row, 0]]))
    assert 0.5 * np.abs(emitted - p).sum() < 0.15


@pytest.mark.slow
def test_bench_script_real_laws(tmp_path, monkeypatch, capsys):
    """--real on tiny settings: exact accept-part acceptance never above the optimum, SpS-level
    methods ordered, and the default "is" rule (level race) timed."""
    import json

    bench = _load_bench_verify(monkeypatch)
    out = tmp_path / "real.json"
    argv = ["--real", "--quick", "--positions", "4", "--ks", "2", "--draft-temperatures", "1.0"]
    argv += ["--methods", "specinfer", "spectr", "is[level_race]", "--json", str(out)]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["K"] == 2 and 0 < row["optimum"] <= 1
    for method in ("specinfer", "spectr", "is[level_race]"):
        assert 0 < row[method] <= row["optimum"] + 1e-5, method
    assert list(data["rule_ms"]) == ["2048"] and data["rule_ms"]["2048"] > 0
    assert "| draft T | K | optimum |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--real", "--ks", "1"])
    with pytest.raises(SystemExit):
        bench.main(["--real", "--methods", "asps"])


@pytest.mark.slow
@pytest.mark.parametrize("method, options", [("is", {}), ("optimal", {"grad_steps": 2})])
def test_batch_axis_fits_only_where_needed_with_the_same_verdicts(method, options):
    """``batch_axis`` under a named ``vmap`` skips a depth's level-race fit when no row has two
    alive drafts there; every verdict equals the unnamed call's, on random drafts (some rows keep
    two chains alive below the root) and on drafts whose roots all differ (none does)."""
    rng = np.random.default_rng(12)
    rows, k, n, vocab = 256, 3, 3, 4
    tokens = rng.integers(0, vocab, (rows, k, n)).astype(np.int32)
    apart = tokens.copy()
    apart[:, :, 0] = np.arange(k)
    lq = np.log(rng.dirichlet(np.ones(vocab), (rows, k, n))).astype(np.float32)
    lp = np.log(rng.dirichlet(np.ones(vocab), (rows, k, n + 1))).astype(np.float32)
    keys = jax.random.split(jax.random.key(2), rows)

    def run(axis_name, **extra):
        def one(key, x, q, p):
            return asps_jax.verify_drafts(key, x, q, p, method=method, **options, **extra)

        return jax.jit(jax.vmap(one, axis_name=axis_name))

    plain, skipping = run(None), run("rows", batch_axis="rows")
    for x in (tokens, apart):
        want = jax.tree.map(np.asarray, plain(keys, x, lq, lp))
        got = jax.tree.map(np.asarray, skipping(keys, x, lq, lp))
        jax.tree.map(np.testing.assert_array_equal, got, want)
