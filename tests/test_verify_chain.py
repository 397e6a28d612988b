"""SpS and ASpS: exact enumeration, statistical exactness via the public API, properties, errors.

Expected values come from ``tests/tabular.py`` (NumPy float64 reference laws written independently
of the library, exact enumeration over every draft) and from literals; docs/algorithms.md §5.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tabular as tab

import asps_jax
from asps_jax import statistics
from asps_jax.verify import chain

OUTCOME = {"sps": chain.sps_outcome_logweights, "asps": chain.asps_outcome_logweights}
METHODS = asps_jax.verify.CHAIN_METHODS
EXPECTED_LENGTH = {"sps": statistics.expected_length_sps, "asps": statistics.expected_length_asps}


@functools.cache
def _batched_outcome(method):
    return jax.jit(jax.vmap(OUTCOME[method], in_axes=(0, 0, 0, None)))


@functools.cache
def _jit_outcome(method):
    return jax.jit(OUTCOME[method])


def code_outcome(method, drafts, q_rows, p_rows, draft_length):
    """The library's outcome law for every draft, in float64, as probabilities."""
    with jax.enable_x64(True):
        stop, full = _batched_outcome(method)(
            jnp.asarray(drafts, jnp.int32),
            jnp.log(jnp.asarray(q_rows, jnp.float64)),
            jnp.log(jnp.asarray(p_rows, jnp.float64)),
            jnp.asarray(draft_length, jnp.int32),
        )
        assert stop.dtype == jnp.float64
        stop, full = np.asarray(stop), np.asarray(full)
    assert not np.isnan(stop).any() and not np.isnan(full).any()
    return np.exp(stop), np.exp(full)


def _model(vocab, n, tstyle, dstyle, seed):
    rng = np.random.default_rng(seed)
    target = tab.target_model(rng, vocab, n + 2, tstyle)
    return target, tab.draft_model(rng, target, n, dstyle)


# --- Exact enumeration: every V in {4,5,6} x n in {1..4} x every target/draft style pair ---


@pytest.mark.slow
@pytest.mark.parametrize("vocab,n", list(itertools.product((4, 5, 6), (1, 2, 3, 4))))
def test_exact_enumeration(vocab, n):
    for k, (tstyle, dstyle) in enumerate(itertools.product(tab.TARGET_STYLES, tab.DRAFT_STYLES)):
        target, draft = _model(vocab, n, tstyle, dstyle, seed=1000 * vocab + 10 * n + k)
        drafts, weight, q_rows, p_rows = tab.draft_enumeration(target, draft, n)
        live = weight > 0
        want = tab.joint(target, n + 1)
        atn = {}
        for method in METHODS:
            stop, full = code_outcome(method, drafts, q_rows, p_rows, n)
            ref_stop, ref_full = tab.REF_OUTCOME[method](drafts, q_rows, p_rows, n)
            where = f"{method} V={vocab} n={n} {tstyle}/{dstyle}"
            np.testing.assert_allclose(stop[live], ref_stop[live], atol=1e-12, err_msg=where)
            np.testing.assert_allclose(full[live], ref_full[live], atol=1e-12, err_msg=where)
            # Outcome weights sum to 1 before any normalisation (§2.2 telescoping).
            total = stop.sum((1, 2)) + full
            np.testing.assert_allclose(total[live], 1.0, atol=1e-12, err_msg=where)
            # The emitted string continued by the target has the target's law (§5.1).
            emitted = tab.emitted_law(stop, full, weight, drafts, p_rows[:, n], n)
            got = tab.continue_with_target(emitted, target)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-10, err_msg=where)
            # E[L] by enumeration of the reference law vs the closed forms of asps_jax.statistics.
            length_law = [ref_stop[:, t].sum(-1) for t in range(n)] + [ref_full]
            enum_atn = sum((t + 1) * np.dot(weight, w) for t, w in enumerate(length_law))
            atn[method] = EXPECTED_LENGTH[method](target, draft)
            assert atn[method] == pytest.approx(enum_atn, abs=1e-12), where
        assert atn["asps"] >= atn["sps"] - 1e-12
        if n == 1:
            assert atn["asps"] == pytest.approx(atn["sps"], abs=1e-12)


