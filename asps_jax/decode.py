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
   verdict, the accepted path as nodes and the replica that drew it; then EOS and stop-string
   truncation of the emitted block (``stopping.py``);
4. ``commit``: the accepted path (root, then the accepted nodes) into the target cache, and the
   drafter's state after it (``Drafter.commit``: a draft model's replicas synced to the replica
   that drew it);
5. ``metrics``: the per-row counters (``statistics.update``);
6. ``emit``: the emitted tokens, and the target's log-probability of each (gathered from the laws
   the score stage already processed, along the accepted path), into each row's output.

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

from asps_jax import kv_cache, scoring, sharding, statistics, trees
from asps_jax.controls import constraints, penalties, stopping
from asps_jax.controls.processors import SamplingParams, logits_ok, sample_token
from asps_jax.drafters.base import Drafter, Proposal, step_keys, unusable_depths
from asps_jax.models import forward_for
from asps_jax.statistics import DecodeStats
from asps_jax.verify import Verdict
from asps_jax.verify.acceptance import identical_drafts_acceptance
from asps_jax.verify.registry import REGISTRY, Method
from asps_jax.verify.step import scored_slots, verify_step

__all__ = ["DecodeState", "DecodeStats", "Decoder", "SamplingParams", "SpecConfig"]

_PURPOSE_VERIFY = 1  # (drafting is purpose 0: drafters.base.PURPOSE_DRAFT)
_PURPOSE_AR = 2
_ROWS = "rows"  # the vmap axis over a batch's rows in verification


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static (hashable) description of the decoding method; changing it recompiles.

    ``method``: the registry :class:`~asps_jax.verify.registry.Method` (a name is resolved
    through the registry), or None for autoregressive decoding (no draft, plain sampling);
    ``options``: its options, validated once by the caller (sorted ``(name, value)`` pairs).
    """

    method: Method | None
    num_draft_tokens: int  # n (= D, the tree depth)
    num_drafts: int  # K
    max_new_tokens: int  # the output width: every row's budget (DecodeState.budget) is <= this
    options: tuple = ()
    widths: tuple = ()  # a branching draft tree (tree methods): children per node at each depth

    def __post_init__(self):
        if isinstance(self.method, str):
            object.__setattr__(self, "method", REGISTRY.get(self.method))

    @property
    def uses_draft(self) -> bool:
        return self.method is not None

    @property
    def name(self) -> str:
        """The method's name (``"ar"`` without a draft)."""
        return "ar" if self.method is None else self.method.name

    @functools.cached_property
    def tree(self) -> trees.DraftTree:
        """The step's one draft tree: K chains, or the branching tree ``widths``."""
        return self.method.draft_tree(self.num_drafts, self.num_draft_tokens, self.widths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the loop carries from one step to the next (a pytree of device arrays).

    Attributes:
      target_cache: the target's KV cache, batch B.
      draft: the drafter's own state (``Drafter.init``): a draft model's KV cache, batch B * K
        (row b, chain k at ``b * K + k``); None for ``"ar"`` and for a drafter without one.
      root: int32[B], the last emitted token, not yet in the caches.
      tokens: int32[B, max_new_tokens + D + 1], each row's emitted tokens, -1 after its end (the
        D + 1 extra columns absorb the block of the last step).
      logprobs: float32[B, max_new_tokens + D + 1], the target's log-probability of each emitted
        token under the processed law (temperature / top-k / top-p; 0.0 when greedy), 0.0 after
        the row's end.
      num_generated: int32[B], tokens emitted so far.
      done: bool[B], the row has stopped (EOS, ``max_new_tokens``, a law with NaN / ``+inf``
        logits or no finite one, see ``stats.failed_at``, or an empty padding row).
      row_keys: typed PRNG keys [B], one base key per row.
      stats: the per-row :class:`~asps_jax.statistics.DecodeStats`.
      history: each row's committed text and token counts, for the path-dependent controls
        (:class:`~asps_jax.controls.penalties.History`).
      top_logprobs: ``(ids int32[B, max_new_tokens + D + 1, k], logprobs float32[...,k])``, the
        k most likely tokens of the processed target law of each emitted token
        (``Decoder.top_logprobs`` = k; k = 0 records nothing).
      raw_logprobs: float32[B, max_new_tokens + D + 1] with ``Decoder.raw_logprobs`` (else
        float32[B, 0]): each emitted token's log-probability under the *unprocessed* target law,
        ``log_softmax(logits)`` at temperature 1 with no control, filter or constraint; 0.0
        after the row's end.
      stop: the stop strings and each row's last bytes of text
        (:class:`~asps_jax.controls.stopping.StopStrings`); None without stop strings.
      budget: int32[B], each row's ``max_new_tokens`` (at most ``SpecConfig.max_new_tokens``,
        the static output width): a traced value, so budgets within one width share a program.
    """

    target_cache: kv_cache.KVCache
    draft: Any
    root: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    num_generated: jax.Array
    done: jax.Array
    row_keys: jax.Array
    stats: DecodeStats
    history: penalties.History
    top_logprobs: tuple[jax.Array, jax.Array]
    raw_logprobs: jax.Array
    stop: stopping.StopStrings | None = None
    budget: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Drafts:
    """What the draft stage of one step hands to the others: the drawn tree, node-indexed
    (N nodes of ``SpecConfig.tree``), and per root path (L = K replicas) its usable length.

    Attributes:
      state: the drafter's state after drawing (``Proposal.state``; ``Drafter.commit`` takes it).
      target_cache: the target cache with the drafter's scratch slots written, or None
        (``Proposal.target_cache``).
      tokens_BN: int32[B, N], each node's token (node 0: the root, the last emitted token).
      logprobs_BNV: float32[B, N, V], the law each node's token was drawn from (row 0: the law
        the root's children were drawn from, chain 0's first).
      lengths_BL: int32[B, L], the usable length of each replica's root path (cut at
        ``max_new_tokens``, ended at an EOS, ended before a token drawn from an unusable law or
        outside its law's support); a node is usable iff it lies within the length of the first
        replica through it (``DraftTree.node_validity``).
      bad_depth_BL: int32[B, L], the first depth whose draft law was unusable (NaN or ``+inf``
        logits, or none finite) among the depths the replica would otherwise have used; D + 2
        when none was.
      scored_BN: int32[B, N], the slot whose target law stands for each slot, -1 for a slot
        that holds no usable token (:func:`asps_jax.verify.step.scored_slots`: the merged tree's
        node for a verifier that merges equal siblings, else the slot itself).
    """

    state: Any
    target_cache: Any
    tokens_BN: jax.Array
    logprobs_BNV: jax.Array
    lengths_BL: jax.Array
    bad_depth_BL: jax.Array
    scored_BN: jax.Array


@dataclasses.dataclass(frozen=True)
class Decoder:
    """The static description of a decoding loop: frozen and hashable, it is the static ``self``
    of the jitted :meth:`prefill`, :meth:`step` and :meth:`generate` (two equal decoders share one
    compiled program).

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
        ``stop``: the call's :class:`~asps_jax.controls.stopping.StopStrings` (None: none);
        ``budget_B``: int32[B], each row's ``max_new_tokens`` (None: ``spec.max_new_tokens`` for
        every row)."""
        return _prefill(
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
        state = _prefill(
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


def _prefill(
    dec: Decoder,
    target_params,
    draft_params,
    prompts_BP,
    prompt_lengths_B,
    row_keys_B,
    stop=None,
    budget_B=None,
    *,
    run_forward: bool = True,
):
    """``run_forward=False``: the caches stay empty (continuous batching starts from empty slots
    and fills them with :func:`_refill`)."""
    batch = prompts_BP.shape[0]
    prompt_lengths_B = prompt_lengths_B.astype(jnp.int32)
    committed_B = jnp.maximum(prompt_lengths_B - 1, 0)
    t_cache = kv_cache.init_cache(
        dec.target_config,
        batch,
        dec.cache_len,
        jax.tree.leaves(target_params)[0].dtype,
        per_layer=kv_cache.per_layer_params(target_params),
    )
    draft = None if dec.drafter is None else dec.drafter.init(dec, draft_params, batch)
    if run_forward:
        forward = forward_for(dec.target_config, _feature_layers(dec))
        # With n samples per prompt (rows p * n + i hold prompt p): one forward per prompt.
        t_cache = scoring.prefill_cache_grouped(
            forward, target_params, t_cache, prompts_BP, committed_B, dec.samples
        )
        t_cache, features = t_cache if isinstance(t_cache, tuple) else (t_cache, None)
        if dec.drafter is not None:
            draft = dec.drafter.prefill(
                dec, draft_params, draft, prompts_BP, committed_B, **_features(features)
            )
    fresh = _fresh_rows(dec, prompts_BP, prompt_lengths_B, committed_B, row_keys_B, budget_B)
    state = DecodeState(target_cache=t_cache, draft=draft, stop=stop, **fresh)
    return sharding.constrain_state(state, dec.mesh)  # the loop's carry: one layout per chip


def _feature_layers(dec: Decoder) -> tuple[int, ...]:
    """The target layers whose streams the drafter reads (``Drafter.feature_layers``)."""
    return () if dec.drafter is None else dec.drafter.feature_layers


def _features(features) -> dict:
    """The ``features=`` keyword of a drafter's prefill / refill (none for one that reads none)."""
    return {} if features is None else {"features": features}


