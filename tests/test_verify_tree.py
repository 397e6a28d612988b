"""Sequence-level tree verifiers (TV, TV-wr, IS+BV): exact enumeration against the target and the
independent float64 reference (tree_reference.py), reductions to ASpS (K = 1) and SpecInfer
(n = 1), mutation tests, a statistical test through ``verify_tree`` and bad input."""

import dataclasses
import math
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tabular as tab
import tree_reference as ref
from multidraft_reference import random_laws

from asps_jax import trees
from asps_jax.verify import tokenlevel, verify_tree
from asps_jax.verify import tree as vt
from asps_jax.verify.chain import asps_outcome_logweights

_FAST_COMPILE = {"xla_backend_optimization_level": 0}
# XLA:CPU's level 1 (LLVM's expensive passes stay off under the suite's -O0 setting: the level of
# tests/conftest.py's ``optimized`` tests): it compiles in about the time of level 0 and runs the
# enumeration several times faster. Used where the run outweighs the compile: a tree whose race is
# enumerated over 16 or more pick sequences (the (2, 2) branching tree: 1,024 draws x 16 sequences
# x 3 race rules, 5.6 s a run at level 0).
_OPTIMIZED = {"xla_backend_optimization_level": 1}
_MANY_PICKS = 16
_COMPILED = {}
TOL = 1e-10
_BATCH = 1024


def _mutant_outcome(tree, tokens, lq, lp, valid, restrict, walk_all):
    """TV with its flags set by hand (for the mutation tests)."""
    node, parent, real = trees.merge_duplicates(tree, tokens, valid)
    q, p = jnp.exp(lq), jnp.exp(lp)
    return vt._traversal_outcome(
        tree, tokens, q, p, node, parent, real, node >= 0, restrict=restrict, walk_all=walk_all
    )


ALL = ("tv", "tv_wr", "is_bv", "is_bv_count", "tv_unrestricted")
# The test's names for verify_tree's methods and options. "is_bv" here is the fixed-order rule,
# the one tree_reference.py simulates; "is_bv_race" is the default rule (the level race), whose
# pick is random: its law is enumerated over every sequence of picks (_race_joint).
OPTIONS = {
    "tv": ("tv", {}),
    "tv_wr": ("tv_wr", {}),
    "is_bv": ("is_bv", {"rule": "fixed_order"}),
    "is_bv_count": ("is_bv", {"alive": "count"}),
    "is_bv_race": ("is_bv", {}),
}


@dataclasses.dataclass(frozen=True)
class WrongLawRace(vt.LevelRaceRule):
    """Mutation: the race's pick, but the walkers' mean law taken as the selected token's law."""

    def walkers(self, p, q_WV, tokens_W, alive_W):
        select, _ = super().walkers(p, q_WV, tokens_W, alive_W)
        weight = alive_W / jnp.maximum(jnp.sum(alive_W), 1)
        return select, jnp.einsum("w,wv->v", weight.astype(q_WV.dtype), q_WV)


RACE_RULES = {
    "is_bv_race": vt.LevelRaceRule(),
    "race_wrong_law": WrongLawRace(),
    # Two tabulated level laws on log(p / q) that the tokens mix (the default at a real V).
    "is_bv_race_table": vt.LevelRaceRule(table=2),
}


def _one(tree, method, tokens, lq, lp, valid):
    if method == "tv_unrestricted":
        return _mutant_outcome(tree, tokens, lq, lp, valid, restrict=False, walk_all=False)
    name, options = OPTIONS[method]
    return vt.tree_outcome(tree, tokens, lq, lp, valid, name, **options)


def _pick_sequences(tree):
    """Every sequence of walker picks of IS+BV's path selection: int32[P, D]."""
    width = int(np.bincount(tree.depth).max()) if tree.max_depth else 1
    grid = np.indices((width,) * tree.max_depth).reshape(tree.max_depth, -1).T
    return jnp.asarray(grid, jnp.int32)


def _race_joint(tree, rule, tokens, lq, lp, valid):
    """``joint [N, V]``: P(stop at slot i, emit y) of IS+BV with the random ``rule``, summed over
    every sequence of picks weighted by its probability (the internal ``picks`` hook)."""
    node, parent, real = trees.merge_duplicates(tree, tokens, valid)
    q, p = jnp.exp(lq), jnp.exp(lp)

    def given(picks):
        stop, emit, log_pick = vt._is_bv_outcome(
            tree, tokens, q, p, node, parent, real, node >= 0, rule, "walkers", None, picks
        )
        return jnp.exp(log_pick) * stop[:, None] * emit

    return jnp.sum(jax.vmap(given)(_pick_sequences(tree)), axis=0)


