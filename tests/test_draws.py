"""Exact draws (asps_jax/draws.py): the bits -> token and bits -> decision maps, proved on exact
rationals, against the float32 paths they replace; and chi-square checks of the samplers."""

from __future__ import annotations

import pathlib
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import asps_jax
from asps_jax import draws

# A law whose tokens lie 0..40 nats below the top (and one impossible token).
FAR_LOGITS = np.array([0.0, -1.0, -25.0, -2.5, -30.0, -35.0, -40.0, -np.inf, -0.5], np.float32)
FAR_TOKENS = (2, 4, 5, 6)


def _int(digits) -> int:
    """The integer whose base-2^20 digits (most significant first) are ``digits``."""
    value = 0
    for d in np.asarray(digits).tolist():
        value = (value << draws.DIGIT_BITS) + int(d)
    return value


def _to_digits(value: int) -> jnp.ndarray:
    out = []
    for _ in range(draws.NUM_DIGITS):
        out.append(value & ((1 << draws.DIGIT_BITS) - 1))
        value >>= draws.DIGIT_BITS
    return jnp.asarray(out[::-1], jnp.int32)


# The far-tail law twice over 300 tokens: three blocks of draws.BLOCK, the last one short.
_RNG = np.random.default_rng(9)
LONG_LOGITS = np.concatenate([_RNG.normal(0, 3, 291), FAR_LOGITS]).astype(np.float32)


# 320 tokens: a draw's blocks are 40 wide (block_width), the table's 128.
BLOCKS_LOGITS = np.concatenate([_RNG.normal(0, 3, 311), FAR_LOGITS]).astype(np.float32)


