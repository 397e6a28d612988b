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

:data:`METHODS` (the ``"drafts"`` entries of verify/registry.py): ``"specinfer"``, ``"spectr"``,
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

import jax
import jax.numpy as jnp

from asps_jax.draws import draw_from_weights, draw_without_replacement
from asps_jax.verify import chain
from asps_jax.verify.api import Verdict, make_verdict
from asps_jax.verify.registry import REGISTRY, names
from asps_jax.verify.selection import PAIRWISE_RULES, RULES, RuleConfig
from asps_jax.verify.tokenlevel import (
    importance_sampling,
    sample_choice,
    specinfer,
    specinfer_without_replacement,
    spectr,
)

# The options and defaults live in the registry; ``tail`` is a keyword of every verifier here.
IS_DEFAULTS = {k: v for k, v in REGISTRY["is"].options if k != "tail"}
OPTIMAL_DEFAULTS = {k: v for k, v in REGISTRY["optimal"].options if k != "tail"}
RACE_OPTIONS = ("levels", "fit_steps", "table")
PAIRWISE_OPTIONS = ("s", "alphabet", "lp_iters", "tol")


TAILS = ("asps", "sps")


def check_tail(tail) -> None:
    """``tail`` must be ``"asps"`` (default) or ``"sps"`` (a one-line ValueError otherwise)."""
    if tail not in TAILS:
        raise ValueError(f"verify_drafts: tail must be one of {TAILS}, got {tail!r}")


def verify_tree(
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

    def step(carry, d):
        matched, done, index, emitted, final_depth, final_law, tail_depth, fallbacks = carry
        alive = matched & (draft_length > d) & ~done
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
        emit = ~done & any_alive & ~handover
        needs_bonus = ~done & ~any_alive  # the matched chains ended before depth n
        stop = emit & ~hit  # a residual token that no alive draft shows: drawn after the loop
        emitted = emitted.at[d].set(jnp.where(emit & hit, y, emitted[d]))
        bonus_chain = jnp.argmax(matched)
        final_law = jnp.where(stop, outside, final_law)
        final_law = jnp.where(needs_bonus, jnp.exp(target_logprobs[bonus_chain, d]), final_law)
        final_depth = jnp.where(stop | needs_bonus, d, final_depth)
        # On a stop or a handover the first alive chain carries the emitted prefix; on a bonus
        # any matched one.
        index = jnp.where(stop | handover, first_alive, index)
        index = jnp.where(needs_bonus, bonus_chain, index)
        tail_depth = jnp.where(~done & handover, d, tail_depth)
        fallbacks = fallbacks + jnp.where(emit, outcome.num_fallbacks, 0)
        matched = jnp.where(emit & hit, alive & (x == y), matched)
        done = done | stop | needs_bonus | handover
        return (matched, done, index, emitted, final_depth, final_law, tail_depth, fallbacks), None

    vocab = target_logprobs.shape[-1]
    init = (
        jnp.ones((num_drafts,), bool),
        jnp.array(False),
        jnp.zeros((), jnp.int32),
        jnp.full((n + 1,), -1, jnp.int32),
        jnp.full((), n, jnp.int32),
        jnp.zeros((vocab,), target_logprobs.dtype),
        jnp.full((), -1, jnp.int32),
        jnp.zeros((), jnp.int32),
    )
    # n == 0 (no draft tokens) is static: the step is just the bonus token at the root.
    carry = jax.lax.scan(step, init, jnp.arange(n))[0] if n else init
    matched, done, index, emitted, final_depth, final_law, tail_depth, fallbacks = carry
    # Never stopped: every surviving chain reached depth n, the bonus comes from its last row.
    index = jnp.where(done, index, jnp.argmax(matched))
    final_law = jnp.where(done, final_law, jnp.exp(target_logprobs[index, n]))
    last = draw_from_weights(key_final, final_law)
    emitted = jnp.where(jnp.arange(n + 1) == final_depth, last, emitted)
    num_tokens = final_depth + 1
    if tail == "asps" and n:
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
    return make_verdict(emitted, num_tokens, index, fallbacks)


def _reject_options(method: str, options: dict) -> None:
    if options:
        raise ValueError(f"verify_drafts: method {method!r} takes no options, got {options}")


def _pick(method: str, options: dict, defaults: dict) -> dict:
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(
            f"verify_drafts: unknown option(s) {unknown} for method {method!r}; "
            f"allowed: {sorted(defaults)}"
        )
    return {**defaults, **options}


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"verify_drafts: {name} must be an int >= {minimum}, got {value!r}")
    return value