def _fresh_rows(dec: Decoder, prompts_BP, lengths_B, committed_B, row_keys_B, budget_B) -> dict:
    """Every per-row field of a fresh state but the caches and the stop strings: the root (the
    last prompt token), empty outputs and counters, the keys, the controls' history, the budget;
    rows of length 0 start done (they pad the batch to its bucket)."""
    spec = dec.spec
    batch = prompts_BP.shape[0]
    n = spec.num_draft_tokens if spec.uses_draft else 0
    out_width = spec.max_new_tokens + n + 1
    top_shape = (batch, out_width, dec.top_logprobs)
    root_B = jnp.take_along_axis(prompts_BP, committed_B[:, None], axis=1)[:, 0]
    return dict(
        root=root_B.astype(jnp.int32),
        tokens=jnp.full((batch, out_width), -1, jnp.int32),
        logprobs=jnp.zeros((batch, out_width), jnp.float32),
        num_generated=jnp.zeros((batch,), jnp.int32),
        done=lengths_B <= 0,
        row_keys=row_keys_B,
        stats=DecodeStats.zeros(batch, n),
        history=penalties.History.init(
            prompts_BP, lengths_B, dec.target_config.vocab_size, out_width
        ),
        top_logprobs=(jnp.full(top_shape, -1, jnp.int32), jnp.zeros(top_shape, jnp.float32)),
        raw_logprobs=jnp.zeros((batch, out_width if dec.raw_logprobs else 0), jnp.float32),
        budget=_budget(spec, batch, budget_B),
    )


