"""The jitted speculative decoding loop: a static :class:`Decoder` with ``prefill``, ``step`` and
``generate``.

A :class:`Decoder` is the frozen, hashable description of the loop (model configs, method, shapes,
cache length); it is the static ``self`` of every jitted entry point, and everything that varies per
call (parameters, prompts, keys, sampling parameters) is an array pytree. One compiled step runs six
stages, each in its own ``jax.named_scope`` so that a profile reads as the step does:

Every stage reads one static tree, ``SpecConfig.tree`` (a :class:`~asps_jax.trees.DraftTree`):
K chains are the tree of widths ``(K, 1, ..., 1)``, a branching tree its own widths; one draft cache
replica per root path. The stages see the tree by node:

1. ``draft``: the replicas draw the tree (``rollout.py``), laid out by node: each node's token and
   the draft law it was drawn from, and each replica's usable length;
2. ``score``: one target forward over the tree (``scoring.py``), each slot attending to the scored
   slots of its root path; a verifier that merges equal siblings has each merged node scored
   once (``verify.step.scored_slots``); the target laws are processed per node from its path;
3. ``verify``: the method's verifier through its one adapter (``verify.step.verify_step``: chain
   and multi-draft verifiers read the root paths, tree verifiers the nodes), which returns the
   verdict, the accepted path as nodes and the replica that drew it; then EOS and stop-string
   truncation of the emitted block (``stopping.py``);
4. ``commit``: the accepted path (root, then the accepted nodes) into the target cache, and the
   draft replicas synced to the replica that drew it;
5. ``metrics``: the per-row counters (``statistics.update``);
6. ``emit``: the emitted tokens, and the target's log-probability of each (gathered from the laws
   the score stage already processed, along the accepted path), into each row's output.

``generate`` runs prefill and the whole loop in one ``lax.while_loop``; ``prefill`` + ``step`` are
the step-wise entry points for streaming.

Cache layout: both caches hold every committed token *except* the last emitted one, the *root*,
which is fed at the start of the next step. A step that emits l tokens therefore commits l slots:
the root and the l - 1 accepted draft tokens. Every row advances by its own l.
A self-draft (``draft="self:L"``, ``Decoder.share_draft_cache``) keeps no cache of its own: it
reads the target cache's first L layers (``selfdraft.py``).

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

from asps_jax import (
    constraints,
    kv_cache,
    lookup,
    penalties,
    rollout,
    scoring,
    sharding,
    statistics,
    stopping,
    trees,
)
from asps_jax.models import forward_for
from asps_jax.processors import SamplingParams, logits_ok, sample_token
from asps_jax.statistics import DecodeStats
from asps_jax.verify import Verdict
from asps_jax.verify.acceptance import identical_drafts_acceptance
from asps_jax.verify.registry import REGISTRY, Method
from asps_jax.verify.step import scored_slots, verify_step

__all__ = ["DecodeState", "DecodeStats", "Decoder", "SamplingParams", "SpecConfig"]

_PURPOSE_DRAFT = 0
_PURPOSE_VERIFY = 1
_PURPOSE_AR = 2
_ROWS = "rows"  # the vmap axis over a batch's rows in verification


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static (hashable) description of the decoding method; changing it recompiles."""

    method: str  # a registry method (verify/registry.py), or "ar": no draft, plain sampling
    num_draft_tokens: int  # n (= D, the tree depth)
    num_drafts: int  # K
    max_new_tokens: int  # the output width: every row's budget (DecodeState.budget) is <= this
    options: tuple = ()  # sorted (name, value) pairs passed to verify_drafts
    widths: tuple = ()  # a branching draft tree (tree methods): children per node at each depth
    # Who drafts (sampler.parse_draft): "model" (a draft model), "lookup" (prompt lookup,
    # lookup.py: no draft model, point-mass laws; lookup_ngram = m, lookup_max caps the chains).
    drafter: str = "model"
    lookup_ngram: int = 3
    lookup_max: int = 0  # 0: num_draft_tokens
    # Confidence-stopped chains (rollout.rollout_stopped): a chain stops growing at the first
    # draft law whose top probability is below SamplingParams.draft_stop (per row, an array).
    draft_stop: bool = False

    @property
    def uses_draft(self) -> bool:
        return self.resolved is not None

    @functools.cached_property
    def resolved(self) -> Method | None:
        """The method's registry entry; None for autoregressive decoding (no draft)."""
        return REGISTRY.get(self.method)

    @property
    def drafts_from_model(self) -> bool:
        """A draft model rolls the chains out (it has parameters and a KV cache)."""
        return self.uses_draft and self.drafter == "model"

    @functools.cached_property
    def tree(self) -> trees.DraftTree:
        """The step's one draft tree: K chains, or the branching tree ``widths``."""
        return self.resolved.draft_tree(self.num_drafts, self.num_draft_tokens, self.widths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the loop carries from one step to the next (a pytree of device arrays).

    Attributes:
      target_cache: the target's KV cache, batch B.
      draft_cache: the draft's KV cache, batch B * K (row b, chain k at ``b * K + k``); None for
        ``"ar"``.
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
        (:class:`~asps_jax.penalties.History`).
      top_logprobs: ``(ids int32[B, max_new_tokens + D + 1, k], logprobs float32[...,k])``, the
        k most likely tokens of the processed target law of each emitted token
        (``Decoder.top_logprobs`` = k; k = 0 records nothing).
      stop: the stop strings and each row's last bytes of text
        (:class:`~asps_jax.stopping.StopStrings`); None without stop strings.
      budget: int32[B], each row's ``max_new_tokens`` (at most ``SpecConfig.max_new_tokens``,
        the static output width): a traced value, so budgets within one width share a program.
    """

    target_cache: kv_cache.KVCache
    draft_cache: kv_cache.KVCache | None
    root: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    num_generated: jax.Array
    done: jax.Array
    row_keys: jax.Array
    stats: DecodeStats
    history: penalties.History
    top_logprobs: tuple[jax.Array, jax.Array]
    stop: stopping.StopStrings | None = None
    budget: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Drafts:
    """What the draft stage of one step hands to the others: the drawn tree, node-indexed
    (N nodes of ``SpecConfig.tree``), and per draft replica (L = K root paths) its usable length.

    Attributes:
      cache: the draft cache (batch B * L) with the rollout's D + 1 slots written; with
        ``Decoder.share_draft_cache``, the target cache with the rollout's scratch slots
        written; None for a drafter without a cache (lookup).
      start_B: int32[B], the draft cache length of each row before the rollout.
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

    cache: kv_cache.KVCache
    start_B: jax.Array
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
      draft_config: the draft model's config; None without a draft.
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
      share_draft_cache: the draft is the target's first layers (``draft="self:L"``) and keeps
        no cache: it reads the target cache's first layers and writes its rollout into scratch
        slots past each row's committed length (:mod:`asps_jax.selfdraft`);
        ``DecodeState.draft_cache`` is then None.
    """

    target_config: Any
    draft_config: Any
    spec: SpecConfig
    cache_len: int
    mesh: Mesh | None = None
    diagnostics: bool = False
    merge_tree: bool = True
    top_logprobs: int = 0
    share_draft_cache: bool = False

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
        ``stop``: the call's :class:`~asps_jax.stopping.StopStrings` (None: none); ``budget_B``:
        int32[B], each row's ``max_new_tokens`` (None: ``spec.max_new_tokens`` for every row)."""
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