def test_enumeration_detects_an_inexact_verifier():
    """Recovering from p instead of (p - q)_+ is a classic bug; the enumeration must catch it."""
    target, draft = _model(4, 2, "dense", "far", seed=7)
    drafts, weight, q_rows, p_rows = tab.draft_enumeration(target, draft, 2)
    stop, full = tab.ref_sps_outcome(drafts, q_rows, p_rows, 2)
    wrong = stop.sum(-1, keepdims=True) * p_rows[:, :2]
    emitted = tab.emitted_law(wrong, full, weight, drafts, p_rows[:, 2], 2)
    err = np.abs(tab.continue_with_target(emitted, target) - tab.joint(target, 3)).max()
    assert err > 1e-3


def test_asps_beats_sps_on_toy_models():
    """ASpS gains nothing at n = 1 and strictly gains at n >= 2 on a close draft (§5)."""
    target, draft = _model(4, 4, "dense", "close", seed=3)
    gains = [
        EXPECTED_LENGTH["asps"](target, draft[:n]) / EXPECTED_LENGTH["sps"](target, draft[:n])
        for n in (1, 2, 3, 4)
    ]
    assert gains[0] == pytest.approx(1.0, abs=1e-12)
    assert min(gains[1:]) > 1.001


# --- draft_length: padding is ignored exactly ---


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_padding_is_exact(method):
    vocab, n = 5, 4
    target, draft = _model(vocab, n, "sparse", "close", seed=11)
    rng = np.random.default_rng(0)
    for length in range(n):
        drafts, weight, q_rows, p_rows = tab.draft_enumeration(target, draft, length)
        pad = n - length
        garbage_tok = rng.integers(0, vocab, (drafts.shape[0], pad))
        garbage_q = rng.dirichlet(np.ones(vocab), (drafts.shape[0], pad))
        garbage_p = rng.dirichlet(np.ones(vocab), (drafts.shape[0], pad))
        stop, full = code_outcome(
            method,
            np.concatenate([drafts, garbage_tok], 1),
            np.concatenate([q_rows, garbage_q], 1),
            np.concatenate([p_rows, garbage_p], 1),
            length,
        )
        ref_stop, ref_full = tab.REF_OUTCOME[method](drafts, q_rows, p_rows, length)
        live = weight > 0
        np.testing.assert_allclose(stop[live, :length], ref_stop[live], atol=1e-12)
        np.testing.assert_allclose(full[live], ref_full[live], atol=1e-12)
        assert np.all(stop[:, length:] == 0.0)
        emitted = tab.emitted_law(stop, full, weight, drafts, p_rows[:, length], length)
        got = tab.continue_with_target(emitted[: length + 1], target)
        np.testing.assert_allclose(got, tab.joint(target, length + 1), atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_padding_values_do_not_change_the_sample(method):
    vocab, n, length = 6, 5, 2
    rng = np.random.default_rng(1)
    lq = np.log(rng.dirichlet(np.ones(vocab), n)).astype(np.float32)
    lp = np.log(rng.dirichlet(np.ones(vocab), n + 1)).astype(np.float32)
    x = rng.integers(0, vocab, n).astype(np.int32)
    lq2, lp2, x2 = lq.copy(), lp.copy(), x.copy()
    lq2[length:] = -np.inf
    lp2[length + 1 :] = np.log(rng.dirichlet(np.ones(vocab), n - length))
    x2[length:] = 0

    @jax.jit
    def run(keys, x, lq, lp):
        fn = functools.partial(asps_jax.verify_chain, method=method, draft_length=length)
        return jax.vmap(lambda k: fn(k, x, lq, lp))(keys)

    keys = jax.random.split(jax.random.key(2), 512)
    a, b = run(keys, x, lq, lp), run(keys, x2, lq2, lp2)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.num_tokens, b.num_tokens)
    assert a.num_tokens.max() <= length + 1 and a.num_tokens.min() >= 1
    assert np.all(np.asarray(a.tokens)[:, length + 1 :] == -1)


# --- Statistical exactness through the public API (jit + vmap, drafts sampled from q) ---

NUM_KEYS = 200_000
STAT_CONFIGS = {
    # name: (V, n, target style, draft style, seed, draft_length: "full" or "random")
    "dense-close": (4, 3, "dense", "close", 21, "full"),
    "sparse-sparse": (4, 3, "sparse", "sparse", 24, "full"),
    "peaked-far-padded": (4, 3, "peaked", "far", 23, "random"),
}


def _flat_laws(laws, count):
    vocab = laws[0].shape[-1]
    with np.errstate(divide="ignore"):  # zeros of sparse laws become -inf log-probs
        return [jnp.asarray(np.log(law.reshape(-1, vocab)), jnp.float32) for law in laws[:count]]