def _refill(
    dec: Decoder,
    target_params,
    draft_params,
    state: DecodeState,
    take_B,
    prompts_BP,
    prompt_lengths_B,
    row_keys_B,
    budget_B,
) -> DecodeState:
    """Start new prompts in the rows ``take_B`` (bool[B]) of a running state (continuous
    batching, :mod:`asps_jax.slots`): their caches take the prompt's committed tokens (one
    single-row prefill forward per row filled, over the prompt width only,
    :func:`asps_jax.scoring.refill_rows`; the drafter's state by ``Drafter.refill``); every
    per-row field of theirs (root, outputs, counters, key, statistics, the controls' history,
    the stop-string tail, the budget) is that of a fresh :func:`_prefill`. The other rows are
    unchanged. Stale cache slots past a row's new length are masked, as after any rejection."""
    batch = prompts_BP.shape[0]
    lengths_B = jnp.where(take_B, prompt_lengths_B.astype(jnp.int32), 0)
    committed_B = jnp.maximum(lengths_B - 1, 0)
    forward = forward_for(dec.target_config, _feature_layers(dec))
    t_cache = scoring.refill_rows(
        forward, dec.target_config, target_params, state.target_cache, take_B, prompts_BP,
        committed_B,
    )  # fmt: skip
    t_cache, features = t_cache if isinstance(t_cache, tuple) else (t_cache, None)
    draft = state.draft
    if dec.drafter is not None:
        draft = dec.drafter.refill(
            dec, draft_params, draft, take_B, prompts_BP, committed_B, **_features(features)
        )
    fresh = _fresh_rows(dec, prompts_BP, lengths_B, committed_B, row_keys_B, budget_B)

    def pick(new, old):
        if jax.dtypes.issubdtype(new.dtype, jax.dtypes.prng_key):
            data = pick(jax.random.key_data(new), jax.random.key_data(old))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(old))
        keep = take_B.reshape((batch,) + (1,) * (new.ndim - 1))
        return jnp.where(keep, new, old)

    merged = {name: jax.tree.map(pick, new, getattr(state, name)) for name, new in fresh.items()}
    merged["done"] = jnp.where(take_B, fresh["done"], state.done)
    stop = state.stop
    if stop is not None:  # only the per-row tail, fresh for the rows taken
        fresh_tail = jnp.full(stop.tail.shape, -1, stop.tail.dtype)
        stop = dataclasses.replace(stop, tail=pick(fresh_tail, stop.tail))
    return dataclasses.replace(state, target_cache=t_cache, draft=draft, stop=stop, **merged)