def _prefill_cache(forward, params, cache, prompts_BP, num_B):
    """Commit the first ``num_B`` prompt tokens of each row into ``cache``."""
    rows, width = prompts_BP.shape
    valid_BP = jnp.arange(width)[None, :] < num_B[:, None]
    _, new_kv = scoring.score_chain(forward, params, cache, prompts_BP, valid_BP)
    nodes_BP = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
    return kv_cache.commit(cache, new_kv, nodes_BP, num_B)


def _per_layer_cache(params) -> bool:
    """Parameters whose layers are separate arrays (a run layout, e.g. Llama's
    ``prepare_params``) run the layers one by one; their cache is then one buffer per layer, read
    in place (a layer of a stacked cache is a copy per forward: 0.5b shape, 1024 slots, 189 ->
    135 ms CPU per one-token forward)."""
    return isinstance(params, dict) and isinstance(params.get("layers"), (tuple, list))


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
    spec = dec.spec
    batch = prompts_BP.shape[0]
    n = spec.num_draft_tokens if spec.uses_draft else 0
    prompt_lengths_B = prompt_lengths_B.astype(jnp.int32)
    committed_B = jnp.maximum(prompt_lengths_B - 1, 0)
    t_dtype = jax.tree.leaves(target_params)[0].dtype
    t_cache = kv_cache.init_cache(
        dec.target_config, batch, dec.cache_len, t_dtype, per_layer=_per_layer_cache(target_params)
    )
    if run_forward:
        t_cache = _prefill_cache(
            forward_for(dec.target_config), target_params, t_cache, prompts_BP, committed_B
        )
    d_cache = None
    if spec.drafts_from_model and not dec.share_draft_cache:
        k = spec.num_drafts
        d_dtype = jax.tree.leaves(draft_params)[0].dtype
        d_cache = kv_cache.init_cache(
            dec.draft_config,
            batch * k,
            dec.cache_len,
            d_dtype,
            per_layer=_per_layer_cache(draft_params),
        )
        if run_forward:
            d_cache = _prefill_cache(
                forward_for(dec.draft_config),
                draft_params,
                d_cache,
                jnp.repeat(prompts_BP, k, axis=0),
                jnp.repeat(committed_B, k),
            )
    root_B = jnp.take_along_axis(prompts_BP, committed_B[:, None], axis=1)[:, 0]
    out_width = spec.max_new_tokens + n + 1
    top_shape = (batch, out_width, dec.top_logprobs)
    return DecodeState(
        target_cache=t_cache,
        draft_cache=d_cache,
        root=root_B.astype(jnp.int32),
        tokens=jnp.full((batch, spec.max_new_tokens + n + 1), -1, jnp.int32),
        logprobs=jnp.zeros((batch, spec.max_new_tokens + n + 1), jnp.float32),
        num_generated=jnp.zeros((batch,), jnp.int32),
        done=prompt_lengths_B <= 0,  # rows of length 0 pad the batch to its bucket
        row_keys=row_keys_B,
        stats=DecodeStats.zeros(batch, n),
        history=penalties.History.init(
            prompts_BP, prompt_lengths_B, dec.target_config.vocab_size, out_width
        ),
        top_logprobs=(jnp.full(top_shape, -1, jnp.int32), jnp.zeros(top_shape, jnp.float32)),
        stop=stop,
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
    single-row prefill forward per row filled, over the prompt width only); every
    per-row field of theirs (root, outputs, counters, key, statistics, the controls' history,
    the stop-string tail, the budget) is that of a fresh :func:`_prefill`. The other rows are
    unchanged. Stale cache slots past a row's new length are masked, as after any rejection."""
    spec = dec.spec
    batch = prompts_BP.shape[0]
    lengths_B = jnp.where(take_B, prompt_lengths_B.astype(jnp.int32), 0)
    committed_B = jnp.maximum(lengths_B - 1, 0)

    width = prompts_BP.shape[1]
    k = spec.num_drafts if spec.uses_draft else 1
    # The slots to fill, in slot order (entries past their count unused).
    (slots_R,) = jnp.nonzero(take_B, size=batch, fill_value=0)

    def prefill_row(config, params, prompt_1P, committed_1, cache):
        """One prompt's keys / values in a 1-row cache of the prompt's width only (no attention
        over the long cache), in ``cache``'s layout and dtype."""
        dtype = jax.tree.leaves(cache.k)[0].dtype
        row = kv_cache.init_cache(config, 1, width, dtype, per_layer=cache.per_layer)
        return _prefill_cache(forward_for(config), params, row, prompt_1P, committed_1)

    def write_rows(cache, row, first, count):
        """Rows ``first .. first + count - 1`` of ``cache`` take ``row``'s slots ``0 .. P - 1``."""

        def put(a, r):  # a: [L', B', KVH, S, H], r: [L', 1, KVH, P, H]
            r = jnp.broadcast_to(r, (r.shape[0], count) + r.shape[2:])
            return jax.lax.dynamic_update_slice(a, r.astype(a.dtype), (0, first, 0, 0, 0))

        if cache.per_layer:
            rk = tuple(x[None] for x in row.k)
            rv = tuple(x[None] for x in row.v)
            ks = tuple(put(a[None], r)[0] for a, r in zip(cache.k, rk))
            vs = tuple(put(a[None], r)[0] for a, r in zip(cache.v, rv))
        else:
            ks, vs = put(cache.k, row.k), put(cache.v, row.v)
        return dataclasses.replace(cache, k=ks, v=vs)

    def fill(i, caches):
        t_cache, d_cache = caches
        b = slots_R[i]
        prompt_1P = jax.lax.dynamic_slice_in_dim(prompts_BP, b, 1)
        committed_1 = jax.lax.dynamic_slice_in_dim(committed_B, b, 1)
        row = prefill_row(dec.target_config, target_params, prompt_1P, committed_1, t_cache)
        t_cache = write_rows(t_cache, row, b, 1)
        if d_cache is not None:  # the K replicas of the slot all start from the prompt
            row = prefill_row(dec.draft_config, draft_params, prompt_1P, committed_1, d_cache)
            d_cache = write_rows(d_cache, row, b * k, k)
        return t_cache, d_cache

    # One single-row prefill per slot filled: the work of a refill is its prompts' tokens,
    # whatever the number of slots.
    t_cache, d_cache = jax.lax.fori_loop(
        0, jnp.sum(take_B), fill, (state.target_cache, state.draft_cache)
    )
    t_cache = dataclasses.replace(t_cache, lengths=jnp.where(take_B, committed_B, t_cache.lengths))
    if d_cache is not None:
        d_cache = dataclasses.replace(
            d_cache,
            lengths=jnp.where(jnp.repeat(take_B, k), jnp.repeat(committed_B, k), d_cache.lengths),
        )
    n = spec.num_draft_tokens if spec.uses_draft else 0
    out_width = state.tokens.shape[1]
    top_shape = state.top_logprobs[0].shape
    stop = state.stop
    if stop is not None:
        stop = dataclasses.replace(stop, tail=jnp.full(stop.tail.shape, -1, stop.tail.dtype))
    fresh = dict(
        root=jnp.take_along_axis(prompts_BP, committed_B[:, None], axis=1)[:, 0].astype(jnp.int32),
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
        stop=stop,
        budget=_budget(spec, batch, budget_B),
    )

    def pick(new, old):
        if jax.dtypes.issubdtype(new.dtype, jax.dtypes.prng_key):
            data = pick(jax.random.key_data(new), jax.random.key_data(old))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(old))
        keep = take_B.reshape((batch,) + (1,) * (new.ndim - 1))
        return jnp.where(keep, new, old)

    merged = {}
    for name, value in fresh.items():
        old = getattr(state, name)
        if name == "stop" and value is not None:  # only the per-row tail
            merged[name] = dataclasses.replace(old, tail=pick(value.tail, old.tail))
        elif name == "done":
            merged[name] = jnp.where(take_B, value, old)
        else:
            merged[name] = jax.tree.map(pick, value, old)
    return dataclasses.replace(state, target_cache=t_cache, draft_cache=d_cache, **merged)