def _outcome_fn(tree):
    """``fn(tokens[M, N], lq[M, N, V], lp[M, N, V], valid[M, N]) -> {method: joint [M, N, V]}``
    (P(stop at slot i and emit y)): every method of :data:`ALL` and :data:`RACE_RULES` in one jit
    per tree (compiling dominates these tests)."""
    if tree not in _COMPILED:
        methods = ALL if _uniform(tree) else ALL[:3] + ALL[4:]

        def fn(t, lq, lp, v):
            out = {}
            for m in methods:
                stop, emit = _one(tree, m, t, lq, lp, v)
                out[m] = stop[:, None] * emit
            for m, rule in RACE_RULES.items():
                out[m] = _race_joint(tree, rule, t, lq, lp, v)
            return out

        many = len(_pick_sequences(tree)) >= _MANY_PICKS
        options = _OPTIMIZED if many else _FAST_COMPILE
        _COMPILED[tree] = jax.jit(jax.vmap(fn), compiler_options=options)
    return _COMPILED[tree]


def _verdicts_fn(tree):
    """``fn(keys[M], tokens[M, N], lq[M, N, V], lp[M, N, V]) -> {method: TreeVerdict}`` through
    the public ``verify_tree`` (float32), every method in one jit per tree."""
    if ("verdicts", tree) not in _COMPILED:

        def fn(k, t, a, b):
            return {
                m: verify_tree(k, tree, t, a, b, method=OPTIONS[m][0], **OPTIONS[m][1])
                for m in EXACT + ("is_bv_count",)
            }

        _COMPILED[("verdicts", tree)] = jax.jit(jax.vmap(fn))
    return _COMPILED[("verdicts", tree)]


def _uniform(tree):
    return all(len(set(tree.num_children[tree.depth == d])) == 1 for d in range(tree.max_depth))


_LAST_JOINTS = {}


def _joints(tree, tokens, q, p, valid):
    """``_outcome_fn(tree)`` on these draws as float64 NumPy arrays, every method at once: the
    last inputs' result is kept, so the methods that enumerate the same draws one after another
    share one run of the program (it computes them all)."""
    key = (tree,) + tuple((a.shape, a.dtype.str, a.tobytes()) for a in (tokens, q, p, valid))
    if _LAST_JOINTS.get("key") != key:
        with jax.enable_x64(True), np.errstate(divide="ignore"):
            joints = _outcome_fn(tree)(
                jnp.asarray(tokens), jnp.log(jnp.asarray(q)), jnp.log(jnp.asarray(p)), valid
            )
            assert all(j.dtype == jnp.float64 for j in joints.values())
            joints = {m: np.asarray(j) for m, j in joints.items()}
        _LAST_JOINTS.update(key=key, joints=joints)
    return _LAST_JOINTS["joints"]


def library_laws(tree, method, draws, valid=None):
    """The library's law of the emitted string for each draw (float64); ``method`` in ALL or
    RACE_RULES."""
    _, tokens, q, p = (np.array(a) for a in zip(*draws))
    # Pad the batch to a multiple of _BATCH draws: one compilation per tree.
    pad = -len(draws) % _BATCH
    tokens, q, p = (np.concatenate([a, np.repeat(a[:1], pad, 0)]) for a in (tokens, q, p))
    valid = np.ones(tokens.shape, bool) if valid is None else np.broadcast_to(valid, tokens.shape)
    joint = _joints(tree, tokens, q, p, valid)[method]
    assert not np.isnan(joint).any()
    np.testing.assert_allclose(joint.sum((1, 2)), 1.0, atol=1e-12)
    paths, depth = tree.paths, tree.depth
    laws = []
    for d in range(len(draws)):
        law = defaultdict(float)
        for i, y in zip(*np.nonzero(joint[d] > 0)):
            prefix = tuple(int(tokens[d, j]) for j in paths[i, 1 : depth[i] + 1])
            law[prefix + (int(y),)] += joint[d, i, y]
        laws.append(law)
    return laws