def _budget(spec: SpecConfig, batch: int, budget_B) -> jax.Array:
    """int32[B]: each row's ``max_new_tokens``, clipped to the static output width."""
    if budget_B is None:
        return jnp.full((batch,), spec.max_new_tokens, jnp.int32)
    budget_B = jnp.broadcast_to(jnp.asarray(budget_B, jnp.int32), (batch,))
    return jnp.clip(budget_B, 1, spec.max_new_tokens)


# --------------------------------------------------------------------------------------------
# One step


def _is_eos(tokens, eos_ids) -> jax.Array:
    """``tokens[...]`` is one of ``eos_ids`` (int32[num_eos], -1 entries unused)."""
    eos = eos_ids.reshape((1,) * tokens.ndim + eos_ids.shape)
    return jnp.any((tokens[..., None] == eos) & (eos >= 0), axis=-1)


def _first_eos_length(block_BT, num_B, eos_ids):
    """Truncate each row's ``num`` at its first EOS (kept); returns (num, hit_eos)."""
    width = block_BT.shape[1]
    pos = jnp.arange(width)[None, :]
    is_eos = _is_eos(block_BT, eos_ids) & (pos < num_B[:, None])
    first = jnp.min(jnp.where(is_eos, pos, width), axis=1)
    hit = first < width
    return jnp.where(hit, first + 1, num_B), hit


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


def _first_stop(sampling, state) -> jax.Array | None:
    """int32[B]: the first token of this step's block that may complete a stop string (the
    row's ``min_tokens``-th generated token and after); None without ``min_tokens``."""
    if not sampling.limited:
        return None
    return jnp.maximum(sampling.min_tokens - state.num_generated - 1, 0).astype(jnp.int32)


def _first_false(ok_X, absent: int) -> jax.Array:
    """The first index along the last axis where ``ok`` is False, ``absent`` where none is."""
    return jnp.where(jnp.all(ok_X, axis=-1), absent, jnp.argmax(~ok_X, axis=-1))


