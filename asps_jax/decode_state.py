"""The decoding loop's values: its static method description (:class:`SpecConfig`), its carry
(:class:`DecodeState`) and what the draft stage hands to the others in a step (:class:`Drafts`);
and how rows enter the carry: a fresh state from prompts (:func:`prefill`), an empty one
(:func:`empty`) and new prompts in some rows of a running one (:func:`insert`, continuous
batching).

These are the bodies of the jitted public entry points :meth:`Decoder.prefill
<asps_jax.decode.Decoder.prefill>`, :meth:`Decoder.empty <asps_jax.decode.Decoder.empty>` and
:meth:`Decoder.insert <asps_jax.decode.Decoder.insert>` (JetStream's ``init_decode_state`` /
``insert``; ``Decoder.step`` is its ``generate``); ``dec`` is the static
:class:`~asps_jax.decode.Decoder` (read for its configs, drafter, method and sizes; this module
does not import :mod:`asps_jax.decode`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from asps_jax import controls, kv_cache, scoring, sharding, trees
from asps_jax.models import forward_for
from asps_jax.statistics import DecodeStats
from asps_jax.verify.registry import REGISTRY, Method

__all__ = ["DecodeState", "Drafts", "SpecConfig", "empty", "insert", "prefill"]


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
        (:class:`~asps_jax.controls.History`).
      top_logprobs: ``(ids int32[B, max_new_tokens + D + 1, k], logprobs float32[...,k])``, the
        k most likely tokens of the processed target law of each emitted token
        (``Decoder.top_logprobs`` = k; k = 0 records nothing).
      raw_logprobs: float32[B, max_new_tokens + D + 1] with ``Decoder.raw_logprobs`` (else
        float32[B, 0]): each emitted token's log-probability under the *unprocessed* target law,
        ``log_softmax(logits)`` at temperature 1 with no control, filter or constraint; 0.0
        after the row's end.
      stop: the stop strings and each row's last bytes of text
        (:class:`~asps_jax.controls.StopStrings`); None without stop strings.
      budget: int32[B], each row's ``max_new_tokens`` (at most ``SpecConfig.max_new_tokens``,
        the static output width): a traced value, so budgets within one width share a program.
      step_keys: typed PRNG keys [B, purposes] inside one step (``drafters.base.step_keys``:
        every purpose's key derived once at the step's start); None between steps.
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
    history: controls.History
    top_logprobs: tuple[jax.Array, jax.Array]
    raw_logprobs: jax.Array
    stop: controls.StopStrings | None = None
    budget: jax.Array | None = None
    step_keys: jax.Array | None = None


def prefill(
    dec,
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
    """A fresh state from right-padded prompts: the caches take each prompt's committed tokens
    (all but the last, which becomes the root), every per-row field starts empty. ``stop``: the
    call's :class:`~asps_jax.controls.StopStrings` (None: none); ``budget_B``:
    int32[B], each row's ``max_new_tokens`` (None: ``spec.max_new_tokens`` for every row).
    ``run_forward=False``: the caches stay empty (:func:`empty`)."""
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
        forward = forward_for(dec.target_config, feature_layers(dec))
        # With n samples per prompt (rows p * n + i hold prompt p): one forward per prompt.
        filled = scoring.prefill_cache_grouped(
            forward, target_params, t_cache, prompts_BP, committed_B, dec.samples
        )
        t_cache = filled.cache
        if dec.drafter is not None:
            draft = dec.drafter.prefill(
                dec, draft_params, draft, prompts_BP, committed_B, **_features(dec, filled)
            )
    fresh = _fresh_rows(dec, prompts_BP, prompt_lengths_B, committed_B, row_keys_B, budget_B)
    state = DecodeState(target_cache=t_cache, draft=draft, stop=stop, **fresh)
    return sharding.constrain_state(state, dec.mesh)  # the loop's carry: one layout per chip


def feature_layers(dec) -> tuple[int, ...]:
    """The target layers whose streams the drafter reads (``Drafter.feature_layers``)."""
    return () if dec.drafter is None else dec.drafter.feature_layers


def _features(dec, filled: scoring.Filled) -> dict:
    """The ``features=`` keyword of a drafter's prefill / refill: the prompts' features for a
    drafter that declares feature layers, none for one that reads none."""
    return {"features": filled.features} if feature_layers(dec) else {}


def _fresh_rows(dec, prompts_BP, lengths_B, committed_B, row_keys_B, budget_B) -> dict:
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
        history=controls.History.init(
            prompts_BP, lengths_B, dec.target_config.vocab_size, out_width
        ),
        top_logprobs=(jnp.full(top_shape, -1, jnp.int32), jnp.zeros(top_shape, jnp.float32)),
        raw_logprobs=jnp.zeros((batch, out_width if dec.raw_logprobs else 0), jnp.float32),
        budget=_budget(spec, batch, budget_B),
    )


def insert(
    dec,
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
    batching, :mod:`asps_jax.slots`; ``prompts_BP`` etc. hold one row per state row, read only
    in the rows taken): their caches take the prompt's committed tokens (one
    single-row prefill forward per row filled, over the prompt width only,
    :func:`asps_jax.scoring.refill_rows`; the drafter's state by ``Drafter.refill``); every
    per-row field of theirs (root, outputs, counters, key, statistics, the controls' history,
    the stop-string tail, the budget) is that of a fresh :func:`prefill`. The other rows are
    unchanged. Stale cache slots past a row's new length are masked, as after any rejection."""
    batch = prompts_BP.shape[0]
    lengths_B = jnp.where(take_B, prompt_lengths_B.astype(jnp.int32), 0)
    committed_B = jnp.maximum(lengths_B - 1, 0)
    forward = forward_for(dec.target_config, feature_layers(dec))
    filled = scoring.refill_rows(
        forward, dec.target_config, target_params, state.target_cache, take_B, prompts_BP,
        committed_B,
    )  # fmt: skip
    t_cache, draft = filled.cache, state.draft
    if dec.drafter is not None:
        draft = dec.drafter.refill(
            dec, draft_params, draft, take_B, prompts_BP, committed_B, **_features(dec, filled)
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


def _budget(spec, batch: int, budget_B) -> jax.Array:
    """int32[B]: each row's ``max_new_tokens``, clipped to the static output width."""
    if budget_B is None:
        return jnp.full((batch,), spec.max_new_tokens, jnp.int32)
    budget_B = jnp.broadcast_to(jnp.asarray(budget_B, jnp.int32), (batch,))
    return jnp.clip(budget_B, 1, spec.max_new_tokens)


def empty(dec, target_params, draft_params, row_keys_B, prompt_width: int, stop=None):
    """A state of ``B`` empty rows (``B``: the keys' length): caches allocated, nothing run,
    every row done, for :func:`insert` to fill with prompts of ``prompt_width`` tokens at most."""
    batch = row_keys_B.shape[0]
    return prefill(
        dec,
        target_params,
        draft_params,
        jnp.zeros((batch, prompt_width), jnp.int32),
        jnp.zeros((batch,), jnp.int32),  # length 0: every row starts done (empty)
        row_keys_B,
        stop,
        jnp.ones((batch,), jnp.int32),
        run_forward=False,
    )