def enumerate_method(tree, method, draws, target, valid=None, reference=False):
    """The emitted law and its largest deviation from the target once continued; with
    ``reference``, also checks every draw against tree_reference.py."""
    laws = library_laws(tree, method, draws, valid)
    valid_np = np.ones(tree.num_nodes, bool) if valid is None else np.asarray(valid)
    total = defaultdict(float)
    for (weight, tokens, q, p), law in zip(draws, laws):
        if reference and method in ref.LAWS:  # the random race has no per-draw reference
            want = ref.LAWS[method](list(tree.parents), tokens, q, p, valid_np)
            worst = max(abs(want.get(s, 0.0) - law.get(s, 0.0)) for s in set(want) | set(law))
            assert worst <= TOL, (method, tokens.tolist(), worst)
        for s, m in law.items():
            total[s] += weight * m
    err = np.max(np.abs(ref.continued(total, target, tree.max_depth + 1) - target_joint(target)))
    return total, err


def target_joint(target):
    return tab.joint(target, len(target))


def _chain_models(seed, num_drafts, vocab, n, identical, sparse=0.0):
    rng = np.random.default_rng(seed)
    target = random_laws(rng, vocab, n + 1, sparse=sparse)
    first = random_laws(rng, vocab, n, alpha=0.7)
    drafts = [first] + [
        first if identical else random_laws(rng, vocab, n, alpha=0.7, sparse=sparse)
        for _ in range(num_drafts - 1)
    ]
    return target, drafts


# Exact on any independent draws ("tv" also without replacement).
EXACT = ("tv", "tv_wr", "is_bv", "is_bv_race")
CHAIN_CONFIGS = [  # (K, V, n, identical, sparse)
    (2, 3, 2, True, 0.0),
    (2, 3, 2, False, 0.0),
    (3, 2, 2, True, 0.0),
    (3, 2, 2, False, 0.0),
    (3, 4, 1, False, 0.3),
]


@pytest.mark.slow
@pytest.mark.parametrize("config", CHAIN_CONFIGS)
def test_exact_enumeration_independent_chains(config):
    """Every tree method, identical and distinct draft models; ``is_bv_count`` (the law of the
    number of alive drafts) for identical ones."""
    num_drafts, vocab, n, identical, sparse = config
    target, drafts = _chain_models(7 + vocab + n, num_drafts, vocab, n, identical, sparse)
    tree = trees.chains_token_tree(num_drafts, n)
    draws = list(ref.chain_draws(target, drafts, n))
    for method in EXACT + (("is_bv_count",) if identical else ()):
        _, err = enumerate_method(tree, method, draws, target, reference=True)
        assert err <= TOL, (config, method, err)


@pytest.mark.slow
def test_exact_enumeration_chain_that_ended_early():
    """A chain shortened (EOS, max_new_tokens) is a validity mask on its slots."""
    target, drafts = _chain_models(3, 2, 3, 2, identical=False)
    tree = trees.chains_token_tree(2, 2)
    valid = np.array([True, True, True, True, False])  # chain 1 has one token
    draws = list(ref.chain_draws(target, drafts, 2))
    for method in EXACT:
        _, err = enumerate_method(tree, method, draws, target, valid, reference=True)
        assert err <= TOL, (method, err)


@pytest.mark.slow
def test_exact_enumeration_branching_tree():
    """Shape (2, 2) drawn with replacement (every method) and without (TV, with the restricted
    or the unrestricted laws given)."""
    rng = np.random.default_rng(11)
    target, draft = random_laws(rng, 3, 3), random_laws(rng, 3, 2, alpha=0.7)
    tree = trees.branching_token_tree((2, 2))
    draws = list(ref.tree_draws(target, draft, list(tree.parents), True))
    for method in EXACT + ("is_bv_count",):
        _, err = enumerate_method(tree, method, draws, target, reference=True)
        assert err <= TOL, (method, err)
    for restricted in (True, False):
        draws = list(ref.tree_draws(target, draft, list(tree.parents), False, restricted))
        _, err = enumerate_method(tree, "tv", draws, target, reference=True)
        assert err <= TOL, (restricted, err)


@pytest.mark.slow
def test_exact_enumeration_without_replacement_wide():
    rng = np.random.default_rng(4)
    target, draft = random_laws(rng, 4, 2), random_laws(rng, 4, 1, alpha=0.7)
    tree = trees.branching_token_tree((3,))
    draws = list(ref.tree_draws(target, draft, list(tree.parents), False, True))
    _, err = enumerate_method(tree, "tv", draws, target, reference=True)
    assert err <= TOL, err