def _ar_step(dec: Decoder, target_params, sampling, state):
    forward = forward_for(dec.target_config)
    batch = state.root.shape[0]
    valid_BT = jnp.ones((batch, 1), bool)
    with jax.named_scope("score"):
        logits_BTV, new_kv = scoring.score_chain(
            forward, target_params, state.target_cache, state.root[:, None], valid_BT
        )
        logits_BTV = sharding.constrain(logits_BTV, ("batch", None, "vocab"), dec.mesh)
        logprobs_BTV, has_mass_BT = penalties.process(
            sampling, state.history, logits_BTV, jnp.zeros((batch, 1, 0), jnp.int32), [0]
        )
        logprobs_BV = logprobs_BTV[:, 0]
    with jax.named_scope("verify"):
        next_B = jax.vmap(sample_token)(step_keys(state, _PURPOSE_AR), logprobs_BV)
        active_B = ~state.done
        # A row whose law is unusable emits nothing and stops there.
        failed_B = active_B & ~(logits_ok(logits_BTV[:, 0]) & has_mass_BT[:, 0])
        num_B = (active_B & ~failed_B).astype(jnp.int32)
    with jax.named_scope("commit"):
        nodes_B1 = jnp.zeros((batch, 1), jnp.int32)
        t_cache, row_loop = state.target_cache, kv_cache.row_loop_for(dec.mesh, state)
        t_cache = kv_cache.commit(t_cache, new_kv, nodes_B1, num_B, row_loop=row_loop)
        num_B, hit = _first_eos_length(next_B[:, None], num_B, sampling.eos_ids)
        num_B, ended_B = constraints.dead_slots(sampling, state.history, next_B[:, None], num_B)
        # One token: a stop string it completes is kept with it (num stays).
        num_B, hit_stop, stop = stopping.advance(
            state.stop, next_B[:, None], num_B, _first_stop(sampling, state)
        )
        hit = hit | ended_B | hit_stop
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
    is_eos = _is_eos(tokens_BKD, sampling.eos_ids)
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
    usable, bool[B, N] (:func:`asps_jax.controls.processors.logits_ok`), the tree's new keys /
    values, the number of draft nodes scored per row, int32[B], and the raw logits, [B, N, V]."""
    tree = dec.spec.tree.nodes
    scored_BN = drafts.scored_BN == jnp.arange(tree.num_nodes)[None, :]
    out = scoring.score_tree(
        forward_for(dec.target_config, _feature_layers(dec)),
        target_params,
        state.target_cache,
        drafts.tokens_BN,
        tree,
        scored_BN,
        trees.merged_attention_mask(tree, drafts.scored_BN),
    )
    logits_BNV, new_kv = out[:2]
    if len(out) == 3:  # the drafter's features of every node travel with the new keys / values
        new_kv = (new_kv, out[2])
    logits_BNV = sharding.constrain(logits_BNV, ("batch", None, "vocab"), dec.mesh)
    # Node i's path: its ancestors' tokens below the root.
    path_BND = drafts.tokens_BN[:, np.maximum(tree.paths[:, 1:], 0)]
    lp_BNV, mass_BN = penalties.process(sampling, state.history, logits_BNV, path_BND, tree.depth)
    scored_B = jnp.sum(scored_BN, axis=1) - 1
    return lp_BNV, logits_ok(logits_BNV) & mass_BN, new_kv, scored_B, logits_BNV


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
    dec: Decoder, state, drafts: Drafts, new_kv, path_BT, chain_B, num_B, tokens_BT
) -> DecodeState:
    """Stage 4: commit the first ``num_B`` nodes of the accepted path (the root and the accepted
    draft tokens) into the target cache, and the drafter's state after it (``Drafter.commit``:
    replica ``chain_B`` drew the accepted path; ``Drafter.take``: the path's target features and
    the emitted tokens ``tokens_BT``, for a drafter that reads features)."""
    row_loop = kv_cache.row_loop_for(dec.mesh, state)
    new_kv, features_BNF = new_kv if isinstance(new_kv, tuple) else (new_kv, None)
    t_cache = kv_cache.commit(state.target_cache, new_kv, path_BT, num_B, row_loop=row_loop)
    draft = dec.drafter.commit(dec, state.draft, drafts.state, chain_B, num_B)
    if features_BNF is not None:  # the accepted path's features, and the token after each
        path_BTF = jnp.take_along_axis(features_BNF, path_BT[:, :, None], axis=1)
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
        target_lp, target_ok, new_kv, scored_B, logits_BNV = _score(
            dec, target_params, sampling, state, drafts
        )
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
        # An EOS inside the emitted block ends the row there (before any failure), and so does
        # the first token that completes a stop string in the row's text (whichever is first);
        # the tokens after it are neither committed nor emitted.
        num_B, hit_eos = _first_eos_length(verdict.tokens, num_B, sampling.eos_ids)
        # A slot drawn at a node whose constraint state allows nothing is dropped: the row's
        # constrained text ended before it.
        num_B, ended_B = constraints.dead_slots(sampling, state.history, verdict.tokens, num_B)
        num_B, hit_stop, stop = stopping.advance(
            state.stop, verdict.tokens, num_B, _first_stop(sampling, state)
        )
        hit_eos = hit_eos | hit_stop
        failed_B = failed_B & ~hit_eos & ~ended_B
    with jax.named_scope("commit"):
        new_state = _commit(
            dec, state, drafts, new_kv, path_BT, verdict.draft_index, num_B, verdict.tokens
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
        path_logits_BTV = jnp.take_along_axis(logits_BNV, path_BT[:, :, None], axis=1)
        new_state = _record_raw_logprobs(dec, new_state, path_logits_BTV, verdict.tokens, num_B)
    with jax.named_scope("emit"):
        block_lp_BT = _emitted_logprobs(path_lp_BTV, verdict)
        done_B = hit_eos | failed_B | ended_B
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
    if dec.spec.uses_draft:
        new_state = _spec_step(dec, target_params, draft_params, sampling, state)
    else:
        new_state = _ar_step(dec, target_params, sampling, state)
    # The controls' history takes the tokens the step emitted (whatever ended the block).
    width = dec.spec.num_draft_tokens + 1 if dec.spec.uses_draft else 1
    block_BT = jax.vmap(lambda row, start: jax.lax.dynamic_slice(row, (start,), (width,)))(
        new_state.tokens, state.num_generated
    )
    num_B = new_state.num_generated - state.num_generated
    history = state.history.append(block_BT, num_B)
    history = constraints.commit(sampling, history, block_BT, num_B)
    return dataclasses.replace(new_state, history=history)
