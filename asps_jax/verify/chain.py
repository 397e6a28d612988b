"""Single-chain verifiers: standard speculative sampling (SpS) and accelerated SpS (ASpS).

SpS: Leviathan et al. 2023 / Chen et al. 2023 (docs/algorithms.md §1). ASpS: Hu & Huang,
"Accelerated Speculative Sampling Based on Tree Monte Carlo", ICML 2024 (docs/algorithms.md §2).

A draft token that passes verification is *accepted*; the token that replaces the first rejected
draft token is *recovered*; when every valid draft token is accepted, one *bonus* token is drawn
from the target law after the draft. Position ``t`` (0-based) verifies ``x_t`` with the laws
``p_t``, ``q_t``.

Each method is split in two:

* an *outcome law* (``sps_outcome_logweights`` / ``asps_outcome_logweights``): a pure,
  deterministic function of the draft returning ``stop_NV`` (log-probability of "emit ``x_{<t}``
  then ``y`` and stop", for ``y != x_t``) and ``log_full`` (log-probability of "accept all
  ``draft_length`` tokens, then a bonus token"). It works in the dtype it is given, so the exact
  enumeration tests run it in float64; the tables are also what expected-length computations use.
* a sampler (``sps`` / ``asps``) with the registry signature of ``verify/api.py``.

Keeping the fully coupled outcome as a separate slot (instead of overwriting entry
``(L-1, x_{L-1})`` of the table as the reference does) means padding never has to move it: rows at
or beyond ``draft_length`` are simply ``-inf`` and ``draft_length == 0`` is a table that is all
``-inf`` with ``log_full == 0`` (the bonus token is then drawn from ``target_logprobs[0]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from asps_jax.draws import accept_log, draw_categorical
from asps_jax.logspace import NEG_INF, log_minus_exp, log_normalize
from asps_jax.verify.verdict import Verdict, make_verdict

# Purposes folded into the caller's key, so the draws of one step are independent.
_ACCEPT, _RESIDUAL, _BONUS, _OUTCOME = 0, 1, 2, 3


def _logsumexp(x: jax.Array, axis: int = -1) -> jax.Array:
    """``log(sum(exp(x)))`` that is ``-inf`` (never NaN) for an all ``-inf`` slice."""
    m = jnp.max(x, axis=axis, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    out = jnp.log(jnp.sum(jnp.exp(x - m_safe), axis=axis)) + jnp.squeeze(m_safe, axis)
    return jnp.where(jnp.isfinite(jnp.squeeze(m, axis)), out, NEG_INF)


def _draft_token_logprobs(draft_tokens_N, draft_logprobs_NV, target_logprobs_MV):
    """``(log q_t(x_t), log p_t(x_t))``, each ``[n]``."""
    n = draft_tokens_N.shape[0]
    idx = draft_tokens_N[:, None]
    lq_x = jnp.take_along_axis(draft_logprobs_NV, idx, axis=-1)[:, 0]
    lp_x = jnp.take_along_axis(target_logprobs_MV[:n], idx, axis=-1)[:, 0]
    return lq_x, lp_x


def effective_length(draft_tokens, draft_logprobs, target_logprobs, draft_length):
    """``(tokens, length)``: ``draft_length`` cut before the first out-of-contract draft token.

    A token id outside ``[0, V)`` or a token the draft gives probability 0 cannot have been drawn
    from the draft; the chain is treated as ending just before it, so it is never emitted (a token
    of target probability 0 never is, and ASpS's table never meets an infinite ratio). Out-of-range
    ids are replaced by 0 (they now lie in the padding). Inside the contract nothing changes.
    """
    n, vocab = draft_logprobs.shape
    in_range = (draft_tokens >= 0) & (draft_tokens < vocab)
    tokens = jnp.where(in_range, draft_tokens, 0).astype(jnp.int32)
    lq_x, _ = _draft_token_logprobs(tokens, draft_logprobs, target_logprobs)
    bad = ~in_range | (lq_x == NEG_INF)
    first_bad = jnp.where(jnp.any(bad), jnp.argmax(bad), n) if n > 0 else 0
    return tokens, jnp.minimum(draft_length, first_bad).astype(jnp.int32)


def _log_ratio(lp_x: jax.Array, lq_x: jax.Array) -> jax.Array:
    """``log(p(x) / q(x))`` with ``p(x) = 0`` giving ``-inf`` even when ``q(x) = 0`` (no NaN)."""
    safe_lq = jnp.where(jnp.isfinite(lq_x), lq_x, 0.0)
    ratio = jnp.where(jnp.isfinite(lq_x), lp_x - safe_lq, jnp.inf)
    return jnp.where(lp_x == NEG_INF, NEG_INF, ratio)


def _residual(lp_V: jax.Array, lq_V: jax.Array) -> jax.Array:
    """Unnormalised log of ``(p - q)_+``, falling back to ``p`` when it is all zero.

    In exact arithmetic a rejection implies a positive residual; in floating point ``p == q`` up to
    rounding can meet a (probability ~1e-16) rejection with an all-zero residual
    (docs/algorithms.md §1).
    """
    res = log_minus_exp(lp_V, lq_V)
    empty = jnp.all(res == NEG_INF, axis=-1, keepdims=True)
    return jnp.where(empty, lp_V, res)


# --------------------------------------------------------------------------------------------
# SpS
# --------------------------------------------------------------------------------------------


def sps_outcome_logweights(draft_tokens, draft_logprobs, target_logprobs, draft_length):
    """Exact outcome law of SpS for one draft (docs/algorithms.md §1).

    Args:
      draft_tokens: int[n]; draft_logprobs: float[n, V]; target_logprobs: float[n+1, V];
      draft_length: int[] in [0, n].

    Returns:
      ``(stop_NV, log_full)``: ``stop_NV[t, y]`` = log P(accept ``x_{<t}``, reject ``x_t``, recover
      ``y``), ``-inf`` at ``y == x_t`` and for ``t >= draft_length``; ``log_full`` = log P(accept
      all ``draft_length`` tokens). The weights sum to 1.
    """
    n, vocab = draft_logprobs.shape
    dtype = draft_logprobs.dtype
    lq_x, lp_x = _draft_token_logprobs(draft_tokens, draft_logprobs, target_logprobs)
    valid_N = jnp.arange(n) < draft_length
    log_acc_N = jnp.minimum(_log_ratio(lp_x, lq_x), 0.0)  # log min(1, r_t)
    log_acc_N = jnp.where(valid_N, log_acc_N, jnp.zeros((), dtype))
    # Probability of accepting x_{<t}: exclusive cumulative sum (no +inf terms, so no NaN).
    log_reach_M = jnp.concatenate([jnp.zeros((1,), dtype), jnp.cumsum(log_acc_N)])
    log_reject_N = log_minus_exp(jnp.zeros((), dtype), log_acc_N)
    res_NV = log_normalize(_residual(target_logprobs[:n], draft_logprobs))
    stop_NV = (log_reach_M[:n] + log_reject_N)[:, None] + res_NV
    is_draft_NV = jnp.arange(vocab)[None, :] == draft_tokens[:, None]
    # y == x_t has zero residual mass in exact arithmetic; only the all-zero fallback could put
    # mass there, and that fallback event itself has probability zero.
    stop_NV = jnp.where(is_draft_NV | ~valid_N[:, None], NEG_INF, stop_NV)
    log_full = log_reach_M[jnp.asarray(draft_length, jnp.int32)]
    return stop_NV, log_full


def sps(key, draft_tokens, draft_logprobs, target_logprobs, draft_length) -> Verdict:
    """Standard speculative sampling: accept ``x_t`` with probability ``min(1, p_t/q_t (x_t))``.

    Shapes: draft_tokens int32[n], draft_logprobs float32[n, V], target_logprobs float32[n+1, V],
    draft_length int32[] in [0, n]. Returns a Verdict with ``tokens`` int32[n+1]. Out-of-contract
    tokens end the chain (:func:`effective_length`).
    """
    n = draft_tokens.shape[0]
    draft_tokens, draft_length = effective_length(
        draft_tokens, draft_logprobs, target_logprobs, draft_length
    )
    lq_x, lp_x = _draft_token_logprobs(draft_tokens, draft_logprobs, target_logprobs)

    # --- Step 1: accept/reject every position at once, each an exact Bernoulli (bias < 2^-64,
    # draws.accept_log); p(x) = 0 never accepts, q(x) = 0 < p(x) always does.
    keys = _purpose_keys(key, (_ACCEPT, _RESIDUAL, _BONUS))
    accepted_N = accept_log(keys[0], lp_x, lq_x)
    stop_N = ~accepted_N | (jnp.arange(n) >= draft_length)
    # J = number of accepted tokens = index of the first rejection, or draft_length.
    first_stop = jnp.argmax(stop_N) if n > 0 else 0
    num_accepted = jnp.where(jnp.any(stop_N), first_stop, n).astype(jnp.int32)

    # --- Step 2: the final token. J < draft_length: recovered from (p_J - q_J)_+; otherwise the
    # bonus from p_J, as the residual against an empty draft row (lde(p, -inf) = p). Row J of
    # the draft may be padding (J = draft_length < n) and must then be ignored.
    recovering = num_accepted < draft_length
    lq_J = draft_logprobs[jnp.minimum(num_accepted, n - 1)] if n > 0 else NEG_INF
    law_J = _residual(target_logprobs[num_accepted], jnp.where(recovering, lq_J, NEG_INF))
    # One V-sized draw whose key still depends on its purpose (recovered vs bonus).
    last = draw_categorical(keys[jnp.where(recovering, 1, 2)], law_J)

    tokens_M = jnp.concatenate([draft_tokens, jnp.full((1,), -1, jnp.int32)])
    tokens_M = tokens_M.at[num_accepted].set(last)
    return make_verdict(tokens_M, num_accepted + 1)


# --------------------------------------------------------------------------------------------
# ASpS
# --------------------------------------------------------------------------------------------


def asps_continuation_logweights(draft_tokens, draft_logprobs, target_logprobs, draft_length):
    """``log a_t``, t = 0..n (``[n+1]``): ``a_0 = 1``, ``a_{t+1} = min(1, a_t p_t(x_t)/q_t(x_t))``.

    Frozen at ``t >= draft_length`` so that ``a_n`` is ``a_{draft_length}``. The clamp at 1 makes
    this a recurrence, hence the one ``lax.scan`` of the method.
    """
    n = draft_tokens.shape[0]
    dtype = draft_logprobs.dtype
    lq_x, lp_x = _draft_token_logprobs(draft_tokens, draft_logprobs, target_logprobs)
    log_r_N = _log_ratio(lp_x, lq_x)

    def step(log_a, inputs):
        log_r, valid = inputs
        # -inf stays -inf (a + r could otherwise be -inf + inf); r = +inf (q(x) = 0) gives 1.
        nxt = jnp.where(log_a == NEG_INF, NEG_INF, jnp.minimum(log_a + log_r, 0.0))
        nxt = jnp.where(log_r == NEG_INF, NEG_INF, nxt)
        nxt = jnp.where(valid, nxt, log_a)
        return nxt, nxt

    valid_N = jnp.arange(n) < draft_length
    _, log_a_N = jax.lax.scan(step, jnp.zeros((), dtype), (log_r_N, valid_N))
    return jnp.concatenate([jnp.zeros((1,), dtype), log_a_N])


def _log_abs_diff(a: jax.Array, b: jax.Array) -> jax.Array:
    """``log|e^a - e^b|``: ``-inf`` where ``a == b`` (incl. both ``-inf``), never NaN.

    Both ``(e^a - e^b)_+`` and ``(e^b - e^a)_+`` are this value on one side of ``a > b``, so ASpS
    gets the draft excess and the stop weights from one ``expm1`` and one ``log`` per entry.
    """
    hi, lo = jnp.maximum(a, b), jnp.minimum(a, b)
    differ = hi > lo
    hi_safe = jnp.where(differ, hi, 0.0)
    lo_safe = jnp.where(differ, lo, NEG_INF)
    return jnp.where(differ, hi_safe + jnp.log(-jnp.expm1(lo_safe - hi_safe)), NEG_INF)


def _asps_table(draft_tokens, draft_logprobs, target_logprobs, draft_length):
    """``(stop_NV, row_mass_N, log_full)``; ``row_mass_N`` = logsumexp of each row of stop_NV."""
    n, vocab = draft_logprobs.shape
    dtype = draft_logprobs.dtype
    log_a_M = asps_continuation_logweights(
        draft_tokens, draft_logprobs, target_logprobs, draft_length
    )
    valid_N = jnp.arange(n) < draft_length
    scaled_target_NV = log_a_M[:n, None] + target_logprobs[:n]
    diff_NV = _log_abs_diff(scaled_target_NV, draft_logprobs)
    target_above_NV = scaled_target_NV > draft_logprobs
    is_draft_NV = jnp.arange(vocab)[None, :] == draft_tokens[:, None]

    # --- Step 1: rescaling factors s_t (importance weight of x_t under the draft-excess law) ---
    lc_NV = jnp.where(target_above_NV, NEG_INF, diff_NV)  # c_t = (q_t - a_t p_t)_+
    lC_N = _logsumexp(lc_NV)
    lc_x = jnp.take_along_axis(lc_NV, draft_tokens[:, None], axis=-1)[:, 0]
    lq_x = jnp.take_along_axis(draft_logprobs, draft_tokens[:, None], axis=-1)[:, 0]
    # c_t(x_t) > 0 implies q_t(x_t) > 0, so the subtraction is finite wherever it is used.
    safe = jnp.isfinite(lc_x)
    ls_N = jnp.where(safe, jnp.where(safe, lc_x, 0.0) - lC_N - jnp.where(safe, lq_x, 0.0), NEG_INF)
    ls_N = jnp.where((lC_N == NEG_INF) | ~valid_N, jnp.zeros((), dtype), ls_N)

    # --- Step 2: suffix products prod_{j>=t} s_j as a reversed cumulative sum (never +inf) ---
    suffix_N = jnp.flip(jnp.cumsum(jnp.flip(ls_N)))

    # --- Step 3: stop-and-emit weights r_t = (a_t p_t - q_t)_+ scaled by the suffix; (t, x_t) is
    # the consumed continuation entry. Masking before the row sums keeps them consistent. ---
    lr_NV = jnp.where(target_above_NV & ~is_draft_NV, diff_NV, NEG_INF)
    row_ok_N = valid_N & (suffix_N > NEG_INF)
    stop_NV = jnp.where(row_ok_N[:, None], lr_NV + suffix_N[:, None], NEG_INF)
    row_mass_N = jnp.where(row_ok_N, _logsumexp(lr_NV) + suffix_N, NEG_INF)
    return stop_NV, row_mass_N, log_a_M[n]


def asps_outcome_logweights(draft_tokens, draft_logprobs, target_logprobs, draft_length):
    """Exact outcome law of ASpS for one draft: the table of docs/algorithms.md §2.2 in closed form.

    ``stop_NV[t, y] = r_t(y) * prod_{j=t}^{L-1} s_j`` with ``r_t = (a_t p_t - q_t)_+`` and
    ``s_j = c_j(x_j) / (C_j q_j(x_j))``, ``c_j = (q_j - a_j p_j)_+``, ``C_j = sum c_j``
    (``s_j = 1`` when ``C_j = 0``); entries ``(t, x_t)`` and rows ``t >= L`` are ``-inf``;
    ``log_full = log a_L``. O(n V) work; weights sum to 1 without normalisation (§2.2).

    Returns:
      ``(stop_NV, log_full)`` as :func:`sps_outcome_logweights`.
    """
    stop_NV, _, log_full = _asps_table(draft_tokens, draft_logprobs, target_logprobs, draft_length)
    return stop_NV, log_full


def asps(key, draft_tokens, draft_logprobs, target_logprobs, draft_length) -> Verdict:
    """Accelerated speculative sampling: one draw of an outcome from the table.

    Shapes as :func:`sps`. The fully coupled outcome emits the ``draft_length`` valid draft tokens
    and a bonus token from ``target_logprobs[draft_length]``.

    The outcome ``(t, y)`` is drawn in two stages, the row ``t`` from the n+1 row masses (the
    fully coupled slot is row n), then ``y`` from row ``t`` (or the bonus law): the same law as one
    categorical over the flattened n*V+1 table at a fraction of the cost. Both draws are exact
    (draws.draw_categorical). Out-of-contract tokens end the chain (:func:`effective_length`).
    """
    n, vocab = draft_logprobs.shape
    draft_tokens, draft_length = effective_length(
        draft_tokens, draft_logprobs, target_logprobs, draft_length
    )
    stop_NV, row_mass_N, log_full = _asps_table(
        draft_tokens, draft_logprobs, target_logprobs, draft_length
    )
    # The table sums to 1 up to rounding; the draw's implicit normalisation absorbs it.
    row_mass_M = jnp.concatenate([row_mass_N, log_full[None]])
    # The three purposes' keys in one derivation (the same bits as one fold_in each).
    keys = _purpose_keys(key, (_OUTCOME, _RESIDUAL, _BONUS))
    bonus_law = target_logprobs[draft_length]
    width = max(vocab, n + 1)  # both laws padded to one width with -inf (never drawn)
    pad = lambda lp: jnp.pad(lp, (0, width - lp.shape[0]), constant_values=NEG_INF)  # noqa: E731

    def draw(j, drawn):  # j = 0 the row, j = 1 its token: one draw in the program, not two
        full = drawn[0] == n
        law = (
            bonus_law
            if n == 0
            else jnp.where(full, bonus_law, stop_NV[jnp.minimum(drawn[0], n - 1)])
        )
        law = jnp.where(j == 0, pad(row_mass_M), pad(law))
        purpose = jnp.where(j == 0, 0, jnp.where(full, 2, 1))
        return drawn.at[j].set(draw_categorical(keys[purpose], law))

    # A draw's token does not depend on -inf entries after the law's own (draws.py), so the
    # padded row draw is the n + 1 row masses' draw, token for token.
    row, last = jax.lax.fori_loop(0, 2, draw, jnp.zeros((2,), jnp.int32))
    full = row == n
    num_accepted = jnp.where(full, draft_length, row).astype(jnp.int32)

    tokens_M = jnp.concatenate([draft_tokens, jnp.full((1,), -1, jnp.int32)])
    tokens_M = tokens_M.at[num_accepted].set(last)
    return make_verdict(tokens_M, num_accepted + 1)


def _purpose_keys(key, purposes) -> jax.Array:
    """``fold_in(key, p)`` for each purpose ``p`` (stacked), derived in one vectorized
    ``fold_in``: the same bits as one ``fold_in`` per purpose, one copy in the program."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.asarray(purposes, jnp.uint32))
