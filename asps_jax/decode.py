"""The jitted speculative decoding loop: ``prefill``, ``spec_step`` and ``generate``.

One compiled step is: draft rollout (``rollout.py``) -> one target forward over the token tree
(``scoring.py``) -> verification (``verify_chain`` / ``verify_drafts``) -> commit of the accepted
path into both KV caches -> emission. ``generate`` runs prefill and the whole loop in one
``lax.while_loop``; ``prefill`` + ``spec_step`` are the step-wise entry points for streaming.

Cache layout: both caches hold every committed token *except* the last emitted one, the *root*,
which is fed at the start of the next step. A step that emits L tokens therefore commits L slots:
the root and the L - 1 accepted draft tokens. Every row advances by its own L.

Randomness: one key per row; step keys are ``fold_in(row_key, tokens generated so far)``, then split
by purpose (draft chain k, verification). A row's tokens thus depend only on its key, its prompt and
the sampling parameters, never on the rest of the batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from asps_jax import kv_cache, rollout, scoring, trees
from asps_jax.models import forward_for
from asps_jax.processors import process_logits, sample_token
from asps_jax.verify import verify_chain, verify_drafts
from asps_jax.verify.acceptance import optimal_acceptance
from asps_jax.verify.api import CHAIN_METHODS

_PURPOSE_DRAFT = 0
_PURPOSE_VERIFY = 1
_PURPOSE_AR = 2


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static (hashable) description of the decoding loop; changing it recompiles."""

    method: str  # "ar" or a verify_chain / verify_drafts method
    num_draft_tokens: int  # n
    num_drafts: int  # K
    max_new_tokens: int  # M
    options: tuple = ()  # sorted (name, value) pairs passed to verify_drafts

    @property
    def uses_draft(self) -> bool:
        return self.method != "ar"

    @property
    def tree(self) -> trees.Tree:
        return trees.build_chain_tree(self.num_drafts, self.num_draft_tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling parameters and the EOS ids, passed as arrays: changing them never
    recompiles, and rows of one batch may sample with different settings."""

    temperature: jax.Array  # float32[B]
    draft_temperature: jax.Array  # float32[B]
    top_k: jax.Array  # int32[B], 0 disables
    top_p: jax.Array  # float32[B], 1 disables
    eos_ids: jax.Array  # int32[E]; a row stops at its first token in this set; -1 entries unused

    @classmethod
    def make(
        cls, batch, temperature=1.0, top_k=None, top_p=None, draft_temperature=None, eos_ids=()
    ):
        def rows(value, dtype):
            return jnp.broadcast_to(jnp.asarray(value, dtype), (batch,))

        t = rows(temperature, jnp.float32)
        return cls(
            temperature=t,
            draft_temperature=t
            if draft_temperature is None
            else rows(draft_temperature, jnp.float32),
            top_k=rows(0 if top_k is None else top_k, jnp.int32),
            top_p=rows(1.0 if top_p is None else top_p, jnp.float32),
            eos_ids=jnp.asarray(list(eos_ids) or [-1], jnp.int32),
        )

    def process(self, logits_B_V: jax.Array, *, draft: bool = False) -> jax.Array:
        """Row-wise :func:`process_logits` of ``logits[B, ..., V]`` with each row's parameters."""
        temperature = self.draft_temperature if draft else self.temperature

        def filtered(logits):
            return jax.vmap(process_logits)(logits, temperature, self.top_k, self.top_p)

        def temperature_only(logits):  # no V-sized sort: the common case, and much cheaper
            return jax.vmap(process_logits)(logits, temperature)

        # A batch-level predicate, so this is a real branch (a per-row cond under vmap would
        # run both sides).
        any_filter = jnp.any(self.top_k > 0) | jnp.any(self.top_p < 1.0)
        return jax.lax.cond(any_filter, filtered, temperature_only, logits_B_V)

    def repeat(self, k: int) -> SamplingParams:
        """The parameters of rows ``b * k + j`` (K draft replicas per row)."""
        rep = functools.partial(jnp.repeat, repeats=k, axis=0)
        return dataclasses.replace(
            self,
            temperature=rep(self.temperature),
            draft_temperature=rep(self.draft_temperature),
            top_k=rep(self.top_k),
            top_p=rep(self.top_p),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeStats:
    """Per-row counters, kept on device."""

    target_calls: jax.Array  # int32[B], target forwards after prefill
    emitted_hist: jax.Array  # int32[B, n+2], steps that emitted L tokens, L = 0..n+1
    decisions: jax.Array  # int32[B], draft tokens verified (accept/reject decisions)
    accepted: jax.Array  # int32[B], draft tokens accepted
    fallbacks: jax.Array  # int32[B], LP solves replaced by an exact fallback rule
    root_steps: jax.Array  # int32[B], steps with at least one draft token at the root
    root_accepted: jax.Array  # int32[B], of those, steps whose first token is a root draft token
    root_optimal: jax.Array  # float32[B], sum over those steps of optimal_acceptance at the root
    bad_logits: jax.Array  # bool[B], a target or draft law had no finite entry (NaN logits)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    target_cache: kv_cache.KVCache  # batch B
    draft_cache: kv_cache.KVCache | None  # batch B * K (K replicas per row), None for "ar"
    root: jax.Array  # int32[B], last emitted token, not yet in the caches
    tokens: jax.Array  # int32[B, M + n + 1], -1 after each row's end
    num_generated: jax.Array  # int32[B]
    done: jax.Array  # bool[B]
    row_keys: jax.Array  # typed keys [B]
    stats: DecodeStats


# --------------------------------------------------------------------------------------------
# Prefill


def _prefill_cache(forward, params, cache, prompts_BP, num_B):
    """Commit the first ``num_B`` prompt tokens of each row into ``cache``."""
    rows, width = prompts_BP.shape
    valid_BP = jnp.arange(width)[None, :] < num_B[:, None]
    _, new_kv = scoring.score_chain(forward, params, cache, prompts_BP, valid_BP)
    nodes_BP = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
    return kv_cache.commit(cache, new_kv, nodes_BP, num_B)


@functools.partial(jax.jit, static_argnames=("target_config", "draft_config", "spec", "cache_len"))
def prefill(
    target_config,
    draft_config,
    spec: SpecConfig,
    cache_len: int,
    target_params,
    draft_params,
    prompts_BP: jax.Array,
    prompt_lengths_B: jax.Array,
    row_keys_B: jax.Array,
) -> DecodeState:
    """Build the caches from right-padded prompts; the last prompt token becomes the root."""
    batch = prompts_BP.shape[0]
    n = spec.num_draft_tokens if spec.uses_draft else 0
    prompt_lengths_B = prompt_lengths_B.astype(jnp.int32)
    committed_B = jnp.maximum(prompt_lengths_B - 1, 0)
    t_dtype = jax.tree.leaves(target_params)[0].dtype
    t_cache = kv_cache.init_cache(target_config, batch, cache_len, t_dtype)
    t_cache = _prefill_cache(
        forward_for(target_config), target_params, t_cache, prompts_BP, committed_B
    )
    d_cache = None
    if spec.uses_draft:
        k = spec.num_drafts
        d_dtype = jax.tree.leaves(draft_params)[0].dtype
        d_cache = kv_cache.init_cache(draft_config, batch * k, cache_len, d_dtype)
        d_cache = _prefill_cache(
            forward_for(draft_config),
            draft_params,
            d_cache,
            jnp.repeat(prompts_BP, k, axis=0),
            jnp.repeat(committed_B, k),
        )
    root_B = jnp.take_along_axis(prompts_BP, committed_B[:, None], axis=1)[:, 0]
    zeros_B = jnp.zeros((batch,), jnp.int32)
    stats = DecodeStats(
        target_calls=zeros_B,
        emitted_hist=jnp.zeros((batch, n + 2), jnp.int32),
        decisions=zeros_B,
        accepted=zeros_B,
        fallbacks=zeros_B,
        root_steps=zeros_B,
        root_accepted=zeros_B,
        root_optimal=jnp.zeros((batch,), jnp.float32),
        bad_logits=jnp.zeros((batch,), bool),
    )
    return DecodeState(
        target_cache=t_cache,
        draft_cache=d_cache,
        root=root_B.astype(jnp.int32),
        tokens=jnp.full((batch, spec.max_new_tokens + n + 1), -1, jnp.int32),
        num_generated=zeros_B,
        done=prompt_lengths_B <= 0,  # rows of length 0 pad the batch to its bucket
        row_keys=row_keys_B,
        stats=stats,
    )


# --------------------------------------------------------------------------------------------
# One step


def _step_keys(state: DecodeState, purpose: int) -> jax.Array:
    fold = jax.vmap(jax.random.fold_in)
    step = fold(state.row_keys, state.num_generated)
    return fold(step, jnp.full(step.shape, purpose, jnp.uint32))


def _is_eos(tokens, eos_ids_E) -> jax.Array:
    eos = eos_ids_E.reshape((1,) * tokens.ndim + eos_ids_E.shape)
    return jnp.any((tokens[..., None] == eos) & (eos >= 0), axis=-1)


def _first_eos_length(tokens_BT, num_B, eos_ids_E):
    """Truncate each row's ``num`` at its first EOS (kept); returns (num, hit_eos)."""
    width = tokens_BT.shape[1]
    pos = jnp.arange(width)[None, :]
    is_eos = _is_eos(tokens_BT, eos_ids_E) & (pos < num_B[:, None])
    first = jnp.min(jnp.where(is_eos, pos, width), axis=1)
    hit = first < width
    return jnp.where(hit, first + 1, num_B), hit


def _emit(state: DecodeState, spec: SpecConfig, tokens_BT, num_B, extra_done_B) -> DecodeState:
    """Write ``tokens[:num]`` of each active row at its output position; mark finished rows."""
    active_B = ~state.done
    num_B = jnp.where(active_B, num_B, 0)
    width = tokens_BT.shape[1]

    def write(row_out, row_new, start, count):
        window = jax.lax.dynamic_slice(row_out, (start,), (width,))
        window = jnp.where(jnp.arange(width) < count, row_new, window)
        return jax.lax.dynamic_update_slice(row_out, window, (start,))

    out = jax.vmap(write)(state.tokens, tokens_BT, state.num_generated, num_B)
    generated_B = state.num_generated + num_B
    last_B = jnp.take_along_axis(tokens_BT, jnp.maximum(num_B - 1, 0)[:, None], axis=1)[:, 0]
    done_B = state.done | (active_B & (extra_done_B | (generated_B >= spec.max_new_tokens)))
    return dataclasses.replace(
        state,
        tokens=out,
        num_generated=generated_B,
        root=jnp.where(num_B > 0, last_B, state.root),
        done=done_B,
    )


def _ar_step(target_config, spec, target_params, sampling, state):
    forward = forward_for(target_config)
    batch = state.root.shape[0]
    valid = jnp.ones((batch, 1), bool)
    logits_B1V, new_kv = scoring.score_chain(
        forward, target_params, state.target_cache, state.root[:, None], valid
    )
    logprobs_BV = sampling.process(logits_B1V[:, 0])
    next_B = jax.vmap(sample_token)(_step_keys(state, _PURPOSE_AR), logprobs_BV)
    active_B = ~state.done
    num_B = active_B.astype(jnp.int32)
    t_cache = kv_cache.commit(state.target_cache, new_kv, jnp.zeros((batch, 1), jnp.int32), num_B)
    num_B, hit = _first_eos_length(next_B[:, None], num_B, sampling.eos_ids)
    stats = state.stats
    stats = dataclasses.replace(
        stats,
        target_calls=stats.target_calls + num_B,
        emitted_hist=stats.emitted_hist.at[:, 1].add(num_B),
        bad_logits=stats.bad_logits | (active_B & ~jnp.any(jnp.isfinite(logprobs_BV), -1)),
    )
    state = dataclasses.replace(state, target_cache=t_cache, stats=stats)
    return _emit(state, spec, next_B[:, None], num_B, hit)


def _sync_draft_replicas(cache: kv_cache.KVCache, start_B, winner_B, num_drafts: int, width: int):
    """Copy slots ``[start, start + width)`` of the winning chain's replica to all K replicas."""
    batch = start_B.shape[0]

    def sync(a_LRSKH):
        layers, rows, slots = a_LRSKH.shape[:3]
        a = a_LRSKH.reshape((layers, batch, num_drafts, slots) + a_LRSKH.shape[3:])

        def per_row(row_a, start, winner):  # row_a: [L, K, S, KVH, H]
            window = jax.lax.dynamic_slice_in_dim(row_a, start, width, axis=2)
            chosen = jnp.take(window, winner, axis=1)[:, None]
            window = jnp.broadcast_to(chosen, window.shape)
            return jax.lax.dynamic_update_slice_in_dim(row_a, window, start, axis=2)

        a = jax.vmap(per_row, in_axes=(1, 0, 0), out_axes=1)(a, start_B, winner_B)
        return a.reshape(a_LRSKH.shape)

    return dataclasses.replace(cache, k=sync(cache.k), v=sync(cache.v))


def _spec_step(target_config, draft_config, spec, target_params, draft_params, sampling, state):
    n, k = spec.num_draft_tokens, spec.num_drafts
    tree = spec.tree
    batch = state.root.shape[0]
    active_B = ~state.done

    # --- Step 1: draft rollout, K chains per row (cache rows b*K + k) ---
    draft_keys = _step_keys(state, _PURPOSE_DRAFT)
    chain_keys = jax.vmap(
        lambda key: jax.vmap(lambda c: jax.random.fold_in(key, c))(jnp.arange(k))
    )(draft_keys).reshape(batch * k)
    start_B = state.draft_cache.lengths.reshape(batch, k)[:, 0]
    d_cache, drafts_RD, draft_lp_RDV, draft_ok_R = rollout.rollout(
        forward_for(draft_config),
        draft_params,
        state.draft_cache,
        jnp.repeat(state.root, k),
        chain_keys,
        draft_len=n,
        sampling=sampling.repeat(k),
    )
    vocab = draft_lp_RDV.shape[-1]
    drafts_BKD = drafts_RD.reshape(batch, k, n)
    draft_lp_BKDV = draft_lp_RDV.reshape(batch, k, n, vocab)

    # Drafts are shortened so that a step never emits past max_new_tokens, and end at an EOS.
    remaining_B = spec.max_new_tokens - state.num_generated
    lengths_BK = jnp.broadcast_to(jnp.clip(remaining_B - 1, 0, n)[:, None], (batch, k))
    is_eos = _is_eos(drafts_BKD, sampling.eos_ids)
    first_eos = jnp.where(jnp.any(is_eos, -1), jnp.argmax(is_eos, -1) + 1, n)
    lengths_BK = jnp.minimum(lengths_BK, first_eos)

    # --- Step 2: one target forward over the whole tree ---
    valid_BN = trees.node_validity(tree, lengths_BK)
    node_tokens = trees.chain_tokens_to_nodes(state.root, drafts_BKD)
    logits_BNV, new_kv = scoring.score_tree(
        forward_for(target_config), target_params, state.target_cache, node_tokens, tree, valid_BN
    )
    paths_KP = trees.path_nodes(tree, jnp.arange(k))  # [K, n+1]
    target_lp_BKPV = sampling.process(logits_BNV[:, paths_KP])

    # --- Step 3: verification ---
    verify_keys = _step_keys(state, _PURPOSE_VERIFY)
    if spec.method in CHAIN_METHODS and k == 1:
        verdict = jax.vmap(
            lambda key, x, lq, lp, length: verify_chain(
                key, x, lq, lp, method=spec.method, draft_length=length
            )
        )(
            verify_keys,
            drafts_BKD[:, 0],
            draft_lp_BKDV[:, 0],
            target_lp_BKPV[:, 0],
            lengths_BK[:, 0],
        )
    else:
        options = dict(spec.options)
        verdict = jax.vmap(
            lambda key, x, lq, lp, length: verify_drafts(
                key, x, lq, lp, method=spec.method, draft_length=length, **options
            )
        )(verify_keys, drafts_BKD, draft_lp_BKDV, target_lp_BKPV, lengths_BK)

    # --- Step 4: EOS inside the emitted block ends the row there ---
    num_B = jnp.where(active_B, verdict.num_tokens, 0)
    num_B, hit_eos = _first_eos_length(verdict.tokens, num_B, sampling.eos_ids)

    # --- Step 5: commit the root and the accepted draft tokens into both caches ---
    t_cache = kv_cache.commit(
        state.target_cache, new_kv, trees.path_nodes(tree, verdict.draft_index), num_B
    )
    if k > 1:
        d_cache = _sync_draft_replicas(d_cache, start_B, verdict.draft_index, k, n + 1)
    d_cache = dataclasses.replace(d_cache, lengths=jnp.repeat(start_B + num_B, k))

    # --- Step 6: statistics ---
    chosen_len_B = jnp.take_along_axis(lengths_BK, verdict.draft_index[:, None], axis=1)[:, 0]
    target_ok = jnp.all(jnp.any(jnp.isfinite(target_lp_BKPV), -1), axis=(1, 2))
    draft_ok = jnp.all(draft_ok_R.reshape(batch, k), axis=1)
    calls_B = active_B.astype(jnp.int32)
    # Token-level acceptance at the root, where all K drafts are alive, beside the best any exact
    # token-level scheme could reach there (docs/algorithms.md §3.5).
    root_live_BK = lengths_BK >= 1
    root_B = calls_B * jnp.any(root_live_BK, axis=1)
    root_hit_B = jnp.any(root_live_BK & (drafts_BKD[:, :, 0] == verdict.tokens[:, :1]), axis=1)
    if k == 1:  # 1 - TV(p, q): no sort needed
        overlap = jnp.minimum(target_lp_BKPV[:, 0, 0], draft_lp_BKDV[:, 0, 0])
        root_opt_B = jnp.exp(jax.nn.logsumexp(overlap, axis=-1))
    else:
        root_opt_B = optimal_acceptance(target_lp_BKPV[:, 0, 0], draft_lp_BKDV[:, :, 0])
    stats = state.stats
    stats = dataclasses.replace(
        stats,
        root_steps=stats.root_steps + root_B,
        root_accepted=stats.root_accepted + root_B * root_hit_B,
        root_optimal=stats.root_optimal + root_B * root_opt_B,
        target_calls=stats.target_calls + calls_B,
        emitted_hist=stats.emitted_hist
        + calls_B[:, None] * jax.nn.one_hot(num_B, n + 2, dtype=jnp.int32),
        decisions=stats.decisions + calls_B * jnp.minimum(verdict.num_tokens, chosen_len_B),
        accepted=stats.accepted + calls_B * (verdict.num_tokens - 1),
        fallbacks=stats.fallbacks + calls_B * verdict.num_fallbacks,
        bad_logits=stats.bad_logits | (active_B & ~(target_ok & draft_ok)),
    )
    state = dataclasses.replace(state, target_cache=t_cache, draft_cache=d_cache, stats=stats)
    return _emit(state, spec, verdict.tokens, num_B, hit_eos)


def _step(target_config, draft_config, spec, target_params, draft_params, sampling, state):
    if spec.uses_draft:
        return _spec_step(
            target_config, draft_config, spec, target_params, draft_params, sampling, state
        )
    return _ar_step(target_config, spec, target_params, sampling, state)


@functools.partial(
    jax.jit, static_argnames=("target_config", "draft_config", "spec"), donate_argnames=("state",)
)
def spec_step(
    target_config, draft_config, spec, target_params, draft_params, sampling, state
) -> DecodeState:
    """One speculative step for every row (finished rows are left unchanged)."""
    return _step(target_config, draft_config, spec, target_params, draft_params, sampling, state)


@functools.partial(jax.jit, static_argnames=("target_config", "draft_config", "spec", "cache_len"))
def generate(
    target_config,
    draft_config,
    spec: SpecConfig,
    cache_len: int,
    target_params,
    draft_params,
    sampling: SamplingParams,
    prompts_BP,
    prompt_lengths_B,
    row_keys_B,
) -> DecodeState:
    """Prefill and run steps in one ``lax.while_loop`` until every row is done."""
    state = prefill.__wrapped__(
        target_config,
        draft_config,
        spec,
        cache_len,
        target_params,
        draft_params,
        prompts_BP,
        prompt_lengths_B,
        row_keys_B,
    )

    def cond(state):
        return ~jnp.all(state.done)

    def body(state):
        return _step(
            target_config, draft_config, spec, target_params, draft_params, sampling, state
        )

    return jax.lax.while_loop(cond, body, state)