def _budget(spec: SpecConfig, batch: int, budget_B) -> jax.Array:
    """int32[B]: each row's ``max_new_tokens``, clipped to the static output width."""
    if budget_B is None:
        return jnp.full((batch,), spec.max_new_tokens, jnp.int32)
    budget_B = jnp.broadcast_to(jnp.asarray(budget_B, jnp.int32), (batch,))
    return jnp.clip(budget_B, 1, spec.max_new_tokens)


# --------------------------------------------------------------------------------------------
# One step


def _step_keys(state: DecodeState, purpose: int) -> jax.Array:
    fold = jax.vmap(jax.random.fold_in)
    step = fold(state.row_keys, state.num_generated)
    return fold(step, jnp.full(step.shape, purpose, jnp.uint32))


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
        next_B = jax.vmap(sample_token)(_step_keys(state, _PURPOSE_AR), logprobs_BV)
        active_B = ~state.done
        # A row whose law is unusable emits nothing and stops there.
        failed_B = active_B & ~(logits_ok(logits_BTV[:, 0]) & has_mass_BT[:, 0])
        num_B = (active_B & ~failed_B).astype(jnp.int32)
    with jax.named_scope("commit"):
        nodes_B1 = jnp.zeros((batch, 1), jnp.int32)
        t_cache = kv_cache.commit(
            state.target_cache, new_kv, nodes_B1, num_B, row_loop=kv_cache.row_loop_for(dec.mesh)
        )
        num_B, hit = _first_eos_length(next_B[:, None], num_B, sampling.eos_ids)
        num_B, ended_B = constraints.dead_slots(sampling, state.history, next_B[:, None], num_B)
        # One token: a stop string it completes is kept with it (num stays).
        num_B, hit_stop, stop = stopping.advance(state.stop, next_B[:, None], num_B)
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
    with jax.named_scope("emit"):
        next_lp_BT = jnp.take_along_axis(logprobs_BV, next_B[:, None], axis=1)
        return _emit(dec, state, next_B[:, None], next_lp_BT, num_B, hit | failed_B)


