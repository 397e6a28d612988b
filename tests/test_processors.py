"""process_logits vs a NumPy float64 reference and transformers' warpers; argument checks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from asps_jax.controls.processors import (
    SamplingParams,
    process_logits,
    process_logits_from_top,
    sample_token,
    validate_sampling_args,
)


def reference(logits, temperature=1.0, top_k=None, top_p=None):
    """NumPy float64 reference, one row at a time, written from the documented semantics.

    Order temperature -> top-k -> top-p. Top-k keeps every logit >= the k-th largest (ties kept).
    Top-p keeps a token iff the mass of the tokens strictly more likely than it is < top_p, which
    is transformers' rule with ties at the cut kept, and always keeps the most likely token.
    """
    x = np.array(logits, np.float64)
    x[np.isnan(x)] = -np.inf
    vocab = x.shape[-1]
    if temperature == 0:
        out = np.full(vocab, -np.inf)
        out[int(np.argmax(x))] = 0.0
        return out
    x = x / temperature
    if top_k is not None and 0 < top_k < vocab:
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    if top_p is not None and top_p < 1.0 and np.isfinite(x).any():
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        above = np.array([probs[x > v].sum() for v in x])
        x = np.where(above < top_p, x, -np.inf)
    if not np.isfinite(x).any():
        return np.full(vocab, -np.inf)
    return x - x.max() - np.log(np.sum(np.exp(x - x.max())))


def assert_matches(got, want, atol=2e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], atol=atol, rtol=0)


@functools.cache
def _jitted(per_row=False):
    fn = jax.vmap(process_logits, in_axes=(0, None, None, None)) if per_row else process_logits
    return jax.jit(fn)


def run(logits, temperature=1.0, top_k=None, top_p=None, per_row=False):
    """process_logits under jit with traced sampling parameters (None stays static).

    ``per_row`` maps single rows ``[V]`` with vmap instead of passing the batch ``[..., V]``.
    """
    logits = jnp.asarray(logits, jnp.float32)
    if not per_row:
        return _jitted()(logits, temperature, top_k, top_p)
    rows = logits.reshape(-1, logits.shape[-1])
    return _jitted(True)(rows, temperature, top_k, top_p).reshape(logits.shape)


def test_temperature():
    logits = np.random.default_rng(0).normal(size=(6, 40)) * 3
    for t in (0.3, 1.0, 2.5):
        got = run(logits, t)
        for row in range(6):
            assert_matches(got[row], reference(logits[row].astype(np.float32), t))


def test_top_k_keeps_ties():
    logits = np.array([3.0, 1.0, 3.0, 2.0, 3.0, 0.0, -np.inf])
    for k, kept in ((1, 3), (2, 3), (3, 3), (4, 4), (5, 5), (6, 6), (0, 6), (7, 6), (99, 6)):
        got = np.asarray(run(logits, 1.0, k))
        assert_matches(got, reference(logits, 1.0, k))
        assert np.isfinite(got).sum() == kept, k


def test_top_p_keeps_at_least_one_token():
    logits = np.array([0.5, 2.0, 1.0, 2.0 - 1e-3, -1.0])
    got = np.asarray(run(logits, 1.0, None, 1e-6))
    np.testing.assert_array_equal(np.isfinite(got), [False, True, False, False, False])
    assert got[1] == 0.0
    for p in (0.2, 0.45, 0.6, 0.9, 0.99, 1.0):
        assert_matches(run(logits, 1.0, None, p), reference(logits, 1.0, None, p))


def test_top_p_ties_at_the_cut_are_kept():
    # Two tokens of mass ~0.4 tied at the cut: both stay (the documented choice).
    logits = np.log(np.array([0.4, 0.1, 0.4, 0.1]))
    got = np.asarray(run(logits, 1.0, None, 0.5))
    np.testing.assert_array_equal(np.isfinite(got), [True, False, True, False])


@pytest.mark.slow
def test_neg_inf_and_nan_logits():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(5, 12))
    logits[0, :5] = -np.inf
    logits[1, :] = -np.inf
    logits[1, 7] = 0.3  # one finite token
    logits[2, [1, 4]] = np.nan
    logits[3, :] = -np.inf  # no finite token: stays all -inf, never NaN
    logits[4, ::2] = np.nan
    for args in ((1.0, None, None), (0.7, 4, None), (1.3, None, 0.8), (0.9, 20, 0.5)):
        got = run(logits, *args)
        for row in range(5):
            assert_matches(got[row], reference(logits[row], *args))
    assert np.all(np.asarray(run(logits, 1.0))[1] == np.where(np.arange(12) == 7, 0.0, -np.inf))


def test_temperature_zero_is_a_point_mass_on_the_first_argmax():
    logits = np.array([[1.0, 4.0, -2.0, 4.0], [np.nan, 0.0, 2.0, 2.0], [-np.inf, -1.0, -np.inf, 0]])
    want = np.array([1, 2, 3])
    for top_k, top_p in ((None, None), (1, 0.3)):
        got = np.asarray(run(logits, 0.0, top_k, top_p))
        assert_matches(got, np.stack([reference(row, 0.0) for row in logits]))
        np.testing.assert_array_equal(np.argmax(got, -1), want)
        np.testing.assert_array_equal(np.isfinite(got).sum(-1), [1, 1, 1])


@pytest.mark.slow
def test_combined_against_reference_with_batch_axes():
    rng = np.random.default_rng(2)
    logits = (rng.normal(size=(2, 3, 30)) * 2).astype(np.float32)
    for args in ((0.8, 5, 0.9), (1.7, 12, 0.6), (1.0, 3, 0.999), (0.5, 29, 0.3)):
        got = np.asarray(run(logits, *args))
        assert got.shape == logits.shape
        for i in range(2):
            for j in range(3):
                assert_matches(got[i, j], reference(logits[i, j], *args))


def test_thresholds_on_ties_signed_zeros_and_extremes():
    """The filters find their thresholds by bisection over the logits' bit patterns, not a sort:
    per-row top-k / top-p on rows full of ties, -inf, +-0.0, +-1e30 and small or huge spreads
    (every k from 0 to V + 1, top_p from 1e-9 to 1) keep exactly the reference's support, and
    the same law. One jitted call for all rows."""
    rng = np.random.default_rng(7)
    rows, vocab = 512, 40
    kinds = [
        lambda: rng.integers(-3, 3, vocab).astype(np.float64),  # heavy ties
        lambda: rng.choice([0.0, -0.0, 1e30, -1e30, 1.0, -np.inf], vocab),
        lambda: rng.normal(size=vocab) * rng.choice([1e-3, 1.0, 1e30]),
        lambda: np.where(rng.random(vocab) < 0.6, -np.inf, rng.normal(size=vocab)),
    ]
    logits = np.stack([kinds[r % 4]() for r in range(rows)]).astype(np.float32)
    logits[::97] = -np.inf  # rows with no finite logit stay all -inf
    temperature = rng.choice([0.5, 1.0, 3.0], rows).astype(np.float32)
    top_k = rng.integers(0, vocab + 2, rows).astype(np.int32)
    top_p = rng.choice([1e-9, 0.1, 0.5, 0.9, 0.999, 1.0], rows).astype(np.float32)
    got = np.asarray(jax.jit(jax.vmap(process_logits))(logits, temperature, top_k, top_p))
    for b in range(rows):
        want = reference(logits[b], float(temperature[b]), int(top_k[b]), float(top_p[b]))
        with np.errstate(invalid="ignore", over="ignore"):
            np.testing.assert_array_equal(np.isneginf(got[b]), np.isneginf(want), err_msg=str(b))
            # the law (log-probs past float32's range, -6e38 in float64, are 0 either way)
            np.testing.assert_allclose(np.exp(got[b]), np.exp(want), atol=1e-6, err_msg=str(b))


def test_thresholds_from_the_top_64_equal_the_bisection_where_flagged_exact():
    """process_logits_from_top reads both cuts off each row's 64 largest logits: on rows of 300
    logits (ties, -inf, +-0.0, huge spreads; k around 64, top_p from 1e-9 to 1, min-p) every row
    it flags exact equals the bisection bit for bit and the float64 reference; it flags exact
    every row whose cut must lie among those 64 (k <= 64 or top-k off with top_p = 1, greedy),
    and no row with 64 < k < V. SamplingParams.process, which takes the fast output only when
    the whole batch is exact, equals the bisection on a batch with and without such rows."""
    rng = np.random.default_rng(11)
    rows, vocab = 480, 300
    kinds = [
        lambda: rng.integers(-3, 3, vocab).astype(np.float64),  # heavy ties
        lambda: rng.choice([0.0, -0.0, 1e30, -1e30, 1.0, -np.inf], vocab),
        lambda: rng.normal(size=vocab) * rng.choice([1e-3, 1.0, 5.0, 1e30]),
        lambda: np.where(rng.random(vocab) < 0.6, -np.inf, rng.normal(size=vocab) * 4),
    ]
    logits = np.stack([kinds[r % 4]() for r in range(rows)]).astype(np.float32)
    temperature = rng.choice([0.0, 0.5, 1.0, 3.0], rows).astype(np.float32)
    top_k = rng.choice([0, 1, 5, 50, 63, 64, 65, 200, vocab, vocab + 1], rows).astype(np.int32)
    top_p = rng.choice([1e-9, 0.1, 0.5, 0.9, 0.999, 1.0], rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.05], rows).astype(np.float32)
    args = (logits, temperature, top_k, top_p, min_p)
    want = np.asarray(jax.jit(jax.vmap(process_logits))(*args))
    got, exact = map(np.asarray, jax.jit(jax.vmap(process_logits_from_top))(*args))
    k_off = (top_k <= 0) | (top_k >= vocab)
    assert exact[(temperature == 0) | ((top_k <= 64) & ~k_off & (top_p == 1.0))].all()
    assert exact[k_off & (top_p == 1.0)].all()
    assert not exact[(top_k > 64) & (top_k < vocab) & (temperature > 0)].any()
    assert 0.5 < exact.mean() < 1.0  # both kinds of rows are present
    for b in np.flatnonzero(exact):
        np.testing.assert_array_equal(got[b], want[b], err_msg=str(b))
        if min_p[b] == 0:
            ref = reference(logits[b], float(temperature[b]), int(top_k[b]), float(top_p[b]))
            np.testing.assert_array_equal(np.isneginf(got[b]), np.isneginf(ref), err_msg=str(b))

    def processed(b):
        sampling = SamplingParams.make(len(b), temperature[b], top_k[b], top_p[b], min_p=min_p[b])
        return np.asarray(jax.jit(lambda s, x: s.process(x))(sampling, logits[b][:, None]))[:, 0]

    # a row the fast path gets wrong: the batch holding it must take the bisection
    wrong = [b for b in np.flatnonzero(~exact) if not np.array_equal(got[b], want[b])]
    assert wrong
    for batch in (
        np.flatnonzero(exact)[:8],
        np.concatenate([np.flatnonzero(exact)[:7], wrong[:1]]),
    ):
        np.testing.assert_array_equal(processed(batch), want[batch])


def _transformers(logits, temperature, top_k, top_p):
    scores = torch.from_numpy(np.asarray(logits, np.float32))
    for warper in (
        TemperatureLogitsWarper(float(temperature)),
        TopKLogitsWarper(top_k) if top_k else None,
        TopPLogitsWarper(top_p) if top_p is not None else None,
    ):
        if warper is not None:
            scores = warper(None, scores)
    return torch.log_softmax(scores.double(), dim=-1).numpy()


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, None, None), (0.6, None, None), (1.0, 10, None), (1.0, None, 0.9), (0.7, 50, 0.8),
     (1.4, 200, 0.95), (0.9, 7, 0.5), (2.0, None, 0.3)],
)  # fmt: skip
def test_matches_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(3)).numpy() * 2.5
    assert_matches(
        run(logits, temperature, top_k, top_p), _transformers(logits, temperature, top_k, top_p)
    )


def test_top_p_after_top_k_ties_matches_transformers():
    """Regression: top-p must see every token top-k kept, ties at the k-th value included."""
    logits = np.array([[2.0, 1.9, 0.0, 0.0]], np.float32)
    want = _transformers(logits, 1.0, 3, 0.475)
    assert_matches(run(logits, 1.0, 3, 0.475), want)
    assert_matches(run(logits, 1.0, 3, 0.475)[0], reference(logits[0], 1.0, 3, 0.475))


@pytest.mark.slow
def test_overflowing_temperature_keeps_the_largest_logit():
    logits = np.array([3e38, 1.0, -2.0], np.float32)
    got = np.asarray(process_logits(logits, 0.5))
    np.testing.assert_array_equal(np.exp(got), [1.0, 0.0, 0.0])


@pytest.mark.slow
def test_batched_input_under_rank_promotion_raise():
    """Regression: batched input used to raise under jax_numpy_rank_promotion='raise'."""
    logits = np.random.default_rng(4).normal(size=(3, 2, 9)).astype(np.float32)
    for temperature in (0.8, 0.0):
        got = process_logits(logits, temperature, 4, 0.9)
        want = run(logits, temperature, 4, 0.9, per_row=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow
def test_sample_token_follows_the_law():
    with np.errstate(divide="ignore"):
        logprobs = np.log(np.array([0.1, 0.0, 0.6, 0.3], np.float32))
    keys = jax.random.split(jax.random.key(0), 20000)
    tokens = np.asarray(jax.jit(jax.vmap(lambda k: sample_token(k, logprobs)))(keys))
    assert tokens.dtype == np.int32
    freq = np.bincount(tokens, minlength=4) / tokens.size
    np.testing.assert_allclose(freq, [0.1, 0.0, 0.6, 0.3], atol=0.015)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.2), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
    ],
)
def test_validate_sampling_args_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        validate_sampling_args(**kwargs)


def test_validate_sampling_args_accepts():
    validate_sampling_args()
    validate_sampling_args(temperature=0.0, top_k=0, top_p=1.0)
    validate_sampling_args(temperature=1.3, top_k=50, top_p=0.9)