@pytest.mark.slow
def test_one_chain_is_asps_draft_by_draft():
    vocab, n = 4, 3
    target, drafts = _chain_models(21, 1, vocab, n, identical=True, sparse=0.2)
    tree = trees.chain_token_tree(n)
    draws = list(ref.chain_draws(target, drafts, n))
    _, tokens, q, p = (np.array(a) for a in zip(*draws))
    with jax.enable_x64(True), np.errstate(divide="ignore"):
        outcome = jax.jit(jax.vmap(lambda x, lq, lp: asps_outcome_logweights(x, lq, lp, n)))
        stop, log_full = outcome(jnp.asarray(tokens[:, 1:]), jnp.log(q[:, 1:]), jnp.log(p))
        stop, full = np.exp(np.asarray(stop)), np.exp(np.asarray(log_full))
    wants = []
    for d in range(len(draws)):
        want = defaultdict(float)
        for t in range(n):
            for y in range(vocab):
                want[tuple(tokens[d, 1 : t + 1]) + (y,)] += stop[d, t, y]
        for y in range(vocab):
            want[tuple(tokens[d, 1:]) + (y,)] += full[d] * p[d, n, y]
        wants.append(want)
    for method in EXACT + ("is_bv_count",):
        for want, law in zip(wants, library_laws(tree, method, draws)):
            worst = max(abs(want[s] - law.get(s, 0.0)) for s in set(want) | set(law))
            assert worst <= 1e-12, (method, worst)


def test_tv_wr_is_specinfer_at_one_token():
    """n = 1: P(first emitted token = y | drafts) equals SpecInfer's pi(y | x) (§3.2)."""
    num_drafts, vocab = 3, 4
    target, drafts = _chain_models(7 + vocab + 1, num_drafts, vocab, 1, False, 0.3)
    tree = trees.chains_token_tree(num_drafts, 1)
    draws = list(ref.chain_draws(target, drafts, 1))
    _, tokens, q, p = (np.array(a) for a in zip(*draws))
    alive = jnp.ones(num_drafts, bool)
    with jax.enable_x64(True):
        law_fn = jax.jit(
            jax.vmap(
                lambda p0, qs, x: tokenlevel.outcome_law(tokenlevel.specinfer(p0, qs, x, alive), x)
            )
        )
        want = np.asarray(
            law_fn(jnp.asarray(p[:, 0]), jnp.asarray(q[:, 1:]), jnp.asarray(tokens[:, 1:]))
        )
    for d, law in enumerate(library_laws(tree, "tv_wr", draws)):
        first = np.zeros(vocab)
        for s, m in law.items():
            first[s[0]] += m
        np.testing.assert_allclose(first, want[d], atol=1e-12)


@pytest.mark.slow
def test_mutations_break_exactness():
    """TV stays exact only with first-appearance sibling order and restricted sibling laws."""
    target, drafts = _chain_models(2, 2, 3, 2, identical=True)
    tree = trees.chains_token_tree(2, 2)
    draws = list(ref.chain_draws(target, drafts, 2))
    _, err = enumerate_method(tree, "tv", draws, target)
    assert err <= TOL
    # Siblings visited in token order: the chains handed over sorted by their tokens.
    in_token_order = []
    for weight, tokens, q, p in draws:
        order = sorted(range(2), key=lambda k: tokens[1 + 2 * k : 3 + 2 * k].tolist())
        slots = np.concatenate([[0]] + [np.arange(1 + 2 * k, 3 + 2 * k) for k in order])
        in_token_order.append((weight, tokens[slots], q[slots], p[slots]))
    _, err = enumerate_method(tree, "tv", in_token_order, target)
    assert err > 1e-3, err
    _, err = enumerate_method(tree, "tv_unrestricted", draws, target)
    assert err > 1e-3, err


def test_race_mutation_breaks_exactness():
    """IS+BV with the race's pick stays exact only with the race's own law of the selected token:
    the walkers' mean law in its place (the law of a uniform pick) is off."""
    target, drafts = _chain_models(9, 2, 3, 2, identical=False)
    tree = trees.chains_token_tree(2, 2)
    draws = list(ref.chain_draws(target, drafts, 2))
    _, err = enumerate_method(tree, "is_bv_race", draws, target)
    assert err <= TOL
    _, err = enumerate_method(tree, "race_wrong_law", draws, target)
    assert err > 1e-3, err


@pytest.mark.slow
def test_race_with_tabulated_laws_is_exact():
    """IS+BV with the race on tabulated level laws (tokens mix two of four laws) is exact along
    two chains of distinct sparse laws (V = 4, n = 2)."""
    target, drafts = _chain_models(11, 2, 4, 2, identical=False, sparse=0.3)
    tree = trees.chains_token_tree(2, 2)
    draws = list(ref.chain_draws(target, drafts, 2))
    _, err = enumerate_method(tree, "is_bv_race_table", draws, target)
    assert err <= TOL