@functools.cache
def _simulate_fn(method, vocab, n, mode):
    """``fn(keys, lq_tables, lp_tables) -> (tokens, num_tokens)``: one verify_chain call per key
    on a chain drawn from the tables. The tables are arguments, not constants of the program, so
    the configurations of one shape (V, n, draft-length mode) share one compiled program."""

    def one(key, lq_tables, lp_tables):
        k_draft, k_len, k_verify = jax.random.split(key, 3)
        prefix, toks, lq, lp = jnp.zeros((), jnp.int32), [], [], []
        for i in range(n + 1):
            lp.append(lp_tables[i][prefix])
            if i < n:
                lq.append(lq_tables[i][prefix])
                toks.append(jax.random.categorical(jax.random.fold_in(k_draft, i), lq[-1]))
                prefix = prefix * vocab + toks[-1]
        x, lq, lp = jnp.stack(toks).astype(jnp.int32), jnp.stack(lq), jnp.stack(lp)
        length = n if mode == "full" else jax.random.randint(k_len, (), 0, n + 1)
        if mode == "random":  # padding is garbage: -inf rows and arbitrary tokens
            rows = jnp.arange(n + 1)[:, None]
            x = jnp.where(jnp.arange(n) < length, x, vocab - 1)
            lq = jnp.where(rows[:n] < length, lq, -jnp.inf)
            lp = jnp.where(rows <= length, lp, -jnp.inf)
        verdict = asps_jax.verify_chain(k_verify, x, lq, lp, method=method, draft_length=length)
        return verdict.tokens, verdict.num_tokens

    return jax.jit(jax.vmap(one, in_axes=(0, None, None)))


@functools.cache
def _simulation(name, method):
    vocab, n, tstyle, dstyle, seed, mode = STAT_CONFIGS[name]
    target, draft = _model(vocab, n, tstyle, dstyle, seed)
    lq_tables, lp_tables = _flat_laws(draft, n), _flat_laws(target, n + 1)
    keys = jax.random.split(jax.random.key(12345), NUM_KEYS)
    tokens, num = _simulate_fn(method, vocab, n, mode)(keys, tuple(lq_tables), tuple(lp_tables))
    return np.asarray(tokens), np.asarray(num), target, draft


@pytest.mark.slow
@pytest.mark.optimized  # the run of 200,000 keys outweighs its compile (tests/conftest.py)
@pytest.mark.parametrize("name", list(STAT_CONFIGS))
@pytest.mark.parametrize("method", METHODS)
def test_statistical_law_and_length(method, name):
    vocab, n, *_, mode = STAT_CONFIGS[name]
    tokens, num, target, draft = _simulation(name, method)
    lengths = [n] if mode == "full" else list(range(n + 1))
    law = tab.exact_emitted_law(method, target, draft, n, lengths)
    assert law.sum() == pytest.approx(1.0, abs=1e-12)
    index, size = tab.string_index(tokens, num, vocab)
    assert tab.chi_square_pvalue(index, size, law) > 1e-3
    # Mean emitted length within 4 standard errors of the exact E[L].
    string_len = np.repeat(np.arange(1, n + 2), [vocab ** (m + 1) for m in range(n + 1)])
    exact = float(np.dot(law, string_len))
    if mode == "full":
        assert exact == pytest.approx(EXPECTED_LENGTH[method](target, draft), abs=1e-12)
    mean, se, _ = statistics.mean_stderr(np.asarray(num))
    assert abs(float(mean) - exact) < 4 * float(se), (float(mean), exact, float(se))


@pytest.mark.slow
def test_statistical_test_tells_the_methods_apart():
    """Power check: ASpS samples are rejected against the SpS law (and vice versa)."""
    vocab, n, *_ = STAT_CONFIGS["dense-close"]
    for sampled, other in (("asps", "sps"), ("sps", "asps")):
        tokens, num, target, draft = _simulation("dense-close", sampled)
        law = tab.exact_emitted_law(other, target, draft, n, [n])
        index, size = tab.string_index(tokens, num, vocab)
        observed = np.bincount(index, minlength=size)
        impossible = observed[law == 0].sum() > 0
        assert impossible or tab.chi_square_pvalue(index, size, law) < 1e-6


# --- Properties ---


@functools.cache
def _runner(method):
    def run(keys, x, lq, lp, length):
        fn = functools.partial(asps_jax.verify_chain, method=method, draft_length=length)
        return jax.vmap(lambda k: fn(k, x, lq, lp))(keys)

    return jax.jit(run)


