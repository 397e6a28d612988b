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