def _sync_draft_replicas(cache: kv_cache.KVCache, start_B, winner_B, num_drafts: int, width: int):
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


def _draft(dec: Decoder, draft_params, sampling, state) -> Drafts:
    """Stage 1: draw the step's tree (``SpecConfig.tree``) and lay it out by node: rolled out by
    the draft model (one draft cache replica per root path, cache rows b*L + l), or K chains
    copied from the row's text by prompt lookup (``lookup.py``, no cache)."""
    if dec.spec.drafter == "lookup":
        return _lookup_draft(dec, sampling, state)
    return _model_draft(dec, draft_params, sampling, state)


def _lookup_draft(dec: Decoder, sampling, state) -> Drafts:
    """Prompt lookup's K chains (point-mass draft laws), cut to each chain's match length."""
    spec = dec.spec
    n, k = spec.num_draft_tokens, spec.tree.num_chains
    batch = state.root.shape[0]
    tokens_BKD, draft_lp_BKDV, found_BK = lookup.lookup_drafts(
        state.history,
        ngram=spec.lookup_ngram,
        cap=spec.lookup_max or n,
        num_chains=k,
        draft_len=n,
        vocab=dec.target_config.vocab_size,
        sampling=sampling,
    )
    return _finish_drafts(
        dec,
        sampling,
        state,
        None,
        jnp.zeros((batch,), jnp.int32),
        tokens_BKD,
        draft_lp_BKDV,
        jnp.ones((batch, k, n), bool),
        found_BK,
    )