def _table(value) -> int:
    """``table``: 0 (one level law per token) or B >= 2 tabulated laws."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value == 1:
        raise ValueError(f"verify_drafts: table must be an int, 0 or >= 2, got {value!r}")
    return value


def _axis_name(value):
    """``batch_axis``: None, or the name of the ``vmap`` axis the call is mapped over."""
    if value is not None and not isinstance(value, str):
        raise ValueError(
            f"verify_drafts: batch_axis must be a vmap axis name or None, got {value!r}"
        )
    return value


def _rule_config(method: str, vocab: int, options: dict) -> RuleConfig:
    """Validate ``options`` (plain Python values) into a static :class:`RuleConfig`."""
    if method == "optimal":
        legacy = sorted(set(options) & set(PAIRWISE_OPTIONS))
        if legacy:
            raise ValueError(
                f"verify_drafts: method 'optimal' is a gradient-fitted level race and takes no "
                f"LP option {legacy}; the pairwise LP is method='is', rule='truncated_lp'"
            )
        opts = _pick(method, options, OPTIMAL_DEFAULTS)
        return RuleConfig(
            rule="level_race",
            levels=_positive_int("levels", opts["levels"]),
            fit_steps=_positive_int("fit_steps", opts["fit_steps"]),
            table=_table(opts["table"]),
            grad_steps=_positive_int("grad_steps", opts["grad_steps"], minimum=0),
            batch_axis=_axis_name(opts["batch_axis"]),
        )
    opts = _pick(method, options, IS_DEFAULTS)
    rule = opts["rule"]
    if rule not in RULES:
        raise ValueError(f"verify_drafts: unknown rule={rule!r}; choose one of {RULES}")
    if rule == "level_race":
        wrong = sorted(set(options) & set(PAIRWISE_OPTIONS))
        if wrong:
            raise ValueError(
                f"verify_drafts: option(s) {wrong} apply to the pairwise rules "
                f"{PAIRWISE_RULES} only, not rule='level_race' (which takes {RACE_OPTIONS})"
            )
        return RuleConfig(
            rule=rule,
            levels=_positive_int("levels", opts["levels"]),
            fit_steps=_positive_int("fit_steps", opts["fit_steps"]),
            table=_table(opts["table"]),
            batch_axis=_axis_name(opts["batch_axis"]),
        )
    wrong = sorted(set(options) & set(RACE_OPTIONS))
    if wrong:
        raise ValueError(
            f"verify_drafts: option(s) {wrong} apply to rule='level_race' only, not {rule!r}"
        )
    alphabet = opts["alphabet"]
    if not isinstance(alphabet, int) or alphabet < 1:
        raise ValueError(f"verify_drafts: alphabet must be a positive int, got {alphabet!r}")
    if "alphabet" in options and alphabet > vocab:
        raise ValueError(
            f"verify_drafts: alphabet={alphabet} is larger than the vocabulary V={vocab}"
        )
    alphabet = min(alphabet, vocab)
    if rule == "sir":
        block = alphabet
    elif rule == "fixed_order":
        block = 1
    else:
        block = opts["s"]
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"verify_drafts: s must be a positive int, got {block!r}")
        if "s" in options and block > alphabet:
            raise ValueError(f"verify_drafts: s={block} is larger than the alphabet ({alphabet})")
        block = min(block, alphabet)
    if "s" in options and rule != "truncated_lp":
        raise ValueError(f"verify_drafts: s applies to rule='truncated_lp' only, not {rule!r}")
    if not isinstance(opts["lp_iters"], int) or opts["lp_iters"] < 0:
        raise ValueError(f"verify_drafts: lp_iters must be an int >= 0, got {opts['lp_iters']!r}")
    return RuleConfig(
        rule=rule, block=block, alphabet=alphabet, lp_iters=opts["lp_iters"], tol=float(opts["tol"])
    )


def verify_specinfer(key, tokens, lq, lp, draft_length, *, tail="asps", **options) -> Verdict:
    """SpecInfer: recursive rejection sampling with replacement at every node (§3.2)."""
    _reject_options("specinfer", options)
    return verify_tree(specinfer, key, tokens, lq, lp, draft_length, tail=tail)


def verify_specinfer_wor(key, tokens, lq, lp, draft_length, *, tail="asps", **options) -> Verdict:
    """RRS without replacement at the root (§3.3), for root tokens drawn by
    :func:`sample_without_replacement`; deeper nodes (independent continuations) use RRS.

    Root tokens must be distinct among the chains with ``draft_length > 0``: ``verify_drafts``
    raises a ValueError naming a repeated token on concrete input; on traced input a repeated root
    token is never accepted (tokenlevel.specinfer_without_replacement)."""
    _reject_options("specinfer_wor", options)
    return verify_tree(
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
    _reject_options("spectr", options)
    return verify_tree(spectr, key, tokens, lq, lp, draft_length, tail=tail)


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
    cfg = _rule_config("is", lp.shape[-1], options)
    return verify_tree(
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
    cfg = _rule_config("optimal", lp.shape[-1], options)
    return verify_tree(
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


METHODS = {name: REGISTRY[name].verifier for name in names("drafts")}
"""The multi-draft verifiers of the registry (verify/registry.py), name -> function."""
