"""Multi-draft verifiers: a token-level scheme applied along K draft chains (docs/algorithms.md
§3.1).

The K chains are drawn independently (from one draft law or several). Verification walks down the
depths with an *alive* mask: at depth d the alive drafts are those whose first d tokens equal the
emitted prefix and whose ``draft_length > d``. The scheme (tokenlevel.py) emits one token Y from the
alive drafts' tokens; the survivors are the alive drafts whose token equals Y -- including a
recovered token that happens to equal a draft token, and never deduplicated. With no survivor the
step stops after Y; if the matched chains end (depth n or their ``draft_length``) a *bonus* token is
drawn from the target at that depth. Conditional on the history the alive drafts' next tokens are
fresh independent draws, so each node's exact scheme makes the whole step exact.

The verifiers (the ``"drafts"`` entries of verify/registry.py): ``"specinfer"``, ``"spectr"``,
``"is"``, ``"optimal"`` and ``"specinfer_wor"`` (for root drafts drawn *without* replacement by
:func:`sample_without_replacement`; a different draft law, hence a different name).

``"is"`` and ``"optimal"`` are importance-sampling selection followed by SpS against the exact law
of the selected token (Khisti et al., arXiv 2410.18234, Theorem 1). Both default to the *level
race* (level_race.py, §3.10): each alive draft draws a random level from a per-token law, the
lowest level wins, ties are shared uniformly, and the selected token's law has a closed form made of
non-negative terms, for identical or distinct draft laws. ``"is"`` fits the per-token clock rates by
15 fixed-point steps on 16 levels; ``"optimal"`` then frees the level laws and climbs the exact
efficiency ``sum_y min(p, q_I)`` by 200 gradient steps, which brings it within about 0.001 of the
optimum ``optimal_acceptance`` on the bundled pair's real laws (docs/benchmarks.md). The pairwise
tournaments (``rule="truncated_lp"``, ``"fixed_order"``, ``"sir"``) remain as ``"is"`` options.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from asps_jax.draws import draw_from_weights, draw_without_replacement
from asps_jax.verify import chain
from asps_jax.verify import options as opts
from asps_jax.verify.options import check_tail
from asps_jax.verify.tokenlevel import (
    importance_sampling,
    sample_choice,
    specinfer,
    specinfer_without_replacement,
    spectr,
)
from asps_jax.verify.verdict import Verdict, make_verdict


class _Walk(NamedTuple):
    """The state of :func:`walk_chains` from one depth to the next."""

    matched: jax.Array  # bool[K], the chains whose prefix is the emitted one
    done: jax.Array  # bool[], the walk has stopped (a residual token, a bonus or a handover)
    index: jax.Array  # int32[], the chain whose prefix the emitted tokens follow
    emitted: jax.Array  # int32[n + 1], the tokens emitted so far (-1 beyond)
    final_depth: jax.Array  # int32[], the depth of the last token (drawn after the walk)
    final_law: jax.Array  # [V], the law the last token is drawn from
    tail_depth: jax.Array  # int32[], where ASpS takes over the one alive chain (-1: never)
    fallbacks: jax.Array  # int32[], selection solves replaced by the exact fallback


def _walk_step(
    w: _Walk,
    d,
    *,
    node_fn,
    root_fn,
    key_nodes,
    draft_tokens,
    draft_logprobs,
    target_logprobs,
    draft_length,
    tail,
):
    """``(new _Walk, None)``: one depth ``d`` of :func:`walk_chains` (a ``lax.scan`` step)."""
    num_drafts = draft_tokens.shape[0]
    alive = w.matched & (draft_length > d) & ~w.done
    any_alive = jnp.any(alive)
    first_alive = jnp.argmax(alive)
    handover = (jnp.sum(alive) == 1) if tail == "asps" else jnp.array(False)
    p = jnp.exp(target_logprobs[first_alive, d])  # [V], the target at the emitted prefix
    q = jnp.exp(draft_logprobs[:, d])  # [K, V]
    x = draft_tokens[:, d]  # [K]
    # A dead node (done, or nothing alive) still runs on a harmless alive mask: fixed shapes.
    mask = jnp.where(any_alive, alive, jnp.arange(num_drafts) == 0)
    if root_fn is node_fn:
        outcome = node_fn(p, q, x, mask)
    else:
        outcome = jax.lax.cond(d == 0, root_fn, node_fn, p, q, x, mask)
    choice, outside = sample_choice(jax.random.fold_in(key_nodes, d), outcome, x, alive)
    hit = choice < num_drafts
    y = x[jnp.minimum(choice, num_drafts - 1)]
    emit = ~w.done & any_alive & ~handover
    needs_bonus = ~w.done & ~any_alive  # the matched chains ended before depth n
    stop = emit & ~hit  # a residual token that no alive draft shows: drawn after the loop
    bonus_chain = jnp.argmax(w.matched)
    final_law = jnp.where(stop, outside, w.final_law)
    final_law = jnp.where(needs_bonus, jnp.exp(target_logprobs[bonus_chain, d]), final_law)
    # On a stop or a handover the first alive chain carries the emitted prefix; on a bonus
    # any matched one.
    index = jnp.where(stop | handover, first_alive, w.index)
    index = jnp.where(needs_bonus, bonus_chain, index)
    new = _Walk(
        matched=jnp.where(emit & hit, alive & (x == y), w.matched),
        done=w.done | stop | needs_bonus | handover,
        index=index,
        emitted=w.emitted.at[d].set(jnp.where(emit & hit, y, w.emitted[d])),
        final_depth=jnp.where(stop | needs_bonus, d, w.final_depth),
        final_law=final_law,
        tail_depth=jnp.where(~w.done & handover, d, w.tail_depth),
        fallbacks=w.fallbacks + jnp.where(emit, outcome.num_fallbacks, 0),
    )
    return new, None


def _initial_walk(num_drafts: int, n: int, vocab: int, dtype) -> _Walk:
    """The :class:`_Walk` before depth 0: every chain matched, nothing emitted."""
    return _Walk(
        matched=jnp.ones((num_drafts,), bool),
        done=jnp.array(False),
        index=jnp.zeros((), jnp.int32),
        emitted=jnp.full((n + 1,), -1, jnp.int32),
        final_depth=jnp.full((), n, jnp.int32),
        final_law=jnp.zeros((vocab,), dtype),
        tail_depth=jnp.full((), -1, jnp.int32),
        fallbacks=jnp.zeros((), jnp.int32),
    )


def _asps_tail(
    key_tail,
    draft_tokens,
    draft_logprobs,
    target_logprobs,
    draft_length,
    index,
    tail_depth,
    emitted,
    num_tokens,
):
    """``(emitted int32[n + 1], num_tokens int32[])`` with the ASpS tail applied where the walk
    handed the one alive chain ``index`` over at ``tail_depth`` (unchanged where it never did)."""
    n = draft_tokens.shape[1]
    # ASpS on the suffix of the one alive chain from tail_depth, shifted to row 0 (static
    # shapes: rows past the end are clamped copies, beyond the suffix's draft_length).
    start = jnp.maximum(tail_depth, 0)
    rows_n = jnp.minimum(start + jnp.arange(n), n - 1)
    rows_m = jnp.minimum(start + jnp.arange(n + 1), n)
    suffix = chain.asps(
        key_tail,
        draft_tokens[index, rows_n],
        draft_logprobs[index, rows_n],
        target_logprobs[index, rows_m],
        draft_length[index] - start,
    )
    shifted = suffix.tokens[jnp.clip(jnp.arange(n + 1) - start, 0, n)]
    tailed = tail_depth >= 0
    emitted = jnp.where(tailed & (jnp.arange(n + 1) >= start), shifted, emitted)
    num_tokens = jnp.where(tailed, start + suffix.num_tokens, num_tokens)
    return emitted, num_tokens


def walk_chains(
    node_fn,
    key,
    draft_tokens,
    draft_logprobs,
    target_logprobs,
    draft_length,
    *,
    root_fn=None,
    tail="asps",
) -> Verdict:
    """Apply ``node_fn(p[V], q[K, V], x[K], alive[K]) -> NodeOutcome`` along K chains.

    Args:
      node_fn: the token-level scheme; ``root_fn`` (default ``node_fn``) is used at depth 0.
      draft_tokens: int32[K, n]; draft_logprobs: [K, n, V]; target_logprobs: [K, n+1, V];
      draft_length: int32[K] in [0, n].
      tail: ``"asps"``: once a single chain is alive at depth d, its remaining tokens are fresh
        draws given the emitted prefix, so ASpS verifies them (d .. its draft_length) as one
        block (exact, docs/algorithms.md §3.10 "ASpS tail"; never fewer tokens than SpS).
        ``"sps"``: the node scheme continues token by token (single-draft SpS).

    Each depth draws only a (K+1)-way choice (tokenlevel.sample_choice); the one V-sized draw of
    the tree walk (a residual token outside the alive drafts, or the bonus) happens once after
    the loop. Out-of-contract draft tokens end their chain (chain.effective_length).
    """
    check_tail(tail)
    num_drafts, n = draft_tokens.shape
    root_fn = node_fn if root_fn is None else root_fn
    draft_tokens, draft_length = jax.vmap(chain.effective_length)(
        draft_tokens, draft_logprobs, target_logprobs, jnp.asarray(draft_length, jnp.int32)
    )
    key_nodes, key_final, key_tail = jax.random.split(key, 3)

    step = functools.partial(
        _walk_step,
        node_fn=node_fn,
        root_fn=root_fn,
        key_nodes=key_nodes,
        draft_tokens=draft_tokens,
        draft_logprobs=draft_logprobs,
        target_logprobs=target_logprobs,
        draft_length=draft_length,
        tail=tail,
    )
    vocab = target_logprobs.shape[-1]
    init = _initial_walk(num_drafts, n, vocab, target_logprobs.dtype)
    # n == 0 (no draft tokens) is static: the step is just the bonus token at the root.
    w = jax.lax.scan(step, init, jnp.arange(n))[0] if n else init
    emitted, final_depth, tail_depth = w.emitted, w.final_depth, w.tail_depth
    # Never stopped: every surviving chain reached depth n, the bonus comes from its last row.
    index = jnp.where(w.done, w.index, jnp.argmax(w.matched))
    final_law = jnp.where(w.done, w.final_law, jnp.exp(target_logprobs[index, n]))
    last = draw_from_weights(key_final, final_law)
    emitted = jnp.where(jnp.arange(n + 1) == final_depth, last, emitted)
    num_tokens = final_depth + 1
    if tail == "asps" and n:
        emitted, num_tokens = _asps_tail(
            key_tail,
            draft_tokens,
            draft_logprobs,
            target_logprobs,
            draft_length,
            index,
            tail_depth,
            emitted,
            num_tokens,
        )
    return make_verdict(emitted, num_tokens, index, w.fallbacks)


def verify_specinfer(key, tokens, lq, lp, draft_length, *, tail="asps", **options) -> Verdict:
    """SpecInfer: recursive rejection sampling with replacement at every node (§3.2)."""
    opts.NONE.check("specinfer", options)
    return walk_chains(specinfer, key, tokens, lq, lp, draft_length, tail=tail)


def verify_specinfer_wor(key, tokens, lq, lp, draft_length, *, tail="asps", **options) -> Verdict:
    """RRS without replacement at the root (§3.3), for root tokens drawn by
    :func:`sample_without_replacement`; deeper nodes (independent continuations) use RRS.

    Root tokens must be distinct among the chains with ``draft_length > 0``: ``verify_drafts``
    raises a ValueError naming a repeated token on concrete input; on traced input a repeated root
    token is never accepted (tokenlevel.specinfer_without_replacement)."""
    opts.NONE.check("specinfer_wor", options)
    return walk_chains(
        specinfer,
        key,
        tokens,
        lq,
        lp,
        draft_length,
        root_fn=specinfer_without_replacement,
        tail=tail,
    )


def verify_spectr(key, tokens, lq, lp, draft_length, *, tail="asps", **options) -> Verdict:
    """SpecTr k-sequential selection with the smallest feasible division factor (§3.4)."""
    opts.NONE.check("spectr", options)
    return walk_chains(spectr, key, tokens, lq, lp, draft_length, tail=tail)


def verify_is(key, tokens, lq, lp, draft_length, *, tail="asps", **options) -> Verdict:
    """IS selection + SpS against the exact induced law (§3.6).

    Options: ``rule`` in ``"level_race"`` (default, §3.10: ``levels`` J = 16, ``fit_steps``
    T = 15, ``table`` B = 128 tabulated level laws on log(p / q), 0 = one law per token), or the
    pairwise tournaments ``"truncated_lp"`` (``s`` = 5 LP positions), ``"fixed_order"``,
    ``"sir"`` with ``alphabet`` (40; the SIR block, an upper bound on s),
    ``lp_iters`` (300), ``tol`` (1e-5, certified LP gap). ``batch_axis`` (None): when the call
    is ``vmap``-ed with that ``axis_name`` over a batch's rows, the level race fits a node only
    if some row has two alive drafts there (``level_race.fit_race``; the same verdicts).
    """
    cfg = opts.rule_config("is", lp.shape[-1], options)
    return walk_chains(
        functools.partial(importance_sampling, cfg=cfg),
        key,
        tokens,
        lq,
        lp,
        draft_length,
        tail=tail,
    )


def verify_optimal(key, tokens, lq, lp, draft_length, *, tail="asps", **options) -> Verdict:
    """The level race with free per-token level laws fitted by gradient ascent, then SpS.

    Options: ``levels`` (16), ``fit_steps`` (15, the fixed-point start), ``table`` (128, as for
    :func:`verify_is`), ``grad_steps`` (200, Adam steps on the ``sum min(p, q_I)`` of the table).
    Exact for any fit; measured within 0.001 of
    :func:`~asps_jax.verify.acceptance.optimal_acceptance` on average on real laws (K = 2..8), not
    a certified optimum. Cost per node with two or more alive drafts: O(K V) plus ~ (15 + 3 * 200)
    evaluations of an O(K J B) closed form on the table. ``batch_axis`` as for :func:`verify_is`.
    """
    cfg = opts.rule_config("optimal", lp.shape[-1], options)
    return walk_chains(
        functools.partial(importance_sampling, cfg=cfg),
        key,
        tokens,
        lq,
        lp,
        draft_length,
        tail=tail,
    )


def sample_without_replacement(key: jax.Array, draft_logprobs: jax.Array, num_drafts: int):
    """K distinct root tokens: sequential sampling without replacement from q (exact draws).

    Args:
      draft_logprobs: [V] log q at the root; num_drafts: K <= V (static).

    Returns:
      int32[K]; draw k is distributed as q restricted to the tokens not drawn before it. If q has
      fewer than K tokens of positive mass the last draws are zero-mass tokens, which
      ``"specinfer_wor"`` never accepts.
    """
    vocab = draft_logprobs.shape[-1]
    if not 1 <= num_drafts <= vocab:
        raise ValueError(
            f"sample_without_replacement: num_drafts must be in [1, V={vocab}], got {num_drafts}"
        )
    return draw_without_replacement(key, draft_logprobs, num_drafts)