@pytest.mark.parametrize(
    "logits",
    [FAR_LOGITS, LONG_LOGITS, BLOCKS_LOGITS],
    ids=["one_block", "three_blocks", "other_blocks"],
)
def test_far_tail_token_measure_is_its_probability(logits):
    """Deterministic proof on exact rationals: the R values mapping to token y are exactly
    [cum_{y-1}, cum_y), so after rejection of R >= T its law is W_y / T; for tokens 25..40 nats
    below the top that is w_y / sum(w) within 2^-40 relative (w = the float32 weights drawn from,
    as exact rationals), and every token is within 2^-(BITS-2) absolute."""
    weights = jnp.exp(jnp.asarray(logits))
    table = jax.jit(draws.categorical_table)(weights)
    digits, block_cum = (np.asarray(a) for a in table)
    vocab = len(logits)
    assert digits.shape[1:] == ((1, vocab) if vocab <= draws.BLOCK else (3, draws.BLOCK))
    assert draws.block_width(vocab) == {9: 9, 300: 128, 320: 40}[vocab]
    int_w = [_int(digits[:, i // digits.shape[2], i % digits.shape[2]]) for i in range(vocab)]
    total = _int(block_cum[:, -1])
    assert total == sum(int_w) and 0 < total < 1 << draws.BITS
    exact_w = [Fraction(float(w)) for w in np.asarray(weights)]
    exact_total = sum(exact_w)
    index = jax.jit(draws.index_from_digits)
    blocks = jax.jit(draws.weight_blocks)(weights)  # what a draw runs: no table, other blocks
    by_blocks = jax.jit(draws.index_from_blocks)
    assert _int(blocks[1][:, -1]) == total
    cum = 0
    for y in range(vocab):
        law = Fraction(int_w[y], total)
        target = exact_w[y] / exact_total
        assert abs(law - target) <= Fraction(1, 1 << (draws.BITS - 2)), y
        if y - (vocab - len(FAR_LOGITS)) in FAR_TOKENS:
            assert law > 0 and abs(law / target - 1) < Fraction(1, 1 << 40), (y, float(law))
        if int_w[y]:  # the first and the last R of the interval map to y, the next R does not
            for f, t in ((index, table), (by_blocks, blocks)):
                assert int(f(t, _to_digits(cum))) == y
                assert int(f(t, _to_digits(cum + int_w[y] - 1))) == y
                if cum + int_w[y] < total:
                    assert int(f(t, _to_digits(cum + int_w[y]))) != y
        cum += int_w[y]
    assert int_w[vocab - 2] == 0  # -inf: never drawn


def test_old_gumbel_path_cannot_reach_a_token_25_nats_down():
    """jax.random.categorical's Gumbel is -log(-log(u)) with u a float32 uniform in
    [tiny, 1 - 2^-23]: its range is under 20.5 nats, so logit -25 never beats logit 0."""
    u_max = jnp.float32(1.0) - jnp.float32(2.0**-23)
    u_min = jnp.finfo(jnp.float32).tiny
    g_max = float(-jnp.log(-jnp.log(u_max)))
    g_min = float(-jnp.log(-jnp.log(jnp.float32(u_min))))
    assert g_max - g_min < 20.5
    assert FAR_LOGITS[2] + g_max < FAR_LOGITS[0] + g_min
    gumbel = jax.random.gumbel(jax.random.key(0), (1 << 20,), jnp.float32)
    assert float(gumbel.max()) <= g_max and float(gumbel.min()) >= g_min


def _sample_counts(fn, num, minlength):
    keys = jax.random.split(jax.random.key(11), num)
    out = np.asarray(jax.jit(jax.vmap(fn))(keys))
    return np.bincount(out.reshape(-1), minlength=minlength)


@pytest.mark.slow
def test_draw_categorical_follows_the_law():
    rng = np.random.default_rng(0)
    law = rng.dirichlet(np.full(40, 0.5))
    law[::7] = 0.0
    law /= law.sum()
    logprobs = jnp.log(jnp.asarray(law, jnp.float32))
    counts = _sample_counts(lambda k: draws.draw_categorical(k, logprobs), 50_000, 40)
    assert np.all(counts[law == 0] == 0)
    pos = law > 0
    assert stats.chisquare(counts[pos], 50_000 * law[pos] / law[pos].sum()).pvalue > 1e-4
    # Weights need not be normalised; batched rows are independent and follow their own law.
    both = jax.jit(draws.draw_from_weights)(jax.random.key(1), jnp.asarray([[0, 3.0], [5.0, 0]]))
    assert np.asarray(both).tolist() == [1, 0]
    empty = jax.jit(draws.draw_categorical)(jax.random.key(2), jnp.full((4,), -jnp.inf))
    assert int(empty) == 0


@pytest.mark.slow
def test_rounding_of_a_normalised_law_changes_almost_no_draw():
    """The same key on weights that differ by float rounding gives the same token (one device
    against a mesh). A law summing to just under 1 on one side and just over on the other is the
    case that matters: a scale taken from the sum itself would change about half of the draws."""
    rng = np.random.default_rng(5)
    law = rng.dirichlet(np.full(12, 0.7)).astype(np.float32)
    under = law / np.float32(np.sum(law, dtype=np.float64) * (1 + 2.0**-22))
    over = law / np.float32(np.sum(law, dtype=np.float64) * (1 - 2.0**-22))
    assert under.sum(dtype=np.float32) < 1.0 < over.sum(dtype=np.float32)
    keys = jax.random.split(jax.random.key(3), 4096)
    draw = jax.jit(jax.vmap(draws.draw_from_weights, in_axes=(0, None)))
    a, b = np.asarray(draw(keys, jnp.asarray(under))), np.asarray(draw(keys, jnp.asarray(over)))
    assert np.mean(a != b) < 1e-3
    # The same on the (K+1)-way choice of a verifier node: weights summing to about 1.
    choice = np.asarray([0.25, 0.5, 0.25 - 2.0**-24], np.float32)
    nudged = np.nextafter(choice, np.float32(1.0))
    assert choice.sum(dtype=np.float32) < 1.0 <= nudged.sum(dtype=np.float32)
    a, b = np.asarray(draw(keys, jnp.asarray(choice))), np.asarray(draw(keys, jnp.asarray(nudged)))
    assert np.mean(a != b) < 1e-3


@pytest.mark.slow
def test_draw_without_replacement_law():
    q = np.array([0.1, 0.2, 0.3, 0.4])
    counts = _sample_counts(
        lambda k: (lambda x: x[0] * 4 + x[1])(draws.draw_without_replacement(k, jnp.log(q), 2)),
        40_000,
        16,
    )
    expected = np.array(
        [q[a] * q[b] / (1 - q[a]) if a != b else 0.0 for a in range(4) for b in range(4)]
    )
    off = expected > 0
    assert np.all(counts[~off] == 0)
    assert stats.chisquare(counts[off], 40_000 * expected[off]).pvalue > 1e-4
    # Fewer positive-mass tokens than draws: the rest are distinct zero-mass tokens.
    draw = jax.jit(draws.draw_without_replacement, static_argnums=2)
    out = np.asarray(draw(jax.random.key(0), jnp.log(q * [1, 0, 0, 1]), 4))
    assert sorted(out.tolist()) == [0, 1, 2, 3] and set(out[:2].tolist()) == {0, 3}


RATIOS = [
    3.25 * 2.0**-23,  # just above a multiple of 2^-23
    (2**20 + 0.5) * 2.0**-23,
    0.3,
    2.0**-31 * 1.5,  # below 2^-30
    2e-38,  # near the smallest normal float32 (subnormals may be flushed to zero)
]


@pytest.mark.parametrize("ratio", RATIOS)
def test_accept_bits_to_decision_map(ratio):
    """The accepting (a, b) bit patterns are exactly those with a 2^32 + b < ceil(r 2^64): checked
    at the boundary and on random patterns; its measure is within 2^-64 of r, while the float32
    uniform (u = k 2^-23, k < 2^23, the old path) accepts with measure ceil(r 2^23) / 2^23."""
    r32 = np.float32(ratio)
    r = Fraction(float(r32))
    bound = -((-r * (1 << 64)) // 1)  # ceil(r 2^64)
    decide = jax.jit(draws.accept_from_bits)
    patterns = [bound - 1, bound, bound + 1, 0] + [
        int(v) for v in np.random.default_rng(1).integers(0, 1 << 63, 64, dtype=np.uint64)
    ]
    patterns += [max(bound - d, 0) for d in (2, 1 << 20, 1 << 40)]
    a = jnp.asarray([p >> 32 for p in patterns], jnp.uint32)
    b = jnp.asarray([p & 0xFFFFFFFF for p in patterns], jnp.uint32)
    got = np.asarray(decide(jnp.stack([a, b]), jnp.full(len(patterns), r32)))
    assert got.tolist() == [p < bound for p in patterns]
    new_bias = abs(Fraction(bound, 1 << 64) - r)
    assert new_bias < Fraction(1, 1 << 64)
    k = np.arange(1 << 23, dtype=np.float64) * 2.0**-23  # every float32 uniform value
    old_bias = abs(Fraction(int(np.sum(k < float(r32))), 1 << 23) - r)
    assert old_bias > Fraction(1, 1 << 40)


@pytest.mark.slow
def test_accept_strict_and_statistical():
    keys = jax.random.split(jax.random.key(5), 200_000)
    never = jax.jit(jax.vmap(lambda k: draws.accept(k, 0.0, 0.0)))(keys)
    assert not np.any(np.asarray(never))
    always = jax.jit(jax.vmap(lambda k: draws.accept(k, 1e-30, 0.0)))(keys)
    assert np.all(np.asarray(always))
    logs = jax.jit(jax.vmap(lambda k: draws.accept_log(k, -jnp.inf, -jnp.inf)))(keys)
    assert not np.any(np.asarray(logs))
    freq = np.asarray(jax.jit(jax.vmap(lambda k: draws.accept(k, 0.3, 1.0)))(keys)).mean()
    assert abs(freq - 0.3) < 5 * np.sqrt(0.21 / 200_000)
    freq = np.asarray(jax.jit(jax.vmap(lambda k: draws.accept_log(k, np.log(0.2), 0.0)))(keys))
    assert abs(freq.mean() - 0.2) < 5 * np.sqrt(0.16 / 200_000)


def test_no_module_draws_with_jax_random_categorical():
    """Every token, stop and pick of the package is drawn by this module: jax.random.categorical
    (default mode) never reaches a token ~20 nats below the top (the test above), so the law drawn
    would differ from the law the verifiers use. No module may call it."""
    root = pathlib.Path(asps_jax.__file__).parent
    offenders = [
        str(path.relative_to(root))
        for path in sorted(root.rglob("*.py"))
        if "random.categorical(" in path.read_text()
    ]
    assert offenders == []
