"""Exact random draws: categorical (with and without replacement) and Bernoulli accept tests.

``jax.random.categorical`` (default mode) perturbs each logit by a Gumbel built from one float32
uniform, so a token more than ~20.4 nats below the top logit is never drawn; a float32 uniform
``u = k 2^-23`` makes ``u < r`` accept with probability ``ceil(r 2^23) / 2^23``
(docs/algorithms.md §3.10, "Exactness traps"). Both make the law that is *drawn* differ from the
law the verifier *uses*. The helpers here replace them everywhere a token or a decision is drawn.

**Categorical** (:func:`draw_categorical`, :func:`draw_from_weights`): inverse CDF in integer
arithmetic. The float32 weights ``w_i`` (``exp(logprobs - max)``, or the given weights) are scaled
by ``2^(BITS - 1 - e)``, ``e`` the exponent with ``2^(e-1) <= 3 sum(w) / 4 < 2^e``, and written as
``NUM_DIGITS`` base-2^20 digits, ``W_i = floor(w_i 2^(BITS - 1 - e))`` with ``BITS = 20
NUM_DIGITS`` (exact float32 operations: scaling by a power of two, ``floor`` and ``x - floor(x)``).
The cumulative sums are int32 per digit, carried into canonical digits, and a uniform integer
``R < 2^BITS`` (``NUM_DIGITS`` x 20 random bits) is redrawn until ``R < T = sum(W)``; as
``2^BITS / 3 <= T < 2^BITS * 2 / 3`` that takes at most 3 tries on average. The token is the
number of ``i`` with ``cum_i <= R``. The drawn law is therefore exactly ``W_i / T``: every token's
probability is within ``3 max(1, V w_i / sum(w)) 2^-BITS`` of ``w_i / sum(w)`` (absolute), a token
40 nats below the top of a small vocabulary is drawn with relative error below ``2^-40``, and a
token of weight 0 is never drawn. One pass over V (no sort, no V-sized random bits);
:func:`categorical_table` and :func:`index_from_digits` are the pure
bits -> token map the tests enumerate. A draw runs the same map without the table
(:func:`weight_blocks`, :func:`index_from_blocks`): block totals summed from digits made on the
fly, and the digits of the one block the search enters, so it holds 4 bytes per vocabulary entry
(the scaled weights) instead of 24, and a vocabulary split over chips exchanges block totals.

The scale ``2^-e`` changes only where ``sum(w)`` crosses ``4/3 * 2^k``, never near the sum 1 of a
normalised law or of the verifiers' (K+1)-way choice. Between those points the map from random
bits to tokens moves with the weights only at the cumulative boundaries, so two runs whose weights
differ by float rounding (one device against a mesh, a row alone against a batch) draw the same
token unless the bits land within that rounding of a boundary. Were the scale taken from ``sum(w)``
itself, a law summing to ``1 - 2^-24`` on one device and ``1 + 2^-23`` on another would halve the
map and change most draws: the same key would not give the same tokens.

**Bernoulli** (:func:`accept`, :func:`accept_log`): ``U = (a 2^32 + b) 2^-64`` from two uint32
words is compared with the float32 ratio ``r`` exactly in integers, so ``P(accept) =
ceil(r 2^64) / 2^64``: bias below ``2^-64``, never accepts when ``r = 0``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NUM_DIGITS = 6
DIGIT_BITS = 20
BITS = NUM_DIGITS * DIGIT_BITS  # resolution of the integer inverse CDF: 120 bits
BLOCK = 128  # tokens per block of the two-level search (the vocabulary's size when smaller)
MAX_VOCAB = BLOCK << 11  # block-level int32 cumsums of 20-bit digits stay below 2^31
_DIGIT_MASK = (1 << DIGIT_BITS) - 1


def _pow2(exponent: jax.Array) -> jax.Array:
    """``2.0 ** exponent`` as float32, exactly (built from the exponent bits), for [-126, 127]."""
    biased = (jnp.clip(exponent, -126, 127) + 127).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.left_shift(biased, 23), jnp.float32)


def _scaled(weights_V: jax.Array) -> jax.Array:
    """float32 ``w_i 2^(DIGIT_BITS - e)`` (exact), ``2^e`` a power of two with ``sum(w) <=
    2^(e-1)``: the weights on the scale of their leading digit; non-finite or negative as 0."""
    w = jnp.asarray(weights_V, jnp.float32)
    w = jnp.where(jnp.isfinite(w) & (w > 0), w, 0.0)
    # 3 sum / 4 < 2^e, so T = sum(W) < 2^BITS * 2 / 3 (room for rounding) and T >= 2^BITS / 3.
    # The scale changes where sum = 4/3 * 2^k, far from the sum 1 of a normalised law.
    _, exponent = jnp.frexp(jnp.sum(w) * 0.75)
    return w * _pow2(DIGIT_BITS - exponent.astype(jnp.int32) - 1)


def _digits(weights_V: jax.Array) -> jax.Array:
    """``int32[NUM_DIGITS, V]``: base-2^20 digits (most significant first) of
    ``W_i = floor(w_i 2^(BITS - e))``, ``2^e`` a power of two with ``sum(w) <= 2^(e-1)``."""
    return _split(_scaled(weights_V))


def _split(x: jax.Array) -> jax.Array:
    """``int32[NUM_DIGITS, ...]``: the base-2^20 digits of ``floor(x 2^(BITS - DIGIT_BITS))``."""
    out = []
    for _ in range(NUM_DIGITS):
        digit = jnp.floor(x)  # x - floor(x) and the power-of-two scaling are exact in float32
        out.append(digit.astype(jnp.int32))
        x = (x - digit) * float(1 << DIGIT_BITS)
    return jnp.stack(out)


def _canonical(x: jax.Array) -> jax.Array:
    """Propagate carries along the leading digit axis: every digit but the first < 2^20."""
    out = [None] * x.shape[0]
    carry = jnp.zeros_like(x[0])
    for j in range(x.shape[0] - 1, 0, -1):
        t = x[j] + carry
        out[j] = jnp.bitwise_and(t, _DIGIT_MASK)
        carry = jnp.right_shift(t, DIGIT_BITS)
    out[0] = x[0] + carry
    return jnp.stack(out)


def categorical_table(weights_V: jax.Array):
    """``(digits [NUM_DIGITS, nb, width], block_cum [NUM_DIGITS, nb])``: the integer weights
    ``W_i`` in blocks of ``width = min(BLOCK, V)`` tokens (zero-padded) and the canonical digits
    of the inclusive cumulative sums of the block totals (``block_cum[:, -1]`` is ``T``). Pure and
    deterministic."""
    vocab = weights_V.shape[-1]
    if vocab > MAX_VOCAB:
        raise ValueError(f"draws: vocabulary V={vocab} is larger than {MAX_VOCAB}")
    width = min(BLOCK, vocab)  # a small vocabulary is one block, not one padded to BLOCK
    num_blocks = -(-vocab // width)
    digits = _digits(weights_V)
    digits = jnp.pad(digits, ((0, 0), (0, num_blocks * width - vocab)))
    digits = digits.reshape(NUM_DIGITS, num_blocks, width)
    block_sums = _canonical(jnp.sum(digits, axis=-1))
    return digits, _canonical(jnp.cumsum(block_sums, axis=-1))


def _less_equal(a: jax.Array, b: jax.Array, strict: bool) -> jax.Array:
    """Lexicographic ``a <= b`` (or ``<``) over the leading digit axis (most significant first)."""
    res = a[-1] < b[-1] if strict else a[-1] <= b[-1]
    for j in range(a.shape[0] - 2, -1, -1):
        res = (a[j] < b[j]) | ((a[j] == b[j]) & res)
    return res


def index_from_digits(table, r_D: jax.Array) -> jax.Array:
    """The token that the uniform integer ``R < T`` (digits ``r_D``) maps to: the number of
    ``i`` whose inclusive cumulative weight is ``<= R`` (``int32[]``), found block first. Tokens
    with ``W_i = 0`` are never returned; the set of R giving token i has exactly ``W_i`` elements.
    """
    digits, block_cum = table
    block = jnp.sum(_less_equal(block_cum, r_D[:, None], strict=False), dtype=jnp.int32)
    before = jnp.where(block > 0, block_cum[:, jnp.maximum(block - 1, 0)], 0)
    local = _canonical(jnp.cumsum(digits[:, block], axis=-1) + before[:, None])
    inside = jnp.sum(_less_equal(local, r_D[:, None], strict=False), dtype=jnp.int32)
    return block * digits.shape[-1] + inside


def uniform_digits(key: jax.Array) -> jax.Array:
    """``int32[NUM_DIGITS]``: a uniform integer in ``[0, 2^BITS)`` as base-2^20 digits."""
    bits = jax.random.bits(key, (NUM_DIGITS,), jnp.uint32)
    return jnp.right_shift(bits, 32 - DIGIT_BITS).astype(jnp.int32)


def block_width(vocab: int) -> int:
    """Tokens per block of :func:`_draw_one`'s search: the widest ``w <= BLOCK`` that splits the
    vocabulary into blocks evenly over 8 shards (``8 w`` divides ``V``: Llama-3's 128256 -> 96,
    Llama-2's 32000 -> 125), so that on a vocabulary-sharded mesh each chip sums its own blocks;
    else ``min(BLOCK, V)``. The token drawn does not depend on it (module docstring)."""
    for w in range(min(BLOCK, vocab), 0, -1):
        if vocab % (8 * w) == 0 and vocab // w <= MAX_VOCAB // BLOCK:
            return w
    return min(BLOCK, vocab)


def weight_blocks(weights_V: jax.Array):
    """``(x [nb, width], block_cum [NUM_DIGITS, nb])``: the scaled weights (:func:`_scaled`) in
    blocks of :func:`block_width` tokens (zero-padded) and the canonical digits of the inclusive
    cumulative sums of the block totals, each total a sum of the digits of its block's weights
    made as they are summed: :func:`categorical_table` without its per-token digits."""
    x = _scaled(weights_V)
    vocab = x.shape[-1]
    if vocab > MAX_VOCAB:
        raise ValueError(f"draws: vocabulary V={vocab} is larger than {MAX_VOCAB}")
    width = block_width(vocab)
    num_blocks = -(-vocab // width)
    x_NW = jnp.pad(x, (0, num_blocks * width - vocab)).reshape(num_blocks, width)
    return x_NW, _canonical(jnp.cumsum(_canonical(jnp.sum(_split(x_NW), axis=-1)), axis=-1))


def index_from_blocks(blocks, r_D: jax.Array) -> jax.Array:
    """:func:`index_from_digits` on :func:`weight_blocks`: the same token for every ``R`` (the
    cumulative sums are the table's; ``block_width`` only regroups them). The chosen block's
    weights are picked by a masked sum over the blocks (exact: one term is not 0) and only its
    digits are made, so on a mesh that splits the vocabulary the chips exchange block totals and
    one block's weights, never a table."""
    x_NW, block_cum = blocks
    block = jnp.sum(_less_equal(block_cum, r_D[:, None], strict=False), dtype=jnp.int32)
    before = jnp.where(block > 0, block_cum[:, jnp.maximum(block - 1, 0)], 0)
    row_W = jnp.sum(jnp.where(jnp.arange(x_NW.shape[0])[:, None] == block, x_NW, 0.0), axis=0)
    local = _canonical(jnp.cumsum(_split(row_W), axis=-1) + before[:, None])
    inside = jnp.sum(_less_equal(local, r_D[:, None], strict=False), dtype=jnp.int32)
    return block * x_NW.shape[1] + inside


def _draw_one(key: jax.Array, weights_V: jax.Array) -> jax.Array:
    blocks = weight_blocks(weights_V)
    total = blocks[1][:, -1]
    has_mass = jnp.any(total > 0)

    def draw(state):  # the i-th draw: one copy of the key derivation in the program
        i, _ = state
        return i + 1, uniform_digits(jax.random.fold_in(key, i))

    def again(state):  # the first draw, then again while it falls past the total
        i, r = state
        return (i == 0) | (has_mass & ~_less_equal(r, total, strict=True))

    first = jnp.zeros((NUM_DIGITS,), jnp.int32)
    _, r = jax.lax.while_loop(again, draw, (0, first))
    return jnp.where(has_mass, index_from_blocks(blocks, r), 0).astype(jnp.int32)


def draw_from_weights(key: jax.Array, weights: jax.Array) -> jax.Array:
    """One index per row of non-negative weights ``[..., V]`` (not necessarily normalised),
    drawn with probability ``w_i / sum(w)`` up to ``2^-(BITS-2)`` (see the module docstring).

    ``key`` is one PRNG key for all rows (rows get independent streams). A row without positive
    weight returns 0. Returns int32 ``[...]``.
    """
    weights = jnp.asarray(weights)
    batch = weights.shape[:-1]
    if not batch:
        return _draw_one(key, weights)
    flat = weights.reshape((-1, weights.shape[-1]))
    keys = jax.random.split(key, flat.shape[0])
    return jax.vmap(_draw_one)(keys, flat).reshape(batch)


def _weights_from_logprobs(logprobs: jax.Array) -> jax.Array:
    logprobs = jnp.asarray(logprobs, jnp.float32)
    top = jnp.max(logprobs, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    return jnp.exp(logprobs - top)


def draw_categorical(key: jax.Array, logprobs: jax.Array) -> jax.Array:
    """One token per row of log-probabilities (or logits) ``[..., V]``; ``-inf`` is never drawn.

    The law is ``exp(logprobs)`` normalised, to ``2^-(BITS-2)`` per token (no ~20-nat cut-off as
    in ``jax.random.categorical``). A row with no finite entry returns 0. Returns int32 ``[...]``.
    """
    return draw_from_weights(key, _weights_from_logprobs(logprobs))


def draw_without_replacement(key: jax.Array, logprobs_V: jax.Array, num: int) -> jax.Array:
    """``num`` distinct tokens drawn sequentially without replacement from ``exp(logprobs_V)``.

    Draw k follows the law restricted to the tokens not drawn before it, renormalised (each draw
    is :func:`draw_from_weights`). When fewer than ``num`` tokens have positive mass the last
    draws are the first tokens not yet drawn (zero-mass tokens). Returns int32[num].
    """
    weights = _weights_from_logprobs(logprobs_V)
    vocab = weights.shape[-1]

    def body(k, carry):
        drawn, out = carry
        masked = jnp.where(drawn, 0.0, weights)
        tok = _draw_one(jax.random.fold_in(key, k), masked)
        tok = jnp.where(jnp.any(masked > 0), tok, jnp.argmin(drawn)).astype(jnp.int32)
        return drawn | (jnp.arange(vocab) == tok), out.at[k].set(tok)

    init = (jnp.zeros((vocab,), bool), jnp.zeros((num,), jnp.int32))
    return jax.lax.fori_loop(0, num, body, init)[1]


def accept_from_bits(bits_2: jax.Array, ratio: jax.Array) -> jax.Array:
    """Bits -> decision of :func:`accept`: ``U < ratio`` with ``U = (a 2^32 + b) 2^-64``,
    ``bits_2 = uint32[2, ...] = (a, b)``; compared exactly, so ``P = ceil(ratio 2^64) / 2^64``."""
    r = jnp.clip(jnp.asarray(ratio, jnp.float32), 0.0, 1.0)
    scaled = r * 4294967296.0  # r 2^32, exact
    hi = jnp.floor(scaled)
    lo = jnp.ceil((scaled - hi) * 4294967296.0)  # exact; < 2^32 since float32 below 2^32
    hi_u = jnp.minimum(hi, 4294967295.0).astype(jnp.uint32)
    lo_u = jnp.minimum(lo, 4294967295.0).astype(jnp.uint32)
    a, b = bits_2[0], bits_2[1]
    below = (a < hi_u) | ((a == hi_u) & (b < lo_u))
    return (r >= 1.0) | below


def accept(key: jax.Array, num: jax.Array, den: jax.Array) -> jax.Array:
    """Bernoulli(``min(1, num / den)``) per entry, bias below ``2^-64`` (two uint32 words each).

    ``num = 0`` never accepts (even with ``den = 0``); ``den = 0 < num`` always accepts.
    """
    num = jnp.asarray(num, jnp.float32)
    den = jnp.asarray(den, jnp.float32)
    ratio = jnp.where(num >= den, 1.0, num / jnp.where(den > 0, den, 1.0))
    ratio = jnp.where(num > 0, ratio, 0.0)
    bits = jax.random.bits(key, (2,) + ratio.shape, jnp.uint32)
    return accept_from_bits(bits, ratio)


def accept_log(key: jax.Array, log_num: jax.Array, log_den: jax.Array) -> jax.Array:
    """:func:`accept` with ``num = exp(log_num)``, ``den = exp(log_den)`` given as logs.

    ``log_num = -inf`` never accepts; ``log_den = -inf < log_num`` always accepts.
    """
    log_num = jnp.asarray(log_num, jnp.float32)
    log_den = jnp.asarray(log_den, jnp.float32)
    finite_den = jnp.isfinite(log_den)
    diff = jnp.where(finite_den, log_num - jnp.where(finite_den, log_den, 0.0), jnp.inf)
    ratio = jnp.exp(jnp.minimum(jnp.where(jnp.isnan(diff), -jnp.inf, diff), 0.0))
    ratio = jnp.where(log_num == -jnp.inf, 0.0, ratio)
    bits = jax.random.bits(key, (2,) + ratio.shape, jnp.uint32)
    return accept_from_bits(bits, ratio)