def _run_keys(method, x, lq, lp, num_keys=256, seed=0, draft_length=None):
    keys = jax.random.split(jax.random.key(seed), num_keys)
    length = jnp.int32(len(x) if draft_length is None else draft_length)
    out = _runner(method)(keys, x, lq, lp, length)
    return np.asarray(out.tokens), np.asarray(out.num_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_equal_laws_accept_everything_plus_bonus(method):
    rng = np.random.default_rng(4)
    vocab, n = 7, 4
    x, _, lp = tab.random_chain(rng, vocab, n, zeros=0.3)
    lq = lp[:n]
    x = np.array([rng.choice(vocab, p=np.exp(row)) for row in lq], np.int32)
    tokens, num = _run_keys(method, x, lq, lp, num_keys=2048)
    assert np.all(num == n + 1)
    np.testing.assert_array_equal(tokens[:, :n], np.broadcast_to(x, (2048, n)))
    assert np.all(np.isfinite(lp[n][tokens[:, n]]))  # the bonus follows p_{n+1}'s support


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_same_key_same_output(method):
    rng = np.random.default_rng(5)
    x, lq, lp = tab.random_chain(rng, 6, 4)
    a = _run_keys(method, x, lq, lp, seed=3)
    b = _run_keys(method, x, lq, lp, seed=3)
    c = _run_keys(method, x, lq, lp, seed=4)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])
    # Outside any batch (no vmap), key 7 of the batch gives that row's result.
    single = jax.jit(functools.partial(asps_jax.verify_chain, method=method))
    alone = single(jax.random.split(jax.random.key(3), 256)[7], x, lq, lp)
    np.testing.assert_array_equal(alone.tokens, a[0][7])


def test_asps_table_sums_to_one_in_float32():
    rng = np.random.default_rng(6)
    for zeros in (0.0, 0.5):
        x, lq, lp = tab.random_chain(rng, 50, 8, zeros)
        for length in (0, 3, 8):
            stop, full = _jit_outcome("asps")(x, lq, lp, jnp.int32(length))
            assert stop.dtype == jnp.float32
            total = float(jnp.exp(stop).sum() + jnp.exp(full))
            assert total == pytest.approx(1.0, abs=1e-5)


EDGE_CASES = {
    # name: (draft tokens, draft probs, target probs, expected tokens or None, expected num)
    "point-masses-agree": (
        [2, 0],
        [[0, 0, 1], [1, 0, 0]],
        [[0, 0, 1], [1, 0, 0], [0, 1, 0]],
        [2, 0, 1],
        3,
    ),
    "target-zero-at-draft": (
        [0, 1],
        [[1, 0, 0], [0, 1, 0]],
        [[0, 0, 1], [0, 1, 0], [1, 0, 0]],
        [2],
        1,
    ),
    "residual-all-zero": ([0], [[0.5, 0.5, 0]], [[0.25, 0.5, 0], [0, 0, 1]], None, None),
    "draft-length-zero": (
        [1, 1],
        [[0, 1, 0], [0, 1, 0]],
        [[0, 0, 1], [1, 0, 0], [1, 0, 0]],
        [2],
        1,
    ),
    "n-equals-one": ([1], [[0.2, 0.8, 0]], [[0.5, 0.5, 0], [0, 0, 1]], None, None),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EDGE_CASES))
@pytest.mark.parametrize("method", METHODS)
def test_edge_cases_never_nan(method, name):
    x, q, p, want_tokens, want_num = EDGE_CASES[name]
    x = np.asarray(x, np.int32)
    with np.errstate(divide="ignore"):
        lq, lp = np.log(np.asarray(q, np.float32)), np.log(np.asarray(p, np.float32))
    length = 0 if name == "draft-length-zero" else len(x)
    stop, full = _jit_outcome(method)(x, lq, lp, jnp.int32(length))
    assert not np.isnan(np.asarray(stop)).any() and not np.isnan(float(full))
    tokens, num = _run_keys(method, x, lq, lp, num_keys=4096, draft_length=length)
    assert np.all((num >= 1) & (num <= length + 1))
    last = tokens[np.arange(len(num)), num - 1]
    assert np.all((last >= 0) & (last < lq.shape[1]))
    # The last token always lies in the support of the target row it was drawn for.
    assert np.all(np.isfinite(lp[np.minimum(num - 1, length), last]))
    if want_tokens is not None:
        assert np.all(num == want_num)
        np.testing.assert_array_equal(
            tokens[:, :want_num], np.broadcast_to(want_tokens, (4096, want_num))
        )
    if name == "residual-all-zero" and method == "sps":
        # p(x) < q(x) rejects half the time; the residual (p - q)_+ is empty (p is unnormalised,
        # as rounding can make it) and the fallback recovers from p: tokens 0 and 1 as 1 : 2.
        # (ASpS meets the same event as an all-zero stop row and keeps the draft; any law is
        # exact for an event of probability zero, docs/algorithms.md §1.)
        rejected = num == 1
        assert 0.45 < rejected.mean() < 0.55
        assert 0.28 < (tokens[rejected, 0] == 0).mean() < 0.39


