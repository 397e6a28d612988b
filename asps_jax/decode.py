"""The jitted speculative decoding loop: a static :class:`Decoder` with ``prefill``, ``step`` and
``generate``.

A :class:`Decoder` is the frozen, hashable description of the loop (model configs, method, shapes,
cache length); it is the static ``self`` of every jitted entry point, and everything that varies per
call (parameters, prompts, keys, sampling parameters) is an array pytree. One compiled step runs six
stages, each in its own ``jax.named_scope`` so that a profile reads as the step does:

Every stage reads one static tree, ``SpecConfig.tree`` (a :class:`~asps_jax.trees.DraftTree`):
K chains are the tree of widths ``(K, 1, ..., 1)``, a branching tree its own widths; one draft cache
replica per root path. The stages see the tree by node:

1. ``draft``: the drafter (``Decoder.drafter``, :mod:`asps_jax.drafters`) proposes the tree's root
   paths, laid out by node: each node's token and the draft law it was drawn from, and each root
   path's usable length;
2. ``score``: one target forward over the tree (``scoring.py``), each slot attending to the scored
   slots of its root path; a verifier that merges equal siblings has each merged node scored
   once (``verify.step.scored_slots``); the target laws are processed per node from its path;
3. ``verify``: the method's verifier through its one adapter (``verify.step.verify_step``: chain
   and multi-draft verifiers read the root paths, tree verifiers the nodes), which returns the
   verdict, the accepted path as nodes and the replica that drew it; then the emitted block's
   end (EOS, a constraint's dead slot, a stop string: ``controls.cut``);
4. ``commit``: the accepted path (root, then the accepted nodes) into the target cache, and the
   drafter's state after it (``Drafter.commit``: a draft model's replicas synced to the replica
   that drew it);
5. ``metrics``: the per-row counters (``statistics.update``);
6. ``emit``: the emitted tokens, and the target's log-probability of each (gathered from the laws
   the score stage already processed, along the accepted path), into each row's output.

After either kind of step the rows' history takes the emitted tokens (``controls.commit``).

``generate`` runs prefill and the whole loop in one ``lax.while_loop``; ``prefill`` + ``step`` are
the step-wise entry points for streaming.

Cache layout: both caches hold every committed token *except* the last emitted one, the *root*,
which is fed at the start of the next step. A step that emits l tokens therefore commits l slots:
the root and the l - 1 accepted draft tokens. Every row advances by its own l.
The drafter keeps its own state in ``DecodeState.draft`` (a draft model's cache replicas; nothing
for a lookup or for a self-draft that reads the target cache's first L layers).

Randomness: one key per row; step keys are ``fold_in(row_key, tokens generated so far)``, then split
by purpose (draft chain k, verification). A row's tokens thus depend only on its key, its prompt and
the sampling parameters, never on the rest of the batch.

Shape letters (docs/design.md, Shapes): B batch, T query tokens, S cache length, N tree nodes,
D tree depth (= n, the draft length), K drafts, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from asps_jax import controls, decode_state, kv_cache, scoring, sharding, statistics, trees
from asps_jax.decode_state import DecodeState, Drafts, SpecConfig
from asps_jax.drafters.base import Drafter, Proposal, all_step_keys, step_keys, unusable_depths
from asps_jax.models import forward_for
from asps_jax.models.output import ForwardOut
from asps_jax.statistics import DecodeStats
from asps_jax.verify import Verdict
from asps_jax.verify.acceptance import identical_drafts_acceptance
from asps_jax.verify.step import scored_slots, verify_step

__all__ = ["DecodeState", "DecodeStats", "Decoder", "SamplingParams", "SpecConfig"]

SamplingParams = controls.SamplingParams  # the per-row sampling parameters every entry point takes

_PURPOSE_VERIFY = 1  # (drafting is purpose 0: drafters.base.PURPOSE_DRAFT)
_PURPOSE_AR = 2
_ROWS = "rows"  # the vmap axis over a batch's rows in verification


@dataclasses.dataclass(frozen=True)
class Decoder:
    """The static description of a decoding loop: frozen and hashable, it is the static ``self``
    of the jitted :meth:`prefill`, :meth:`step` and :meth:`generate`, and of :meth:`empty` /
    :meth:`insert`, the slot seam of continuous batching (two equal decoders share one compiled
    program).

    Attributes:
      target_config: the target model's config (hashable).
      drafter: who drafts (:class:`~asps_jax.drafters.Drafter`, a frozen value); None for
        ``"ar"``.
      spec: the method and its static sizes.
      cache_len: S, the KV cache slots per row.
      mesh: the device mesh of a sharded run, for activation sharding constraints
        (:func:`asps_jax.sharding.constrain`); None on one device.
      diagnostics: also measure, every step with K >= 2 drafts, ``optimal_acceptance`` at the
        root (a V-sized sort per row and step); without it that statistic is NaN.
        With one draft it is ``1 - TV(p, q)``, cheap, and always measured.
      merge_tree: a verifier that merges equal siblings (the tree methods) has only the merged
        tree's nodes scored (a slot that repeats an earlier sibling's token is masked out of the
        target forward, as the verifier never reads it); False scores every slot (the same
        tokens; kept to compare the two).
      top_logprobs: k, the most likely tokens of each emitted token's law recorded in
        ``DecodeState.top_logprobs`` (0: none).
      raw_logprobs: also record each emitted token's log-probability under the unprocessed
        target law (``DecodeState.raw_logprobs``; a log-normalizer per emitted slot).
      samples: n, the samples per prompt of a call whose rows ``p * n + i`` hold prompt p
        (``sample(..., n=n)``): prefill runs the target once per prompt and copies its cache rows
        to the prompt's n rows (1: every row its own).
    """

    target_config: Any
    drafter: Drafter | None
    spec: SpecConfig
    cache_len: int
    mesh: Mesh | None = None
    diagnostics: bool = False
    merge_tree: bool = True
    top_logprobs: int = 0
    raw_logprobs: bool = False
    samples: int = 1

    # ----------------------------------------------------------------------------------------
    # Entry points (jitted; ``self`` is static)

    @functools.partial(jax.jit, static_argnames="self")
    def prefill(
        self,
        target_params,
        draft_params,
        prompts_BP,
        prompt_lengths_B,
        row_keys_B,
        stop=None,
        budget_B=None,
    ) -> DecodeState:
        """Build the caches from right-padded prompts; the last prompt token becomes the root.
        ``stop``: the call's :class:`~asps_jax.controls.StopStrings` (None: none);
        ``budget_B``: int32[B], each row's ``max_new_tokens`` (None: ``spec.max_new_tokens`` for
        every row)."""
        return decode_state.prefill(
            self,
            target_params,
            draft_params,
            prompts_BP,
            prompt_lengths_B,
            row_keys_B,
            stop,
            budget_B,
        )

    @functools.partial(jax.jit, static_argnames="self", donate_argnames="state")
    def step(self, target_params, draft_params, sampling, state) -> DecodeState:
        """One speculative step for every row (finished rows are left unchanged)."""
        return _step(self, target_params, draft_params, sampling, state)

    @functools.partial(jax.jit, static_argnames=("self", "prompt_width"))
    def empty(
        self, target_params, draft_params, row_keys_B, prompt_width: int, stop=None
    ) -> DecodeState:
        """A state of ``B`` empty rows (``B``: the keys' length), every one done and nothing run,
        for :meth:`insert` to fill with prompts of at most ``prompt_width`` tokens (JetStream's
        ``init_decode_state``)."""
        return decode_state.empty(self, target_params, draft_params, row_keys_B, prompt_width, stop)

    @functools.partial(jax.jit, static_argnames="self", donate_argnames="state")
    def insert(
        self, target_params, draft_params, state, take_B, prompts_BP, lengths_B, keys_B, budget_B
    ) -> DecodeState:
        """The rows ``take_B`` (bool[B]) of ``state`` restart from new prompts (row b from
        ``prompts_BP[b]``, ``lengths_B[b]`` tokens, key ``keys_B[b]``, budget ``budget_B[b]``); the
        other rows are unchanged (continuous batching, :mod:`asps_jax.slots`; JetStream's
        ``insert``). Like :meth:`step`, it donates ``state``."""
        return decode_state.insert(
            self,
            target_params,
            draft_params,
            state,
            take_B,
            prompts_BP,
            lengths_B,
            keys_B,
            budget_B,
        )

    @functools.partial(jax.jit, static_argnames="self")
    def generate(
        self,
        target_params,
        draft_params,
        sampling,
        prompts_BP,
        prompt_lengths_B,
        row_keys_B,
        stop=None,
        budget_B=None,
    ) -> DecodeState:
        """Prefill and run steps in one ``lax.while_loop`` until every row is done."""
        state = decode_state.prefill(
            self,
            target_params,
            draft_params,
            prompts_BP,
            prompt_lengths_B,
            row_keys_B,
            stop,
            budget_B,
        )

        def cond(state):
            return ~jnp.all(state.done)

        def body(state):
            return _step(self, target_params, draft_params, sampling, state)

        return jax.lax.while_loop(cond, body, state)


# The jitted entry points as functions of (decoder, arrays...), e.g. for ``.lower(decoder, ...)``.
prefill = Decoder.prefill
spec_step = Decoder.step
generate = Decoder.generate


# --------------------------------------------------------------------------------------------
# Prefill


# --------------------------------------------------------------------------------------------
# One step


def _write_block(row_out, row_new, start, count):
    """One row: ``row_out[start + j] = row_new[j]`` for ``j < count`` (leading axis; the rest of
    ``row_out``, and slots ``j >= count``, unchanged)."""
    width = row_new.shape[0]
    window = jax.lax.dynamic_slice_in_dim(row_out, start, width)
    keep = (jnp.arange(width) < count).reshape((width,) + (1,) * (row_new.ndim - 1))
    window = jnp.where(keep, row_new, window)
    return jax.lax.dynamic_update_slice_in_dim(row_out, window, start, axis=0)


def _emit(
    dec: Decoder, state: DecodeState, block_BT, block_lp_BT, num_B, extra_done_B
) -> DecodeState:
    """Write ``block[:num]`` of each active row (and the target log-probabilities of those
    tokens, ``block_lp``) at its output position; mark finished rows."""
    active_B = ~state.done
    num_B = jnp.where(active_B, num_B, 0)
    out = jax.vmap(_write_block)(state.tokens, block_BT, state.num_generated, num_B)
    out_lp = jax.vmap(_write_block)(state.logprobs, block_lp_BT, state.num_generated, num_B)
    generated_B = state.num_generated + num_B
    last_B = jnp.take_along_axis(block_BT, jnp.maximum(num_B - 1, 0)[:, None], axis=1)[:, 0]
    done_B = state.done | (active_B & (extra_done_B | (generated_B >= state.budget)))
    return dataclasses.replace(
        state,
        tokens=out,
        logprobs=out_lp,
        num_generated=generated_B,
        root=jnp.where(num_B > 0, last_B, state.root),
        done=done_B,
    )


def _first_false(ok_X, absent: int) -> jax.Array:
    """The first index along the last axis where ``ok`` is False, ``absent`` where none is."""
    return jnp.where(jnp.all(ok_X, axis=-1), absent, jnp.argmax(~ok_X, axis=-1))


def _ar_step(dec: Decoder, target_params, sampling, state):
    forward = forward_for(dec.target_config)
    batch = state.root.shape[0]
    valid_BT = jnp.ones((batch, 1), bool)
    with jax.named_scope("score"):
        scored = scoring.score_chain(
            forward, target_params, state.target_cache, state.root[:, None], valid_BT
        )
        logits_BTV = sharding.constrain(scored.logits, ("batch", None, "vocab"), dec.mesh)
        logprobs_BTV, has_mass_BT = controls.laws(
            sampling, state.history, logits_BTV, jnp.zeros((batch, 1, 0), jnp.int32), [0]
        )
        logprobs_BV = logprobs_BTV[:, 0]
    with jax.named_scope("verify"):
        next_B = jax.vmap(controls.sample_token)(step_keys(state, _PURPOSE_AR), logprobs_BV)
        active_B = ~state.done
        # A row whose law is unusable emits nothing and stops there.
        failed_B = active_B & ~(controls.logits_ok(logits_BTV[:, 0]) & has_mass_BT[:, 0])
        num_B = (active_B & ~failed_B).astype(jnp.int32)
    with jax.named_scope("commit"):
        nodes_B1 = jnp.zeros((batch, 1), jnp.int32)
        t_cache, row_loop = state.target_cache, kv_cache.row_loop_for(dec.mesh, state)
        t_cache = kv_cache.commit(t_cache, scored.kv, nodes_B1, num_B, row_loop=row_loop)
        # One token: an EOS or a stop string it completes is kept with it (num stays).
        num_B, hit, stop = controls.cut(
            sampling, state.history, state.stop, next_B[:, None], num_B, state.num_generated
        )
    with jax.named_scope("metrics"):
        stats = statistics.update(
            state.stats,
            active_B=active_B,
            emitted_B=num_B,
            failed_at_B=jnp.where(failed_B, state.num_generated, -1),
        )
    state = dataclasses.replace(state, target_cache=t_cache, stats=stats, stop=stop)
    state = _record_top_logprobs(dec, state, logprobs_BTV, num_B)
    state = _record_raw_logprobs(dec, state, logits_BTV, next_B[:, None], num_B)
    with jax.named_scope("emit"):
        next_lp_BT = jnp.take_along_axis(logprobs_BV, next_B[:, None], axis=1)
        return _emit(dec, state, next_B[:, None], next_lp_BT, num_B, hit | failed_B)


def _draft(dec: Decoder, draft_params, sampling, state) -> Drafts:
    """Stage 1: the drafter's K root paths (``Drafter.propose``), cut and laid out by node."""
    proposal = dec.drafter.propose(dec, draft_params, sampling, state)
    return _finish_drafts(dec, sampling, state, proposal)


def _finish_drafts(dec: Decoder, sampling, state, proposal: Proposal) -> Drafts:
    """The drafter's root paths (K = L replicas) cut to their usable lengths (``usable_BK``: the
    drafter's own, e.g. a lookup match's or a confidence stop's), then the common cuts below, and
    laid out by node."""
    spec, tree = dec.spec, dec.spec.tree
    n = spec.num_draft_tokens
    tokens_BKD, draft_lp_BKDV = proposal.tokens_BKD, proposal.logprobs_BKDV
    # Drafts are shortened so that a step never emits past max_new_tokens, and end at an EOS.
    remaining_B = state.budget - state.num_generated
    is_eos = controls.is_eos(sampling, tokens_BKD)
    first_eos = jnp.where(jnp.any(is_eos, -1), jnp.argmax(is_eos, -1) + 1, n)
    reach_BK = jnp.minimum(jnp.clip(remaining_B - 1, 0, n)[:, None], first_eos)
    lengths_BK = jnp.minimum(reach_BK, proposal.usable_BK)
    # A chain ends before the token drawn from an unusable law (a stopping time: the law at depth
    # i depends on the chain's first i tokens only); only the depths the chain uses count, and
    # non-finite raw logits within reach whatever the drafter's cut (base.unusable_depths).
    bad_BK = unusable_depths(proposal, lengths_BK, reach_BK, n + 2)
    # A sibling drawn without replacement after its law's support ran out has probability 0: it
    # was not drawn, and the chain ends before it (never the case for independent draws).
    drawn_lp_BKD = jnp.take_along_axis(draft_lp_BKDV, tokens_BKD[..., None], axis=-1)[..., 0]
    lengths_BK = jnp.minimum(lengths_BK, _first_false(drawn_lp_BKD > -jnp.inf, n))
    lengths_BK = jnp.minimum(lengths_BK, bad_BK)
    # Node i carries the token and draft law of the first replica through it (every replica
    # through it drew the same token from the same law).
    tokens_BN = tree.to_nodes(state.root, tokens_BKD)
    valid_BN = tree.node_validity(lengths_BK)
    return Drafts(
        state=proposal.state,
        target_cache=proposal.target_cache,
        tokens_BN=tokens_BN,
        logprobs_BNV=tree.to_nodes(None, draft_lp_BKDV),
        lengths_BL=lengths_BK,
        bad_depth_BL=bad_BK,
        scored_BN=scored_slots(spec.method, tree, tokens_BN, valid_BN, dec.merge_tree),
    )


def _score(dec: Decoder, target_params, sampling, state, drafts: Drafts):
    """Stage 2: one target forward over the tree's scored slots (``drafts.scored_BN``: a slot
    attends to the scored slots of its root path); returns the processed target log-probs by
    node, float32[B, N, V] (node i: the target after node i), whether each of those laws is
    usable, bool[B, N] (:func:`asps_jax.controls.logits_ok`), the forward's
    :class:`~asps_jax.models.output.ForwardOut` (the raw logits [B, N, V], the tree's new keys /
    values, the features of every node for a drafter that reads them), and the number of draft
    nodes scored per row, int32[B]."""
    tree = dec.spec.tree.nodes
    scored_BN = drafts.scored_BN == jnp.arange(tree.num_nodes)[None, :]
    out = scoring.score_tree(
        forward_for(dec.target_config, decode_state.feature_layers(dec)),
        target_params,
        state.target_cache,
        drafts.tokens_BN,
        tree,
        scored_BN,
        trees.merged_attention_mask(tree, drafts.scored_BN),
    )
    logits_BNV = sharding.constrain(out.logits, ("batch", None, "vocab"), dec.mesh)
    # Node i's path: its ancestors' tokens below the root.
    path_BND = drafts.tokens_BN[:, np.maximum(tree.paths[:, 1:], 0)]
    lp_BNV, mass_BN = controls.laws(sampling, state.history, logits_BNV, path_BND, tree.depth)
    scored_B = jnp.sum(scored_BN, axis=1) - 1
    return (
        lp_BNV,
        controls.logits_ok(logits_BNV) & mass_BN,
        dataclasses.replace(out, logits=logits_BNV),
        scored_B,
    )


def _verify(dec: Decoder, state, drafts: Drafts, target_lp_BNV) -> tuple[Verdict, jax.Array]:
    """Stage 3: the method's verifier on each row's tree (:func:`asps_jax.verify.step.
    verify_step`). Returns the :class:`Verdict` (``draft_index``: the replica that drew the
    accepted path) and the nodes of the accepted path, int32[B, D + 1]: the root, then one node
    per accepted draft token (entries from ``num_tokens`` on are never read)."""
    spec, tree = dec.spec, dec.spec.tree
    options = dict(spec.options)
    return jax.vmap(
        lambda key, x, lq, lp, valid: verify_step(
            spec.method, tree, key, x, lq, lp, valid, options, _ROWS
        ),
        axis_name=_ROWS,
    )(
        step_keys(state, _PURPOSE_VERIFY),
        drafts.tokens_BN,
        drafts.logprobs_BNV,
        target_lp_BNV,
        tree.node_validity(drafts.lengths_BL),
    )


def _commit(
    dec: Decoder, state, drafts: Drafts, scored: ForwardOut, path_BT, chain_B, num_B, tokens_BT
) -> DecodeState:
    """Stage 4: commit the first ``num_B`` nodes of the accepted path (the root and the accepted
    draft tokens) into the target cache, and the drafter's state after it (``Drafter.commit``:
    replica ``chain_B`` drew the accepted path; ``Drafter.take``: the path's target features and
    the emitted tokens ``tokens_BT``, for a drafter that reads features)."""
    row_loop = kv_cache.row_loop_for(dec.mesh, state)
    t_cache = kv_cache.commit(state.target_cache, scored.kv, path_BT, num_B, row_loop=row_loop)
    draft = dec.drafter.commit(dec, state.draft, drafts.state, chain_B, num_B)
    if scored.features is not None:  # the accepted path's features, and the token after each
        path_BTF = jnp.take_along_axis(scored.features, path_BT[:, :, None], axis=1)
        draft = dec.drafter.take(dec, draft, path_BTF, tokens_BT, num_B)
    return dataclasses.replace(state, target_cache=t_cache, draft=draft)


def _root_optimal_acceptance(dec: Decoder, drafts: Drafts, root_lp_BV) -> jax.Array:
    """The best root acceptance any exact token-level scheme could reach (docs/algorithms.md
    §3.5), float32[B], from the target's root law ``root_lp_BV``; NaN for K >= 2 drafts unless
    ``dec.diagnostics``."""
    root_draft_BV = drafts.logprobs_BNV[:, 0]  # every root child is drawn from this one law
    if dec.spec.num_drafts == 1:  # 1 - TV(p, q): no sort needed
        overlap_BV = jnp.minimum(root_lp_BV, root_draft_BV)
        return jnp.exp(jax.nn.logsumexp(overlap_BV, axis=-1))
    if not dec.diagnostics or not dec.drafter.one_root_law:  # e.g. K different point masses
        return jnp.full(drafts.tokens_BN.shape[:1], jnp.nan, jnp.float32)
    return identical_drafts_acceptance(root_lp_BV, root_draft_BV, dec.spec.tree.widths[0])


def _emitted_logprobs(path_lp_BTV, verdict: Verdict) -> jax.Array:
    """float32[B, D + 1]: ``log p(tokens[j] | prefix)`` for each slot of the emitted block.

    Slot j's law is the target law after the accepted path's node j (``_path_laws``). Slots past
    ``num_tokens`` (-1) read token 0 and are never written out.
    """
    tokens_BT = jnp.maximum(verdict.tokens, 0)
    return jnp.take_along_axis(path_lp_BTV, tokens_BT[:, :, None], axis=2)[:, :, 0]


def _spec_step(dec: Decoder, target_params, draft_params, sampling, state):
    active_B = ~state.done
    with jax.named_scope("draft"):
        drafts = _draft(dec, draft_params, sampling, state)
        if drafts.target_cache is not None:  # with the drafter's scratch slots written
            state = dataclasses.replace(state, target_cache=drafts.target_cache)
    with jax.named_scope("score"):
        target_lp, target_ok, scored, scored_B = _score(dec, target_params, sampling, state, drafts)
        # A chain is verified only up to its first unusable target law: the tokens before it are
        # then decided by usable laws alone (ASpS weighs a whole chain, so an unusable law deeper
        # down would otherwise change them); a bonus drawn from that law is cut below. A slot's
        # law is its scored slot's (the root's for an unusable slot, past the chain's length).
        tree = dec.spec.tree
        nodes_BKD = jnp.maximum(drafts.scored_BN[:, tree.layout.chain_paths], 0)
        chain_ok_BKD = jax.vmap(lambda ok_N, nodes: ok_N[nodes])(target_ok, nodes_BKD)
        first_bad_BK = _first_false(chain_ok_BKD, dec.spec.num_draft_tokens + 2)
        drafts = dataclasses.replace(
            drafts, lengths_BL=jnp.minimum(drafts.lengths_BL, first_bad_BK)
        )
    with jax.named_scope("verify"):
        verdict, path_BT = _verify(dec, state, drafts, target_lp)
        # Slot j of the block: the target law after the path's node j (the law of emitted token j).
        path_lp_BTV = jnp.take_along_axis(target_lp, path_BT[:, :, None], axis=1)
        path_ok_BT = jnp.take_along_axis(target_ok, path_BT, axis=1)
        num_B = jnp.where(active_B, verdict.num_tokens, 0)
        # Block slot j comes from the target law after the path's node j, and its draft token
        # (if any) from the accepted chain's draft law at depth j: the first unusable one of
        # either ends the row there, keeping the slots before it.
        bad_target_B = _first_false(path_ok_BT, dec.spec.num_draft_tokens + 2)
        bad_draft_B = jnp.take_along_axis(
            drafts.bad_depth_BL, verdict.draft_index[:, None], axis=1
        )[:, 0]
        bad_B = jnp.minimum(bad_target_B, bad_draft_B)
        failed_B = active_B & (bad_B < num_B)
        num_B = jnp.where(failed_B, bad_B, num_B)
        # An EOS inside the emitted block ends the row there (before any failure), and so do a
        # slot drawn at a constraint's dead node (dropped) and the first token that completes a
        # stop string (whichever is first); the tokens after it are neither committed nor emitted.
        num_B, ended_B, stop = controls.cut(
            sampling, state.history, state.stop, verdict.tokens, num_B, state.num_generated
        )
        failed_B = failed_B & ~ended_B
    with jax.named_scope("commit"):
        new_state = _commit(
            dec, state, drafts, scored, path_BT, verdict.draft_index, num_B, verdict.tokens
        )
    with jax.named_scope("metrics"):
        root_lp_BV = target_lp[:, 0]
        stats = statistics.update(
            state.stats,
            active_B=active_B,
            emitted_B=num_B,
            failed_at_B=jnp.where(failed_B, state.num_generated + num_B, -1),
            verdict=verdict,
            draft_lengths_BK=drafts.lengths_BL,
            root_drafts_BK=drafts.tokens_BN[:, tree.layout.chain_nodes[:, 0]],
            root_optimal_B=_root_optimal_acceptance(dec, drafts, root_lp_BV),
            scored_nodes_B=scored_B,
        )
    new_state = dataclasses.replace(new_state, stats=stats, stop=stop)
    new_state = _record_top_logprobs(dec, new_state, path_lp_BTV, num_B)
    if dec.raw_logprobs:
        path_logits_BTV = jnp.take_along_axis(scored.logits, path_BT[:, :, None], axis=1)
        new_state = _record_raw_logprobs(dec, new_state, path_logits_BTV, verdict.tokens, num_B)
    with jax.named_scope("emit"):
        block_lp_BT = _emitted_logprobs(path_lp_BTV, verdict)
        done_B = ended_B | failed_B
        return _emit(dec, new_state, verdict.tokens, block_lp_BT, num_B, done_B)


def _record_top_logprobs(dec: Decoder, state: DecodeState, laws_BTV, num_B) -> DecodeState:
    """Write the ``dec.top_logprobs`` most likely tokens of the block's laws (slot j: the law of
    emitted token j) at each row's output position; slots past a row's length are never read."""
    if dec.top_logprobs == 0:
        return state
    top_lp_BTK, top_ids_BTK = jax.lax.top_k(laws_BTV, dec.top_logprobs)
    num_B = jnp.where(state.done, 0, num_B)
    ids, lps = state.top_logprobs
    write = jax.vmap(_write_block)
    ids = write(ids, top_ids_BTK.astype(jnp.int32), state.num_generated, num_B)
    lps = write(lps, top_lp_BTK, state.num_generated, num_B)
    return dataclasses.replace(state, top_logprobs=(ids, lps))


def _record_raw_logprobs(dec: Decoder, state: DecodeState, logits_BTV, tokens_BT, num_B):
    """With ``dec.raw_logprobs``: write ``log_softmax(logits)[token]`` of the block's slots (slot
    j: the raw target logits of emitted token j's law) at each row's output position."""
    if not dec.raw_logprobs:
        return state
    logits_BTV = logits_BTV.astype(jnp.float32)
    picked_BT = jnp.take_along_axis(logits_BTV, jnp.maximum(tokens_BT, 0)[:, :, None], axis=2)
    raw_BT = picked_BT[:, :, 0] - jax.nn.logsumexp(logits_BTV, axis=-1)
    num_B = jnp.where(state.done, 0, num_B)
    raw = jax.vmap(_write_block)(state.raw_logprobs, raw_BT, state.num_generated, num_B)
    return dataclasses.replace(state, raw_logprobs=raw)


def _step(dec: Decoder, target_params, draft_params, sampling, state):
    if dec.spec.uses_draft:  # every stage's key at once (an AR step folds in its one purpose)
        state = dataclasses.replace(state, step_keys=all_step_keys(state))
        new_state = _spec_step(dec, target_params, draft_params, sampling, state)
    else:
        new_state = _ar_step(dec, target_params, sampling, state)
    # The controls' history takes the tokens the step emitted (whatever ended the block).
    width = dec.spec.num_draft_tokens + 1 if dec.spec.uses_draft else 1
    block_BT = jax.vmap(lambda row, start: jax.lax.dynamic_slice(row, (start,), (width,)))(
        new_state.tokens, state.num_generated
    )
    num_B = new_state.num_generated - state.num_generated
    history = controls.commit(sampling, state.history, block_BT, num_B)
    return dataclasses.replace(new_state, history=history, step_keys=None)