def _model_draft(dec: Decoder, draft_params, sampling, state) -> Drafts:
    """The draft model's rollout: one draft cache replica per root path (cache rows b*L + l)."""
    spec, tree = dec.spec, dec.spec.tree
    n, k = spec.num_draft_tokens, tree.num_chains
    batch = state.root.shape[0]
    draft_keys_B = _step_keys(state, _PURPOSE_DRAFT)
    chain_keys = jax.vmap(
        lambda key: jax.vmap(lambda c: jax.random.fold_in(key, c))(jnp.arange(k))
    )(draft_keys_B).reshape(batch * k)
    cache = state.target_cache if dec.share_draft_cache else state.draft_cache
    start_B = cache.lengths.reshape(batch, -1)[:, 0]
    run = rollout.rollout
    if dec.share_draft_cache:  # the target's first layers over its own cache (selfdraft.py)
        run = functools.partial(rollout.rollout, shared_layers=dec.draft_config.num_hidden_layers)
    if spec.draft_stop:  # no chain grows past what the step can use (never a shared cache)
        limit_B = jnp.where(state.done, 0, spec.max_new_tokens - state.num_generated - 1)
        run = functools.partial(rollout.rollout_stopped, limit_R=jnp.repeat(limit_B, k))
    d_cache, drafts, draft_lp, draft_ok_RD, *stopped = run(
        forward_for(dec.draft_config),
        draft_params,
        cache,
        jnp.repeat(state.root, k),
        chain_keys,
        draft_len=n,
        sampling=sampling.repeat(k),
        mesh=dec.mesh,
        plan=tree.plan,
        history=state.history.repeat(k),
    )
    vocab = draft_lp.shape[-1]
    stop_BK = stopped[0].reshape(batch, k) if stopped else jnp.full((batch, k), n, jnp.int32)
    return _finish_drafts(
        dec,
        sampling,
        state,
        d_cache,
        start_B,
        drafts.reshape(batch, k, n),
        draft_lp.reshape(batch, k, n, vocab),
        draft_ok_RD.reshape(batch, k, n),
        stop_BK,
    )