@pytest.mark.slow
def test_empty_chain_emits_one_target_token():
    with np.errstate(divide="ignore"):
        lp = np.log(np.array([[0.0, 1.0, 0.0]], np.float32))
    x, lq = np.zeros(0, np.int32), np.zeros((0, 3), np.float32)
    for method in METHODS:
        tokens, num = _run_keys(method, x, lq, lp, num_keys=8)
        assert np.all(num == 1) and np.all(tokens[:, 0] == 1)


# --- Bad input ---

GOOD = (
    np.zeros(3, np.int32),
    np.full((3, 4), np.log(0.25), np.float32),
    np.full((4, 4), np.log(0.25), np.float32),
)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(draft_tokens=np.zeros((1, 3), np.int32)), "draft_tokens"),
        (dict(draft_logprobs=np.zeros((2, 4), np.float32)), "draft_logprobs"),
        (dict(draft_logprobs=np.zeros((3,), np.float32)), "draft_logprobs"),
        (dict(target_logprobs=np.zeros((3, 4), np.float32)), "target_logprobs"),
        (dict(target_logprobs=np.zeros((4, 5), np.float32)), "target_logprobs"),
        (dict(method="tmc"), "method"),
        (dict(draft_length=-1), "draft_length"),
        (dict(draft_length=4), "draft_length"),
        (dict(draft_length=np.array([1, 2])), "draft_length"),
    ],
)
def test_bad_input_raises(change, match):
    args = dict(zip(("draft_tokens", "draft_logprobs", "target_logprobs"), GOOD, strict=True))
    args.update(change)
    kwargs = {k: args.pop(k) for k in ("method", "draft_length") if k in args}
    with pytest.raises(ValueError, match=match):
        asps_jax.verify_chain(jax.random.key(0), *args.values(), **kwargs)


def test_bad_draft_length_under_jit_raises():
    fn = jax.jit(lambda n: asps_jax.verify_chain(jax.random.key(0), *GOOD, draft_length=n))
    with pytest.raises(ValueError, match="draft_length"):
        fn(np.zeros(2, np.int32))


# --- statistics on verdicts ---


@pytest.mark.slow
def test_tokens_per_step_literal():
    mean, se, count = statistics.mean_stderr(np.array([1, 2, 3, 4]))
    assert (float(mean), int(count)) == (2.5, 4)
    assert float(se) == pytest.approx(np.sqrt(5.0 / 3.0 / 4.0), rel=1e-6)
    keys = jax.random.split(jax.random.key(0), 8)
    verdicts = jax.jit(jax.vmap(lambda k: asps_jax.verify_chain(k, *GOOD)))(keys)
    np.testing.assert_array_equal(verdicts.num_tokens, np.full(8, 4))  # q == p
    mean, se = statistics.tokens_per_step(verdicts)
    assert (float(mean), float(se)) == (4.0, 0.0)
    with pytest.raises(ValueError, match="no step"):
        statistics.tokens_per_step(dataclasses.replace(verdicts, num_tokens=np.zeros(0)))


def test_expected_length_bad_input():
    target, draft = _model(4, 2, "dense", "close", seed=0)
    with pytest.raises(ValueError, match="target_laws"):
        statistics.expected_length_sps(target[:1], draft)
    with pytest.raises(ValueError, match=r"draft_laws\[1\]"):
        statistics.expected_length_asps(target, [draft[0], draft[0]])
    with pytest.raises(ValueError, match="vocabulary"):
        statistics.expected_length_sps([np.full((5,), 0.2), np.full((5, 5), 0.2)], draft)
    assert statistics.expected_length_sps(target, draft[:0]) == 1.0
