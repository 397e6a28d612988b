"""A separate draft model (``draft=<Model>``): K replicas of every row in a draft KV cache of its
own, rolled out autoregressively each step.

The draft cache holds ``K`` replicas of every batch row (row ``b``, chain ``k`` lives at
``b * K + k``), so K independent chains roll out as one batched loop over depth that writes its
keys/values in place (:func:`rollout`). The rollout feeds ``n + 1`` tokens (the root and all n
draft tokens): when every draft token is accepted the cache then already holds the whole accepted
block, and rolling back is only a matter of resetting the per-row lengths (:meth:`ModelDraft.
commit`, which also syncs the replicas to the one whose path was accepted).

Each drafted token is drawn through :func:`asps_jax.controls.laws` (the sampling
controls on the chain's own path), and the log-law it was drawn from is returned: verification must
compare against exactly that law. A branching tree (``SpecConfig.widths``) draws every node's
children from one law with one key (:class:`~asps_jax.trees.BranchingPlan`). The confidence stop
(``draft_stop="confidence:τ"``, docs/algorithms.md §10) is the rollout's option: a chain stops
growing at the first draft law whose top probability is below the row's τ, and the loop ends
when every chain has, so the draft forwards after that are saved.

Shape letters: R = B * K draft cache rows (one per chain), D = n draft tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from asps_jax import controls, footprint, kv_cache, scoring, sharding
from asps_jax.drafters.base import Drafter, Proposal, chain_keys, finite_laws
from asps_jax.draws import draw_without_replacement
from asps_jax.models import forward_for


@dataclasses.dataclass(frozen=True)
class ModelDraft(Drafter):
    """A draft model of its own KV cache (``draft=<Model>``, or ``"self:L"`` on a family whose
    windowed layers cannot share the target's cache).

    Attributes:
      config: the draft model's config (hashable).
      confidence_stop: chains stop at the first law less sure than the row's
        ``SamplingParams.draft_stop`` τ (a traced value; this flag is its static presence).
    """

    config: Any
    confidence_stop: bool = False

    replicated = True

    @property
    def name(self) -> str:
        return "model"

    def check(self, target, spec) -> None:
        if self.confidence_stop and spec.widths:
            raise ValueError("draft_stop: confidence-stopped chains need K chains, not tree=")
        if self.confidence_stop and spec.tree.plan is not None:  # roots without replacement
            raise ValueError(
                f"draft_stop: confidence-stopped chains need K independent chains; method "
                f"{spec.method.name!r} draws its K roots without replacement (drop draft_stop)"
            )

    def context(self) -> int | None:
        return self.config.max_position_embeddings

    def footprint(self, sizes) -> dict[str, int]:
        d = footprint.model_sizes(self.config)
        rows, itemsize = sizes.rows * sizes.replicas, sizes.draft_itemsize
        step_laws = 3 * footprint.F32 * rows * sizes.vocab  # one depth's logits and laws
        return {
            "kv caches": rows * sizes.slots * d["kv_slot"] * itemsize,
            "draft rollout": max(
                footprint.forward_bytes(d, rows, 1, sizes.slots, itemsize) + step_laws,
                footprint.forward_bytes(d, rows, sizes.prompt, sizes.slots, itemsize),
            ),
            "laws": footprint.rollout_law_bytes(sizes),
        }

    def init(self, dec, params, batch: int):
        return kv_cache.init_cache(
            self.config,
            batch * dec.spec.tree.num_chains,
            dec.cache_len,
            jax.tree.leaves(params)[0].dtype,
            per_layer=kv_cache.per_layer_params(params),
        )

    def prefill(self, dec, params, state, prompts_BP, committed_B):
        # The K replicas of a row (and the n rows of a prompt's samples) start from one cache
        # row: one forward per prompt.
        group = dec.samples * dec.spec.tree.num_chains
        return scoring.prefill_cache_grouped(
            forward_for(self.config), params, state, prompts_BP, committed_B, group
        ).cache

    def refill(self, dec, params, state, take_B, prompts_BP, committed_B):
        # The K replicas of a slot all start from its prompt.
        k = dec.spec.tree.num_chains
        return scoring.refill_rows(
            forward_for(self.config), self.config, params, state, take_B, prompts_BP,
            committed_B, k,
        ).cache  # fmt: skip

    def propose(self, dec, params, sampling, state) -> Proposal:
        spec, k = dec.spec, dec.spec.tree.num_chains
        batch = state.root.shape[0]
        limit_R = None
        if self.confidence_stop:  # no chain grows past what the step can use
            limit_B = jnp.where(state.done, 0, spec.max_new_tokens - state.num_generated - 1)
            limit_R = jnp.repeat(limit_B, k)
        feed = own_feed(forward_for(self.config), params, dec.mesh, batch * k)
        cache, drawn = rollout_proposal(dec, sampling, state, feed, state.draft, limit_R=limit_R)
        return Proposal(**drawn, state=cache)

    def commit(self, dec, before, after, winner_B, num_B):
        """The replicas take the winner's slots (a root path whose prefix is the accepted path)
        and every replica's length is the row's committed length."""
        k = dec.spec.tree.num_chains
        start_B = before.lengths.reshape(num_B.shape[0], k)[:, 0]
        cache = after
        if k > 1:
            cache = _sync_replicas(cache, start_B, winner_B, k, dec.spec.num_draft_tokens + 1)
        return dataclasses.replace(cache, lengths=jnp.repeat(start_B + num_B, k))


def own_feed(forward, params, mesh, rows: int):
    """The rollout's feed with the draft's own cache (batch R = ``rows``): one token per row, its
    keys / values committed; ``feed(cache, token_R, depth) -> (cache, logits float32[R, 1, V])``
    (its constant masks made once, outside the rollout's loop)."""
    row_loop = kv_cache.row_loop_for(mesh, params)
    valid_R1, nodes_R1 = jnp.ones((rows, 1), bool), jnp.zeros((rows, 1), jnp.int32)
    ones_R = jnp.ones((rows,), jnp.int32)

    def feed(cache, token_R, depth):
        del depth
        out = scoring.score_chain(forward, params, cache, token_R[:, None], valid_R1)
        logits_R1V, new_kv = out.logits, out.kv
        return kv_cache.commit(cache, new_kv, nodes_R1, ones_R, row_loop=row_loop), logits_R1V

    return feed


def _law(logits_R1V, at, path_RD, *, sampling, history, mesh):
    """The processed draft law at depth ``at`` from one feed's logits, on each chain's own path:
    ``(logprobs float32[R, V], usable bool[R], finite bool[R])`` (finite: the raw logits',
    :func:`~asps_jax.drafters.base.finite_laws`)."""
    logits_R1V = sharding.constrain(logits_R1V, ("batch", None, "vocab"), mesh)
    lp_R1V, mass_R1 = controls.laws(
        sampling, history, logits_R1V, path_RD[:, None], at[None], draft=True
    )
    finite_R = finite_laws(logits_R1V[:, 0])
    return lp_R1V[:, 0], finite_R & mass_R1[:, 0], finite_R


def _depth_keys(keys_R, depth):
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_R, depth)


def _draw_tree(plan, depth, keys_R, logprobs_RV, ok_R, finite_R):
    """Children of each node from the law and key of the first row through it."""
    rows = keys_R.shape[0]
    group_first, sibling = (jnp.asarray(t)[depth] for t in plan.tables)
    width = plan.num_chains
    rows_R = jnp.arange(rows)
    first_R = rows_R - rows_R % width + jnp.tile(group_first, rows // width)
    sibling_R = jnp.tile(sibling, rows // width)
    keys_R, logprobs_RV, ok_R = keys_R[first_R], logprobs_RV[first_R], ok_R[first_R]
    finite_R = finite_R[first_R]
    if plan.replace:
        child_keys = jax.vmap(jax.random.fold_in)(keys_R, sibling_R)
        return jax.vmap(controls.sample_token)(child_keys, logprobs_RV), logprobs_RV, ok_R, finite_R

    def without_replacement(key, logprobs_V, s):
        return draw_without_replacement(key, logprobs_V, plan.max_width)[s]

    next_R = jax.vmap(without_replacement)(keys_R, logprobs_RV, sibling_R)
    return next_R, logprobs_RV, ok_R, finite_R


def rollout(
    feed,
    cache,
    root_R: jax.Array,
    keys_R: jax.Array,
    *,
    draft_len: int,
    sampling,
    history,
    mesh=None,
    plan=None,
    limit_R: jax.Array | None = None,
    store_last: bool = True,
):
    """Roll out ``draft_len`` tokens for every row ``R = B * K``.

    Args:
      feed: ``feed(cache, token_R, depth) -> (cache, logits float32[R, 1, V])``, one draft
        forward (:func:`own_feed`, or a self-draft's over the target cache).
      cache: what ``feed`` reads and writes; returned with the rollout's slots written.
      root_R: int32[R], the token every chain starts from (the last emitted token).
      keys_R: typed PRNG keys [R], one per chain; depth ``i`` uses ``fold_in(key, i)``.
      sampling / history: the rows' ``SamplingParams`` and ``controls.History`` (batch R): the
        law at depth i is processed from the committed text followed by the row's first i draft
        tokens (its own path), with ``draft_temperature``.
      plan: None (every row draws its own chain), or a :class:`~asps_jax.trees.BranchingPlan`.
      limit_R: the confidence stop (int32[R], the most tokens the caller can use per chain): a
        ``lax.while_loop`` over depth stops at the first law whose top probability is below
        ``sampling.draft_stop``; None rolls out every depth (``lax.scan``). τ = 0 gives the
        scan's chains draw for draw.
      store_last: feed x_n too, so the cache holds its keys / values (a draft cache of its own).

    Returns:
      ``(cache, tokens int32[R, n], logprobs float32[R, n, V], laws_ok bool[R, n], finite
      bool[R, n], usable int32[R])``; ``laws_ok[r, i]`` is False when the law of depth i had a
      NaN or ``+inf`` logit or no finite one (then ``finite[r, i]`` is False too), or the
      controls banned every token; ``usable`` is None without a stop.
    """
    law = lambda logits, at, path: _law(  # noqa: E731
        logits, at, path, sampling=sampling, history=history, mesh=mesh
    )
    if limit_R is not None:
        if plan is not None:
            raise ValueError("draft_stop: confidence-stopped chains need K chains, not tree=")
        return _rollout_stopped(feed, law, cache, root_R, keys_R, draft_len, sampling, limit_R)

    def body(carry, depth):
        cache, token_R, path_RD = carry
        cache, logits_R1V = feed(cache, token_R, depth)
        logprobs_RV, ok_R, finite_R = law(logits_R1V, depth, path_RD)
        depth_keys = _depth_keys(keys_R, depth)
        if plan is not None:
            next_R, logprobs_RV, ok_R, finite_R = _draw_tree(
                plan, depth, depth_keys, logprobs_RV, ok_R, finite_R
            )
        else:
            next_R = jax.vmap(controls.sample_token)(depth_keys, logprobs_RV)
        path_RD = jax.lax.dynamic_update_slice_in_dim(path_RD, next_R[:, None], depth, axis=1)
        return (cache, next_R, path_RD), (next_R, logprobs_RV, ok_R, finite_R)

    rows = root_R.shape[0]
    path_RD = jnp.zeros((rows, draft_len), jnp.int32)
    (cache, last_R, _), (tokens_DR, logprobs_DRV, ok_DR, finite_DR) = jax.lax.scan(
        body, (cache, root_R, path_RD), jnp.arange(draft_len)
    )
    if store_last:  # the (n+1)-th feed only stores x_n's keys/values; its law is never used
        cache, _ = feed(cache, last_R, jnp.asarray(draft_len))
    lp_RDV, ok_RD, finite_RD = (jnp.swapaxes(a, 0, 1) for a in (logprobs_DRV, ok_DR, finite_DR))
    return cache, jnp.swapaxes(tokens_DR, 0, 1), lp_RDV, ok_RD, finite_RD, None


def rollout_proposal(dec, sampling, state, feed, cache, **options) -> tuple[Any, dict]:
    """``(cache, fields)``: the step's K root paths rolled out by ``feed`` from ``cache``
    (:func:`rollout`, its ``options``), as the fields of a :class:`Proposal` but its state."""
    n, k = dec.spec.num_draft_tokens, dec.spec.tree.num_chains
    batch = state.root.shape[0]
    cache, tokens_RD, lp_RDV, ok_RD, finite_RD, usable_R = rollout(
        feed,
        cache,
        jnp.repeat(state.root, k),
        chain_keys(state, k),
        draft_len=n,
        sampling=sampling.repeat(k),
        mesh=dec.mesh,
        plan=dec.spec.tree.plan,
        history=state.history.repeat(k),
        **options,
    )
    return cache, dict(
        tokens_BKD=tokens_RD.reshape(batch, k, n),
        logprobs_BKDV=lp_RDV.reshape(batch, k, n, lp_RDV.shape[-1]),
        ok_BKD=ok_RD.reshape(batch, k, n),
        usable_BK=usable_lengths(usable_R, batch, k, n),
        finite_BKD=finite_RD.reshape(batch, k, n),
    )


def usable_lengths(usable_R, batch: int, num_chains: int, draft_len: int) -> jax.Array:
    """int32[B, K]: each chain's usable length from :func:`rollout`'s ``usable`` (None: every
    chain uses all ``draft_len`` tokens)."""
    if usable_R is None:
        return jnp.full((batch, num_chains), draft_len, jnp.int32)
    return usable_R.reshape(batch, num_chains)


def _rollout_stopped(feed, law, cache, root_R, keys_R, n: int, sampling, limit_R):
    """:func:`rollout` with confidence-stopped chains: ``usable[r]`` is chain r's length under
    the rule (n when it never stopped); entries at and past it are not used. Depth i uses the
    same operations and keys as the scan, so τ = 0 (no chain ever stops) draws the same."""
    rows = root_R.shape[0]
    tau_R = sampling.draft_stop

    def cond(carry):
        depth, stop_R = carry[0], carry[-1]
        # A chain grows while depth < its stop (its last fed token is x_depth); depth == n only
        # stores x_n's keys / values. The root is always fed (the cache layout needs its keys).
        return (depth <= n) & ((depth == 0) | jnp.any(stop_R >= depth))

    def body(carry):
        depth, cache, token_R, tokens_RD, lp_RDV, ok_RD, finite_RD, stop_R = carry
        cache, logits_R1V = feed(cache, token_R, depth)
        at = jnp.minimum(depth, n - 1)
        logprobs_RV, ok_R, finite_R = law(logits_R1V, at, tokens_RD)
        next_R = jax.vmap(controls.sample_token)(_depth_keys(keys_R, depth), logprobs_RV)
        growing = depth < n
        unsure_R = jnp.exp(jnp.max(logprobs_RV, axis=-1)) < tau_R
        stop_R = jnp.where(growing & (stop_R > depth) & unsure_R, depth, stop_R)
        upd = lambda buf, new: jnp.where(  # noqa: E731
            growing, jax.lax.dynamic_update_slice_in_dim(buf, new[:, None], at, axis=1), buf
        )
        tokens_RD = upd(tokens_RD, next_R)
        lp_RDV, ok_RD, finite_RD = (
            upd(lp_RDV, logprobs_RV),
            upd(ok_RD, ok_R),
            upd(finite_RD, finite_R),
        )
        return depth + 1, cache, next_R, tokens_RD, lp_RDV, ok_RD, finite_RD, stop_R

    # The law's width is the draft's vocabulary: take it from one traced forward's shape.
    vocab = jax.eval_shape(lambda c: feed(c, root_R, jnp.asarray(0))[1], cache).shape[-1]
    init = (
        jnp.zeros((), jnp.int32),
        cache,
        root_R,
        jnp.zeros((rows, n), jnp.int32),  # the chain so far: also the controls' path
        jnp.zeros((rows, n, vocab), jnp.float32),
        jnp.ones((rows, n), bool),
        jnp.ones((rows, n), bool),
        jnp.clip(limit_R.astype(jnp.int32), 0, n),
    )
    _, cache, _, tokens_RD, lp_RDV, ok_RD, finite_RD, stop_R = jax.lax.while_loop(cond, body, init)
    return cache, tokens_RD, lp_RDV, ok_RD, finite_RD, stop_R


def _sync_replicas(cache: kv_cache.KVCache, start_B, winner_B, num_drafts: int, width: int):
    """Copy slots ``[start, start + width)`` of the winning chain's replica to all K replicas."""
    batch = start_B.shape[0]

    def sync(a):  # [L, B * K, KVH, S, H]
        layers = a.shape[0]
        a_LBKS = a.reshape((layers, batch, num_drafts) + a.shape[2:])

        def per_row(row_a, start, winner):  # row_a: [L, K, KVH, S, H]
            window = jax.lax.dynamic_slice_in_dim(row_a, start, width, axis=3)
            chosen = jnp.take(window, winner, axis=1)[:, None]
            window = jnp.broadcast_to(chosen, window.shape)
            return jax.lax.dynamic_update_slice_in_dim(row_a, window, start, axis=3)

        a_LBKS = jax.vmap(per_row, in_axes=(1, 0, 0), out_axes=1)(a_LBKS, start_B, winner_B)
        return a_LBKS.reshape(a.shape)

    k, v = (kv_cache.map_layers(sync, a) for a in (cache.k, cache.v))
    return dataclasses.replace(cache, k=k, v=v)