def _finish_drafts(
    dec: Decoder,
    sampling,
    state,
    d_cache,
    start_B,
    tokens_BKD,
    draft_lp_BKDV,
    draft_ok_BKD,
    usable_BK,
) -> Drafts:
    """The drafter's root paths (K = L replicas) cut to their usable lengths (``usable_BK``: the
    drafter's own, e.g. a lookup match's or a confidence stop's), then the common cuts below, and
    laid out by node."""
    spec, tree = dec.spec, dec.spec.tree
    n = spec.num_draft_tokens
    batch, k = usable_BK.shape
    # Drafts are shortened so that a step never emits past max_new_tokens, and end at an EOS.
    remaining_B = state.budget - state.num_generated
    lengths_BK = jnp.minimum(jnp.clip(remaining_B - 1, 0, n)[:, None], usable_BK)
    is_eos = _is_eos(tokens_BKD, sampling.eos_ids)
    first_eos = jnp.where(jnp.any(is_eos, -1), jnp.argmax(is_eos, -1) + 1, n)
    lengths_BK = jnp.minimum(lengths_BK, first_eos)
    # A chain ends before the token drawn from an unusable law (a stopping time: the law at depth
    # i depends on the chain's first i tokens only); only the depths the chain uses count.
    bad_BK = _first_false(draft_ok_BKD, n + 2)
    bad_BK = jnp.where(bad_BK < lengths_BK, bad_BK, n + 2)
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
        cache=d_cache,
        start_B=start_B,
        tokens_BN=tokens_BN,
        logprobs_BNV=tree.to_nodes(None, draft_lp_BKDV),
        lengths_BL=lengths_BK,
        bad_depth_BL=bad_BK,
        scored_BN=scored_slots(spec.resolved, tree, tokens_BN, valid_BN, dec.merge_tree),
    )


def _score(dec: Decoder, target_params, sampling, state, drafts: Drafts):
    """Stage 2: one target forward over the tree's scored slots (``drafts.scored_BN``: a slot
    attends to the scored slots of its root path); returns the processed target log-probs by
    node, float32[B, N, V] (node i: the target after node i), whether each of those laws is
    usable, bool[B, N] (:func:`asps_jax.processors.logits_ok`), the tree's new keys / values,
    and the number of draft nodes scored per row, int32[B]."""
    tree = dec.spec.tree.nodes
    scored_BN = drafts.scored_BN == jnp.arange(tree.num_nodes)[None, :]
    logits_BNV, new_kv = scoring.score_tree(
        forward_for(dec.target_config),
        target_params,
        state.target_cache,
        drafts.tokens_BN,
        tree,
        scored_BN,
        trees.merged_attention_mask(tree, drafts.scored_BN),
    )
    logits_BNV = sharding.constrain(logits_BNV, ("batch", None, "vocab"), dec.mesh)
    # Node i's path: its ancestors' tokens below the root.
    path_BND = drafts.tokens_BN[:, np.maximum(tree.paths[:, 1:], 0)]
    lp_BNV, mass_BN = penalties.process(sampling, state.history, logits_BNV, path_BND, tree.depth)
    scored_B = jnp.sum(scored_BN, axis=1) - 1
    return lp_BNV, logits_ok(logits_BNV) & mass_BN, new_kv, scored_B