def _sample_chains(rng, target, draft, num_drafts, n, size):
    """``size`` draws of K chains from one draft model, node-indexed float32 log-laws."""
    vocab = target[0].shape[-1]
    n_nodes = 1 + num_drafts * n
    tokens = np.zeros((size, n_nodes), np.int32)
    q = np.zeros((size, n_nodes, vocab))
    p = np.zeros((size, n_nodes, vocab))
    p[:, 0] = target[0]
    for k in range(num_drafts):
        prefix = np.zeros((size, 0), np.int64)
        for i in range(n):
            slot = 1 + k * n + i
            law = draft[i].reshape(-1, vocab)[tab.code(prefix, vocab)]
            x = (rng.random((size, 1)) > np.cumsum(law, 1)).sum(1)
            prefix = np.concatenate([prefix, x[:, None]], 1)
            tokens[:, slot], q[:, slot] = x, law
            p[:, slot] = target[i + 1].reshape(-1, vocab)[tab.code(prefix, vocab)]
    with np.errstate(divide="ignore"):
        return tokens, np.log(q).astype(np.float32), np.log(p).astype(np.float32)


@pytest.mark.slow
def test_statistical_through_verify_tree():
    """vmapped keys and drafts, one jit: emitted strings follow each method's exact law."""
    num_drafts, vocab, n, size = 2, 3, 2, 30_000
    target, drafts = _chain_models(17, num_drafts, vocab, n, identical=True)
    tree = trees.chains_token_tree(num_drafts, n)
    rng = np.random.default_rng(1)
    tokens, lq, lp = _sample_chains(rng, target, drafts[0], num_drafts, n, size)
    keys = jax.random.split(jax.random.key(3), size)
    out = jax.tree.map(np.asarray, _verdicts_fn(tree)(keys, tokens, lq, lp))
    draws = list(ref.chain_draws(target, drafts, n))
    rows = np.arange(size)[:, None]
    for method in EXACT + ("is_bv_count",):
        verdict = out[method]
        exact, _ = enumerate_method(tree, method, draws, target)
        law = np.concatenate(
            [
                np.array([exact.get(s, 0.0) for s in map(tuple, tab.all_strings(vocab, m + 1))])
                for m in range(n + 1)
            ]
        )
        num = verdict.num_tokens
        assert ((verdict.tokens >= 0) == (np.arange(n + 1) < num[:, None])).all()
        assert ((verdict.path >= 0) == (np.arange(n + 1) < num[:, None])).all()
        # The path names nodes carrying the accepted tokens.
        nodes = verdict.path[:, 1:]
        on_path = np.where(nodes >= 0, tokens[rows, np.maximum(nodes, 0)], -1)
        np.testing.assert_array_equal(on_path, np.where(nodes >= 0, verdict.tokens[:, :n], -1))
        index, bins = tab.string_index(verdict.tokens, num, vocab)
        assert tab.chi_square_pvalue(index, bins, law) > 1e-3, method
        mean = ref.mean_length(exact)
        assert abs(num.mean() - mean) < 5 * num.std() / np.sqrt(size), method


SMALL_TREE, SMALL_VOCAB, SMALL_SIZE = trees.chains_token_tree(3, 3), 3, 2048


@dataclasses.dataclass(frozen=True)
class UniformRule:
    """A random selection rule: one alive walker uniformly. Its induced law is the walkers' mean
    law; for i.i.d. draws it is q itself, and P(z selected, j of m show z) =
    C(m - 1, j - 1) q^j (1 - q)^(m - j)."""

    def walkers(self, p, q_WV, tokens_W, alive_W):
        select = alive_W / jnp.sum(alive_W)
        return select.astype(q_WV.dtype), jnp.einsum("w,wv->v", select.astype(q_WV.dtype), q_WV)

    def counted(self, p, q_V, pi_M, tokens_W, alive_W):
        size = pi_M.shape[0]
        m, j = np.arange(size)[:, None], np.arange(size)[None, :]
        binom = np.array(
            [[math.comb(a - 1, b - 1) if 1 <= b <= a else 0 for b in j[0]] for a in m[:, 0]]
        )
        q_W = q_V[tokens_W][:, None, None]
        powers = q_W ** j[None] * (1 - q_W) ** np.maximum(m - j, 0)[None]  # [W, m, j]
        surv = jnp.einsum("m,mj,wmj->wj", pi_M, jnp.asarray(binom, q_V.dtype), powers)
        select = alive_W / jnp.sum(alive_W)
        return select.astype(q_V.dtype), q_V, surv


