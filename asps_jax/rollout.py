"""Draft rollout: n autoregressive draft tokens per chain, with the draft's own KV cache.

The draft cache holds ``K`` replicas of every batch row (row ``b``, chain ``k`` lives at
``b * K + k``), so K independent chains roll out as one batched ``lax.scan`` over depth that writes
its keys/values in place. The rollout feeds ``n + 1`` tokens (the root and all n draft tokens): when
every draft token is accepted the cache then already holds the whole accepted block, and rolling
back is only a matter of resetting the per-row lengths (see ``decode._commit``).

Each drafted token is drawn through :func:`asps_jax.processors.process_logits`, and the log-law it
was drawn from is returned: verification must compare against exactly that law.

Shape letters: R = B * K draft cache rows (one per chain), D = n draft tokens, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from asps_jax import kv_cache, penalties, scoring, selfdraft, sharding
from asps_jax.draws import draw_without_replacement
from asps_jax.processors import logits_ok, sample_token


def rollout(
    forward,
    params,
    cache: kv_cache.KVCache,
    root_R: jax.Array,
    keys_R: jax.Array,
    *,
    draft_len: int,
    sampling,
    mesh=None,
    plan=None,
    history,
    shared_layers: int | None = None,
):
    """Roll out ``draft_len`` tokens for every cache row ``R = B * K``.

    Args:
      forward: the draft forward with its config bound.
      cache: the draft cache (batch R); it is returned with ``draft_len + 1`` new slots written and
        ``lengths`` advanced by ``draft_len + 1`` (the caller resets lengths after verification).
      root_R: int32[R], the token every chain starts from (the last emitted token).
      keys_R: typed PRNG keys [R], one per chain; depth ``i`` uses ``fold_in(key, i)``.
      sampling: the rows' ``processors.SamplingParams`` (batch R); drafts use
        ``draft_temperature``.
      mesh: the mesh of a sharded run (activation constraints on the draft logits), or None.
      plan: None (every row draws its own chain), or a :class:`~asps_jax.trees.BranchingPlan`:
        the rows of one batch row (``R = B * L``) draw a branching tree, every node its children
        from one law with one key (``plan.replace``: independently, else without replacement);
        each row then carries the law its node's children were drawn from.
      history: the rows' :class:`~asps_jax.penalties.History` (batch R): the law at depth i is
        processed from the committed text followed by the row's first i draft tokens (its own
        path).
      shared_layers: None (the draft's own cache, batch R), or L: ``cache`` is the *target's*
        cache (batch B) and the draft (L layers) reads its first L layers for the committed
        prefix and keeps its rollout in scratch slots past it
        (:func:`~asps_jax.selfdraft.shared_feed`); the cache's lengths are then unchanged and the
        last feed is skipped.

    Returns:
      ``(cache, tokens int32[R, n], logprobs float32[R, n, V], laws_ok bool[R, n])``;
      ``laws_ok[r, i]`` is False when the law of depth i had a NaN or ``+inf`` logit or no finite
      one (see :func:`asps_jax.processors.logits_ok`), or the controls banned every token.
    """
    rows = root_R.shape[0]
    ones_R = jnp.ones((rows,), jnp.int32)
    row_loop = kv_cache.row_loop_for(mesh)
    zeros_R1 = jnp.zeros((rows, 1), jnp.int32)
    valid_R1 = jnp.ones((rows, 1), bool)

    def draw_tree(depth, keys_R, logprobs_RV, ok_R):
        """Children of each node from the law and key of the first row through it."""
        group_first, sibling = (jnp.asarray(t)[depth] for t in plan.tables)
        width = plan.num_chains
        rows_R = jnp.arange(rows)
        first_R = rows_R - rows_R % width + jnp.tile(group_first, rows // width)
        sibling_R = jnp.tile(sibling, rows // width)
        keys_R, logprobs_RV, ok_R = keys_R[first_R], logprobs_RV[first_R], ok_R[first_R]
        if plan.replace:
            child_keys = jax.vmap(jax.random.fold_in)(keys_R, sibling_R)
            return jax.vmap(sample_token)(child_keys, logprobs_RV), logprobs_RV, ok_R

        def without_replacement(key, logprobs_V, s):
            return draw_without_replacement(key, logprobs_V, plan.max_width)[s]

        next_R = jax.vmap(without_replacement)(keys_R, logprobs_RV, sibling_R)
        return next_R, logprobs_RV, ok_R

    def feed(cache, token_R, depth, path_RD):
        if shared_layers is None:
            logits_R1V, new_kv = scoring.score_chain(
                forward, params, cache, token_R[:, None], valid_R1
            )
            cache = kv_cache.commit(cache, new_kv, zeros_R1, ones_R, row_loop=row_loop)
        else:
            logits_R1V, cache = selfdraft.shared_feed(
                forward, params, cache, token_R, depth, shared_layers, row_loop
            )
        logits_R1V = sharding.constrain(logits_R1V, ("batch", None, "vocab"), mesh)
        lp_R1V, mass_R1 = penalties.process(
            sampling, history, logits_R1V, path_RD[:, None], depth[None], draft=True
        )
        logprobs_RV = lp_R1V[:, 0]
        ok_R = logits_ok(logits_R1V[:, 0]) & mass_R1[:, 0]
        depth_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_R, depth)
        if plan is not None:
            next_R, logprobs_RV, ok_R = draw_tree(depth, depth_keys, logprobs_RV, ok_R)
        else:
            next_R = jax.vmap(sample_token)(depth_keys, logprobs_RV)
        return cache, next_R, logprobs_RV, ok_R

    def body(carry, depth):
        cache, token_R, path_RD = carry
        cache, next_R, logprobs_RV, ok_R = feed(cache, token_R, depth, path_RD)
        path_RD = jax.lax.dynamic_update_slice_in_dim(path_RD, next_R[:, None], depth, axis=1)
        return (cache, next_R, path_RD), (next_R, logprobs_RV, ok_R)

    path_RD = jnp.zeros((rows, draft_len), jnp.int32)
    (cache, last_R, _), (tokens_DR, logprobs_DRV, ok_DR) = jax.lax.scan(
        body, (cache, root_R, path_RD), jnp.arange(draft_len)
    )
    if shared_layers is None:
        # The (n+1)-th feed only stores x_n's keys/values; its law is never used.
        logits_R1V, new_kv = scoring.score_chain(forward, params, cache, last_R[:, None], valid_R1)
        del logits_R1V
        cache = kv_cache.commit(cache, new_kv, zeros_R1, ones_R, row_loop=row_loop)
    tokens_RD = jnp.swapaxes(tokens_DR, 0, 1)
    logprobs_RDV = jnp.swapaxes(logprobs_DRV, 0, 1)
    return cache, tokens_RD, logprobs_RDV, jnp.swapaxes(ok_DR, 0, 1)


def rollout_stopped(
    forward,
    params,
    cache: kv_cache.KVCache,
    root_R: jax.Array,
    keys_R: jax.Array,
    *,
    draft_len: int,
    sampling,
    mesh=None,
    plan=None,
    history,
    limit_R: jax.Array | None = None,
):
    """:func:`rollout` with confidence-stopped chains (docs/algorithms.md §10).

    A chain stops growing at the first depth i whose draft law's top probability is below the
    row's ``sampling.draft_stop`` τ: its usable length is then i (its tokens x_1 .. x_i, whose
    keys / values are in the cache; x_{i+1} is not used). A ``lax.while_loop`` over depth runs
    until every chain has stopped or reached ``draft_len`` (or its ``limit_R``, the most the
    caller can use), so the draft forwards after that are saved, not masked. Depth i uses
    ``fold_in(key, i)`` and the same operations as :func:`rollout`, so τ = 0 (no chain ever
    stops) gives :func:`rollout`'s chains draw for draw.

    Returns ``(cache, tokens int32[R, n], logprobs float32[R, n, V], laws_ok bool[R, n],
    stop int32[R])``: ``stop[r]`` is chain r's usable length under the rule (``draft_len`` when
    it never stopped); entries at and past it are not used.
    """
    if plan is not None:
        raise ValueError("draft_stop: confidence-stopped chains need K chains, not tree=")
    rows = root_R.shape[0]
    ones_R = jnp.ones((rows,), jnp.int32)
    row_loop = kv_cache.row_loop_for(mesh)
    zeros_R1 = jnp.zeros((rows, 1), jnp.int32)
    valid_R1 = jnp.ones((rows, 1), bool)
    n = draft_len
    limit_R = jnp.full((rows,), n, jnp.int32) if limit_R is None else limit_R.astype(jnp.int32)
    tau_R = sampling.draft_stop

    def feed(cache, token_R):
        logits_R1V, new_kv = scoring.score_chain(forward, params, cache, token_R[:, None], valid_R1)
        logits_R1V = sharding.constrain(logits_R1V, ("batch", None, "vocab"), mesh)
        cache = kv_cache.commit(cache, new_kv, zeros_R1, ones_R, row_loop=row_loop)
        return cache, logits_R1V

    def cond(carry):
        depth, stop_R = carry[0], carry[-1]
        # A chain grows while depth < its stop (its last fed token is x_depth); depth == n only
        # stores x_n's keys / values.
        # The root is always fed (the cache layout needs its keys / values).
        return (depth <= n) & ((depth == 0) | jnp.any(stop_R >= depth))

    def body(carry):
        depth, cache, token_R, tokens_RD, lp_RDV, ok_RD, stop_R = carry
        cache, logits_R1V = feed(cache, token_R)
        at = jnp.minimum(depth, n - 1)
        lp_R1V, mass_R1 = penalties.process(
            sampling, history, logits_R1V, tokens_RD[:, None], at[None], draft=True
        )
        logprobs_RV = lp_R1V[:, 0]
        ok_R = logits_ok(logits_R1V[:, 0]) & mass_R1[:, 0]
        depth_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_R, depth)
        next_R = jax.vmap(sample_token)(depth_keys, logprobs_RV)
        growing = depth < n
        unsure_R = jnp.exp(jnp.max(logprobs_RV, axis=-1)) < tau_R
        stop_R = jnp.where(growing & (stop_R > depth) & unsure_R, depth, stop_R)
        upd = lambda buf, new: jnp.where(  # noqa: E731
            growing, jax.lax.dynamic_update_slice_in_dim(buf, new[:, None], at, axis=1), buf
        )
        tokens_RD = upd(tokens_RD, next_R)
        lp_RDV = upd(lp_RDV, logprobs_RV)
        ok_RD = upd(ok_RD, ok_R)
        return depth + 1, cache, next_R, tokens_RD, lp_RDV, ok_RD, stop_R

    # The law's width is the draft's vocabulary: take it from one traced forward's shape.
    vocab = jax.eval_shape(lambda c: feed(c, root_R)[1], cache).shape[-1]
    init = (
        jnp.zeros((), jnp.int32),
        cache,
        root_R,
        jnp.zeros((rows, n), jnp.int32),  # the chain so far: also the controls' path
        jnp.zeros((rows, n, vocab), jnp.float32),
        jnp.ones((rows, n), bool),
        jnp.clip(limit_R, 0, n),
    )
    _, cache, _, tokens_RD, lp_RDV, ok_RD, stop_R = jax.lax.while_loop(cond, body, init)
    return cache, tokens_RD, lp_RDV, ok_RD, stop_R