def _verify(dec: Decoder, state, drafts: Drafts, target_lp_BNV) -> tuple[Verdict, jax.Array]:
    """Stage 3: the method's verifier on each row's tree (:func:`asps_jax.verify.step.
    verify_step`). Returns the :class:`Verdict` (``draft_index``: the replica that drew the
    accepted path) and the nodes of the accepted path, int32[B, D + 1]: the root, then one node
    per accepted draft token (entries from ``num_tokens`` on are never read)."""
    spec, tree = dec.spec, dec.spec.tree
    options = dict(spec.options)
    return jax.vmap(
        lambda key, x, lq, lp, valid: verify_step(
            spec.resolved, tree, key, x, lq, lp, valid, options, _ROWS
        ),
        axis_name=_ROWS,
    )(
        _step_keys(state, _PURPOSE_VERIFY),
        drafts.tokens_BN,
        drafts.logprobs_BNV,
        target_lp_BNV,
        tree.node_validity(drafts.lengths_BL),
    )


def _commit(dec: Decoder, state, drafts: Drafts, new_kv, path_BT, chain_B, num_B) -> DecodeState:
    """Stage 4: commit the first ``num_B`` nodes of the accepted path (the root and the accepted
    draft tokens) into the target cache; the draft replicas take replica ``chain_B``'s slots (a
    root path whose prefix is the accepted path)."""
    n, k = dec.spec.num_draft_tokens, dec.spec.tree.num_chains
    row_loop = kv_cache.row_loop_for(dec.mesh)
    t_cache = kv_cache.commit(state.target_cache, new_kv, path_BT, num_B, row_loop=row_loop)
    d_cache = drafts.cache
    # No draft cache of its own: a lookup has none; a self-draft's rollout scratch past the
    # committed slots of the target cache is stale now.
    if d_cache is None or dec.share_draft_cache:
        return dataclasses.replace(state, target_cache=t_cache)
    if k > 1:
        d_cache = _sync_draft_replicas(d_cache, drafts.start_B, chain_B, k, n + 1)
    d_cache = dataclasses.replace(d_cache, lengths=jnp.repeat(drafts.start_B + num_B, k))
    return dataclasses.replace(state, target_cache=t_cache, draft_cache=d_cache)


def _root_optimal_acceptance(dec: Decoder, drafts: Drafts, root_lp_BV) -> jax.Array:
    """The best root acceptance any exact token-level scheme could reach (docs/algorithms.md
    §3.5), float32[B], from the target's root law ``root_lp_BV``; NaN for K >= 2 drafts unless
    ``dec.diagnostics``."""
    root_draft_BV = drafts.logprobs_BNV[:, 0]  # every root child is drawn from this one law
    if dec.spec.num_drafts == 1:  # 1 - TV(p, q): no sort needed
        overlap_BV = jnp.minimum(root_lp_BV, root_draft_BV)
        return jnp.exp(jax.nn.logsumexp(overlap_BV, axis=-1))
    if not dec.diagnostics or dec.spec.drafter == "lookup":  # lookup: K different point masses
        return jnp.full(drafts.start_B.shape, jnp.nan, jnp.float32)
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
        if dec.share_draft_cache:  # the target cache, with the rollout's scratch slots written
            state = dataclasses.replace(state, target_cache=drafts.cache)
    with jax.named_scope("score"):
        target_lp, target_ok, new_kv, scored_B = _score(dec, target_params, sampling, state, drafts)
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
        num_B, hit_stop, stop = stopping.advance(state.stop, verdict.tokens, num_B)
        hit_eos = hit_eos | hit_stop
        failed_B = failed_B & ~hit_eos & ~ended_B
    with jax.named_scope("commit"):
        new_state = _commit(dec, state, drafts, new_kv, path_BT, verdict.draft_index, num_B)
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