@pytest.mark.slow
@pytest.mark.parametrize("alive", ["walkers", "count"])
def test_random_selection_rule_plugs_in(alive):
    """IS+BV with a uniformly random pick verifies one chain drawn from q against q: its law is
    single-chain ASpS's (tests/tabular.py reference), whatever the alive-law mode."""
    num_drafts, vocab, n, size = 2, 3, 2, 20_000
    target, drafts = _chain_models(17, num_drafts, vocab, n, identical=True)
    tree = trees.chains_token_tree(num_drafts, n)
    tokens, lq, lp = _sample_chains(
        np.random.default_rng(2), target, drafts[0], num_drafts, n, size
    )
    keys = jax.random.split(jax.random.key(4), size)
    run = jax.jit(
        jax.vmap(
            lambda k, t, a, b: verify_tree(
                k, tree, t, a, b, method="is_bv", rule=UniformRule(), alive=alive
            )
        )
    )
    verdict = jax.tree.map(np.asarray, run(keys, tokens, lq, lp))
    law = tab.exact_emitted_law("asps", target, drafts[0], n, [n])
    index, bins = tab.string_index(verdict.tokens, verdict.num_tokens, vocab)
    assert tab.chi_square_pvalue(index, bins, law) > 1e-3


@pytest.mark.slow
def test_only_merged_nodes_need_target_laws():
    """Target rows of slots that repeat an earlier sibling are never read: a step can score the
    merged tree alone (fewer nodes) and gets the same tokens for the same key."""
    tree, vocab, size = SMALL_TREE, SMALL_VOCAB, SMALL_SIZE
    num_drafts, n = 3, 3
    rng = np.random.default_rng(8)
    tokens = rng.integers(0, vocab, (size, tree.num_nodes)).astype(np.int32)
    lq = np.log(rng.dirichlet(np.ones(vocab), (size, tree.num_nodes))).astype(np.float32)
    lp = np.log(rng.dirichlet(np.ones(vocab), (size, tree.num_nodes))).astype(np.float32)
    merged = jax.vmap(lambda t: trees.merge_chains(t[0], t[1:].reshape(num_drafts, n)))(tokens)
    valid = np.asarray(merged.valid)
    assert (valid.sum(1) < tree.num_nodes).mean() > 0.7  # P(3 distinct first tokens) = 2/9
    # Equal prefixes get equal target laws (as scoring gives them); repeats get garbage.
    canon = jax.vmap(lambda t: trees.merge_duplicates(tree, t, np.ones(t.shape, bool))[0])(tokens)
    lp = np.take_along_axis(lp, np.asarray(canon)[..., None], axis=1)
    garbage = np.where(valid[..., None], lp, rng.normal(size=lp.shape).astype(np.float32))
    keys = jax.random.split(jax.random.key(5), size)
    full = jax.tree.map(np.asarray, _verdicts_fn(tree)(keys, tokens, lq, lp))
    scored = jax.tree.map(np.asarray, _verdicts_fn(tree)(keys, tokens, lq, garbage))
    jax.tree.map(np.testing.assert_array_equal, full, scored)
    for verdict in full.values():
        assert valid[np.arange(size)[:, None], np.maximum(verdict.path, 0)].all()


@pytest.mark.slow
def test_sparse_float32_laws_never_emit_a_zero_probability_token():
    """-inf log-probabilities (top-k / top-p) flow through without NaN; every emitted token has
    positive target probability after its prefix."""
    tree, vocab, size, n = SMALL_TREE, SMALL_VOCAB, SMALL_SIZE, 3
    rng = np.random.default_rng(9)

    def sparse_laws(shape):
        law = rng.dirichlet(np.ones(vocab), shape) * (rng.random(shape + (vocab,)) < 0.5)
        law[..., 0] += 1e-3  # keep every row non-empty
        return law / law.sum(-1, keepdims=True)

    q, p = sparse_laws((size, tree.num_nodes)), sparse_laws((size, tree.num_nodes))
    p[:, :, 1] = np.where(rng.random((size, tree.num_nodes)) < 0.5, 0.0, p[:, :, 1])
    p /= p.sum(-1, keepdims=True)
    tokens = (rng.random((size, tree.num_nodes, 1)) > np.cumsum(q, -1)).sum(-1).astype(np.int32)
    tokens = np.minimum(tokens, vocab - 1)
    # Equal prefixes get equal target laws.
    canon = jax.vmap(lambda t: trees.merge_duplicates(tree, t, np.ones(t.shape, bool))[0])(tokens)
    p = np.take_along_axis(p, np.asarray(canon)[..., None], axis=1)
    with np.errstate(divide="ignore"):
        lq, lp = np.log(q).astype(np.float32), np.log(p).astype(np.float32)
    keys = jax.random.split(jax.random.key(6), size)
    rows = np.arange(size)
    for verdict in jax.tree.map(np.asarray, _verdicts_fn(tree)(keys, tokens, lq, lp)).values():
        num = verdict.num_tokens
        assert ((num >= 1) & (num <= n + 1)).all()
        for t in range(n + 1):
            live = num > t
            parent = verdict.path[rows, np.minimum(t, num - 1)]
            assert (verdict.tokens[live, t] >= 0).all()
            prob = p[rows, np.maximum(parent, 0), np.maximum(verdict.tokens[:, t], 0)]
            assert (prob[live] > 0).all(), t


@pytest.mark.slow
def test_no_draft_token_gives_the_bonus_at_the_root():
    """A root-only tree, and a tree whose slots are all invalid: one token from the root law."""
    with np.errstate(divide="ignore"):
        lp = np.log(np.eye(3)[[2] * 5])  # the target always says 2
    tree = trees.TokenTree((-1,))
    run = jax.jit(
        lambda k, t, a: {
            m: verify_tree(k, tree, t, a, a, method=OPTIONS[m][0], **OPTIONS[m][1]) for m in EXACT
        }
    )
    for verdict in run(jax.random.key(1), jnp.zeros(1, jnp.int32), lp[:1]).values():
        assert verdict.tokens.tolist() == [2] and verdict.path.tolist() == [0]
    tree = trees.chains_token_tree(2, 2)
    draw = (1.0, np.zeros(5, np.int64), np.full((5, 3), 1 / 3), np.exp(lp))
    for method in EXACT:
        assert library_laws(tree, method, [draw], np.arange(5) == 0) == [{(2,): 1.0}]


@pytest.mark.slow
def test_same_key_same_verdict_and_merged_path():
    """Chains sharing a prefix: the path names merged nodes; one key gives one verdict."""
    vocab = 5
    tree = trees.chains_token_tree(3, 2)
    tokens = jnp.array([0, 1, 2, 1, 3, 4, 4])  # chains (1, 2), (1, 3), (4, 4)
    lq = jnp.log(jnp.full((7, vocab), 1.0 / vocab))
    lp = jnp.log(jnp.full((7, vocab), 1.0 / vocab))
    run = jax.jit(lambda k: {m: verify_tree(k, tree, tokens, lq, lp, method=m) for m in vt.METHODS})
    a, b = run(jax.random.key(0)), run(jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    for method, verdict in a.items():
        num = int(verdict.num_tokens)
        if method != "is_bv":  # p == q: TV accepts a whole chain (IS changes the draft law)
            assert num == 3
        merged_parent = {1: 0, 2: 1, 4: 1, 5: 0, 6: 5}  # slot 3 repeats slot 1
        path = verdict.path.tolist()
        assert path[0] == 0
        for t in range(1, num):
            assert merged_parent[path[t]] == path[t - 1]
            assert int(verdict.tokens[t - 1]) == int(tokens[path[t]])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"method": "specinfer"}, "unknown method"),
        ({"node_tokens": jnp.zeros(4, jnp.int32)}, "node_tokens must be int32"),
        ({"draft_logprobs": jnp.zeros((4, 3))}, "draft_logprobs must be"),
        ({"target_logprobs": jnp.zeros((5, 2))}, "target_logprobs must be"),
        ({"valid": jnp.ones(4, bool)}, "valid must be"),
        ({"tree": "chains"}, "tree must be a TokenTree"),
        ({"method": "tv", "alive": "count"}, "takes no options"),
        ({"method": "is_bv", "alive": "all"}, "alive must be one of"),
        ({"method": "is_bv", "beta": 1}, "unknown option"),
        ({"method": "is_bv", "rule": "lp"}, "rule must be one of"),
        ({"method": "is_bv", "rule": 3}, "rule must be one of"),
        ({"method": "is_bv", "alive": "count", "rule": "level_race"}, "needs rule='fixed_order'"),
        ({"method": "is_bv", "alive": "count", "tree": trees.TokenTree((-1, 0, 0, 1, 1))}, "same"),
        # As verify_chain / verify_drafts: ids are integers in [0, V), laws floating point (these
        # used to be accepted; -3 and 100 were emitted).
        ({"node_tokens": jnp.array([0.0, 1, 2, 1, 0])}, "node_tokens must be integer ids"),
        ({"draft_logprobs": jnp.zeros((5, 3), jnp.int32)}, "draft_logprobs must be floating"),
        ({"target_logprobs": jnp.zeros((5, 3), jnp.int32)}, "target_logprobs must be floating"),
        ({"node_tokens": jnp.array([0, 1, -3, 1, 1])}, r"must lie in \[0, V=3\), got -3"),
        ({"node_tokens": jnp.array([0, 1, 2, 100, 1])}, r"must lie in \[0, V=3\), got 100"),
    ],
)
def test_bad_input(kwargs, match):
    args = {
        "tree": trees.chains_token_tree(2, 2),
        "node_tokens": jnp.zeros(5, jnp.int32),
        "draft_logprobs": jnp.zeros((5, 3)),
        "target_logprobs": jnp.zeros((5, 3)),
        **kwargs,
    }
    with pytest.raises(ValueError, match=match) as info:
        verify_tree(jax.random.key(0), **args)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_traced_out_of_range_ids_end_their_branch():
    """Under jit (ids traced, so not checked), a slot whose id lies outside [0, V) or has draft
    probability 0 ends its branch, as the chain verifiers end a chain: the verdicts are those of
    the same tree with that slot and its subtree marked invalid, key for key, and no id outside
    [0, V) is ever emitted (they used to be: [-3, 1, 1] and [100, 2, 1] for V = 6)."""
    vocab, size = 6, 64
    tree = trees.chains_token_tree(3, 2)  # slots 1-2, 3-4, 5-6: chains 0, 1, 2
    lq = np.log(np.full((7, vocab), 1.0 / vocab))
    lq[6, 5] = -np.inf  # chain 2's second token has draft probability 0
    lp = np.log(np.random.default_rng(0).dirichlet(np.ones(vocab), 7))
    hostile = jnp.array([0, -3, 1, 4, 100, 2, 5], jnp.int32)
    clean = jnp.array([0, 0, 1, 4, 0, 2, 0], jnp.int32)
    cut = jnp.array([True, False, False, True, False, True, False])
    keys = jax.random.split(jax.random.key(1), size)

    def run(tokens, valid):
        fn = jax.vmap(
            lambda k: {m: verify_tree(k, tree, tokens, lq, lp, valid, method=m) for m in vt.METHODS}
        )
        return fn(keys)

    run = jax.jit(run, compiler_options=_FAST_COMPILE)
    got = jax.tree.map(np.asarray, run(hostile, jnp.ones(7, bool)))
    want = jax.tree.map(np.asarray, run(clean, cut))
    jax.tree.map(np.testing.assert_array_equal, got, want)
    for verdict in got.values():
        emitted = verdict.tokens[verdict.tokens >= 0]
        assert (emitted < vocab).all() and (verdict.tokens >= -1).all()
        assert (verdict.num_tokens <= 2).all()  # the root, then at most slot 3 or 5
        assert np.isin(verdict.path, [-1, 0, 3, 5]).all()


@pytest.mark.slow
def test_race_fits_only_where_a_row_needs_them_with_the_same_verdicts():
    """``LevelRaceRule(batch_axis=...)`` under ``vmap`` with that axis name skips a level's fit
    when no row has two walkers there: every verdict equals the plain rule's, on random trees
    (shared root tokens: some rows fit below the root) and on trees whose chains all start
    apart (no row fits below the root)."""
    num_drafts, vocab, n, size = 3, 4, 3, 512
    target, drafts = _chain_models(5, num_drafts, vocab, n, identical=True)
    tree = trees.chains_token_tree(num_drafts, n)
    tokens, lq, lp = _sample_chains(
        np.random.default_rng(8), target, drafts[0], num_drafts, n, size
    )
    apart = tokens.copy()
    apart[:, 1::n] = np.arange(num_drafts)  # root tokens 0, 1, 2: one walker below the root
    keys = jax.random.split(jax.random.key(9), size)

    def run(rule, axis_name=None):
        def one(k, t, a, b):
            return verify_tree(k, tree, t, a, b, method="is_bv", rule=rule)

        return jax.jit(jax.vmap(one, axis_name=axis_name))

    plain = run(vt.LevelRaceRule())
    skipping = run(vt.LevelRaceRule(batch_axis="rows"), "rows")
    for t in (tokens, apart):
        want = jax.tree.map(np.asarray, plain(keys, t, lq, lp))
        got = jax.tree.map(np.asarray, skipping(keys, t, lq, lp))
        jax.tree.map(np.testing.assert_array_equal, got, want)
