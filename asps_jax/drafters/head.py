"""A learned head on the target's own features (``draft="eagle3:PATH"``): EAGLE-3's one decoder
layer drafting from the target's hidden states, exact under every verifier. The head's model
(config, parameters, forward, checkpoints in the EAGLE-3 layout) is
:mod:`asps_jax.models.eagle3` (its names are re-exported here); this module is its drafter.

Exactness: the draft law is the softmax of the head's logits placed on the target's vocabulary
(probability 0 outside the draft vocabulary: the residual covers those tokens), then processed
like every drafter's (:func:`asps_jax.controls.laws`: temperature, every control and
constraint, on each chain's own path). It depends on the committed text and the chain's own
tokens only, so every verifier (sps, asps, specinfer, spectr, is, tv, tv_wr, is_bv) keeps the
target's law with it, on chains, K chains and branching trees.

Features without an extra forward. The target's scoring pass returns the chosen layers' streams
at every scored node (``forward_for(config, features)``); after verification the accepted path's
features and the emitted tokens are the head's *pending* entries (:meth:`EagleHead.take`): entry
j pairs the feature at committed slot ``m + j`` with the token after it. The next step's rollout
first feeds the pending entries in one head forward (their keys / values committed to the head's
cache), whose last output gives the first draft law; depth i >= 1 feeds the head's own hidden
vector and the token drawn at depth i - 1. Prefill fills the head's cache from the prompt's
features (the target's prefill forward returns them), the prompt's last entry left pending.

K chains and trees: the head keeps K replicas of every row's cache (like a draft model,
:class:`~asps_jax.drafters.model.ModelDraft`); the rollout's slots past the committed ones are
overwritten by the next step's pending entries, so no replica needs syncing after a step.
"""

from __future__ import annotations

import dataclasses
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax import footprint, kv_cache, scoring
from asps_jax.drafters.base import Drafter, Proposal, load_named
from asps_jax.drafters.model import rollout_proposal
from asps_jax.models.eagle3 import (
    CONFIG_FILE,
    PREFIX,
    WEIGHTS_FILE,
    Head,
    HeadConfig,
    check_matches,
    default_feature_layers,
    forward,
    fuse,
    init_params,
    load_head,
    param_shapes,
    save_head,
    target_logits,
    trainable,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadState:
    """The head's state between steps (a pytree).

    Attributes:
      cache: the head's KV cache, one layer, K replicas of every row (row b, chain k at
        ``b * K + k``), its lengths the committed entries.
      features: float[B, n + 1, F], the pending entries' target features (F = 3 * E_t).
      tokens: int32[B, n + 1], the token after each pending entry's position.
      count: int32[B], the pending entries (0 for a finished row).
      placeholder: bool[B], the one pending entry stands in for a missing feature (a one-token
        prompt has no committed position): the next step's entries overwrite it.
    """

    cache: kv_cache.KVCache
    features: jax.Array
    tokens: jax.Array
    count: jax.Array
    placeholder: jax.Array


_ROW_FIELDS = ("features", "tokens", "count", "placeholder")  # [B, ...]: a row's own


def _mask(cache, valid_RT):
    """The mask of a chain of new entries over the committed cache slots."""
    T = valid_RT.shape[1]
    return jnp.concatenate([kv_cache.cache_mask(cache, T), scoring.chain_mask(valid_RT)], -1)


def _chain(c, params, cache, hidden_RTE, tokens_RT, count_R):
    """Feed ``count_R`` entries of each row as one chain, committing their keys / values:
    ``(cache, logits float32[R, T, V_d], hidden out [R, T, E])``."""
    R, T = tokens_RT.shape
    valid_RT = jnp.arange(T)[None, :] < count_R[:, None]
    positions_RT = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    out = forward(c, params, hidden_RTE, tokens_RT, positions_RT, _mask(cache, valid_RT), cache)
    nodes = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (R, T))
    return kv_cache.commit(cache, out.kv, nodes, count_R), out.logits, out.features


@dataclasses.dataclass(frozen=True)
class EagleHead(Drafter):
    """The drafter of a learned head (``draft="eagle3:PATH"``); see the module docstring."""

    config: HeadConfig
    where: str = dataclasses.field(default="", compare=False)  # for messages only

    replicated = True

    @property
    def name(self) -> str:
        return "eagle3"

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers

    def context(self) -> int | None:
        return self.config.max_position_embeddings

    def context_source(self) -> str:
        return f"{self.where or self.name}: {CONFIG_FILE} max_position_embeddings"

    def footprint(self, sizes) -> dict[str, int]:
        c = self.config
        rows, itemsize = sizes.rows * sizes.replicas, sizes.draft_itemsize
        d = dict(
            heads=c.num_attention_heads,
            width=4 * c.hidden_size + 3 * c.intermediate_size,
            kv_slot=2 * c.num_key_value_heads * c.head_dim,
        )
        width = len(c.feature_layers) * c.target_hidden_size
        pending = sizes.rows * (sizes.depth + 1) * width * footprint.F32
        chain = footprint.forward_bytes(d, rows, sizes.depth + 1, sizes.slots, itemsize)
        prompt = footprint.forward_bytes(d, sizes.rows, sizes.prompt, sizes.slots, itemsize)
        return {
            "kv caches": rows * sizes.slots * d["kv_slot"] * itemsize + pending,
            "draft rollout": max(chain, prompt) + 3 * footprint.F32 * rows * sizes.vocab,
            "laws": footprint.rollout_law_bytes(sizes),
        }

    def _empty(self, dec, params, batch: int) -> HeadState:
        c, n = self.config, dec.spec.num_draft_tokens
        cache = kv_cache.init_cache(
            c, batch * dec.spec.tree.num_chains, dec.cache_len, params["wq"].dtype
        )
        width = len(c.feature_layers) * c.target_hidden_size
        return HeadState(
            cache=cache,
            features=jnp.zeros((batch, n + 1, width), params["fc"].dtype),
            tokens=jnp.zeros((batch, n + 1), jnp.int32),
            count=jnp.zeros((batch,), jnp.int32),
            placeholder=jnp.zeros((batch,), bool),
        )

    def init(self, dec, params, batch: int):
        return self._empty(dec, params, batch)

    def prefill(self, dec, params, state, prompts_BP, committed_B, features=None):
        """Entries ``t < m - 1`` of the prompt (feature t, token t + 1) into the cache, entry
        ``m - 1`` (the root's) pending; with no committed token (a one-token prompt) the pending
        entry is a placeholder of zero features, overwritten after the first step."""
        c, k = self.config, dec.spec.tree.num_chains
        batch, width = prompts_BP.shape
        state = self._empty(dec, params, batch)
        shifted_BP = jnp.concatenate([prompts_BP[:, 1:], prompts_BP[:, -1:]], axis=1)
        once = kv_cache.init_cache(c, batch, dec.cache_len, state.cache.k.dtype)
        once, _, _ = _chain(
            c,
            params,
            once,
            fuse(params, features),
            shifted_BP.astype(jnp.int32),
            jnp.maximum(committed_B - 1, 0),
        )
        last_B = jnp.maximum(committed_B - 1, 0)
        feature_BF = jnp.take_along_axis(features, last_B[:, None, None], axis=1)[:, 0]
        feature_BF = jnp.where((committed_B > 0)[:, None], feature_BF, 0)
        root_B = jnp.take_along_axis(prompts_BP, committed_B[:, None], axis=1)[:, 0]
        return HeadState(
            cache=once.take_rows(np.arange(batch * k) // k),
            features=state.features.at[:, 0].set(feature_BF.astype(state.features.dtype)),
            tokens=state.tokens.at[:, 0].set(root_B.astype(jnp.int32)),
            count=jnp.ones((batch,), jnp.int32),
            placeholder=committed_B == 0,
        )

    def refill(self, dec, params, state, take_B, prompts_BP, committed_B, features=None):
        fresh = self.prefill(dec, params, state, prompts_BP, committed_B, features)
        take_R = jnp.repeat(take_B, dec.spec.tree.num_chains)  # a row's K cache replicas

        def pick(keep, axis):
            def where(new, old):
                shape = [1] * new.ndim
                shape[axis] = keep.shape[0]
                return jnp.where(keep.reshape(shape), new, old)

            return where

        new, old = fresh.cache, state.cache
        cache = kv_cache.KVCache(
            k=pick(take_R, 1)(new.k, old.k),  # [1, R, KVH, S, H]
            v=pick(take_R, 1)(new.v, old.v),
            lengths=jnp.where(take_R, new.lengths, old.lengths),
        )
        rows = [pick(take_B, 0)(getattr(fresh, f), getattr(state, f)) for f in _ROW_FIELDS]
        return HeadState(cache, *rows)

    def propose(self, dec, params, sampling, state) -> Proposal:
        c, k = self.config, dec.spec.tree.num_chains
        own = state.draft
        rows = own.count.shape[0] * k
        rep = lambda a: jnp.repeat(a, k, axis=0)  # noqa: E731
        cache, logits_RTD, hidden_RTE = _chain(
            c, params, own.cache, fuse(params, rep(own.features)), rep(own.tokens), rep(own.count)
        )
        last_R = jnp.maximum(rep(own.count) - 1, 0)[:, None, None]
        first_R1V = target_logits(
            params, jnp.take_along_axis(logits_RTD, last_R, axis=1), c.vocab_size
        )
        first_hidden_RE = jnp.take_along_axis(hidden_RTE, last_R, axis=1)[:, 0]
        base_R = cache.lengths - rep(own.placeholder).astype(jnp.int32)
        ones_R = jnp.ones((rows,), jnp.int32)

        def feed(carry, token_R, depth):
            def first(carry):
                return carry, first_R1V

            def later(carry):
                cache, hidden_RE = carry
                cache, logits, hidden = _chain(
                    c, params, cache, hidden_RE[:, None], token_R[:, None], ones_R
                )
                return (cache, hidden[:, 0]), target_logits(params, logits, c.vocab_size)

            return jax.lax.cond(depth == 0, first, later, carry)

        (cache, _), drawn = rollout_proposal(
            dec, sampling, state, feed, (cache, first_hidden_RE), store_last=False
        )
        # A law with no mass from finite logits (a constraint that allows only tokens outside
        # the draft vocabulary) ends the chain before it: a stopping time of the head's own
        # laws, so exact; the row goes on (the target's law draws the next token).
        lp = drawn["logprobs_BKDV"]
        empty = ~jnp.any(lp > -jnp.inf, axis=-1) & drawn["finite_BKD"]
        first_empty = jnp.where(jnp.any(empty, -1), jnp.argmax(empty, -1), empty.shape[-1])
        drawn["usable_BK"] = jnp.minimum(drawn["usable_BK"], first_empty.astype(jnp.int32))
        drawn["ok_BKD"] = drawn["ok_BKD"] | empty
        after = dataclasses.replace(own, cache=dataclasses.replace(cache, lengths=base_R))
        return Proposal(**drawn, state=after)

    def commit(self, dec, before, after, winner_B, num_B):
        return after  # the rollout's slots past the committed ones are overwritten next step

    def take(self, dec, state, features_BTF, tokens_BT, num_B):
        """The accepted path's target features (slot j: the path's node j) and the emitted
        tokens (slot j: the token after it) become the pending entries."""
        return dataclasses.replace(
            state,
            features=features_BTF.astype(state.features.dtype),
            tokens=jnp.maximum(tokens_BT, 0).astype(jnp.int32),
            count=num_B.astype(jnp.int32),
            placeholder=jnp.zeros_like(state.placeholder),
        )


_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def head_for(target, spec: str) -> Head:
    """The head that ``draft="eagle3:PATH"`` names for ``target`` (loaded once per target and
    path; a bundled alias is a folder under ``models/``)."""
    return load_named(target, spec, PREFIX, _HEADS, load_head, "head")


def drafter(head: Head, target, *, mesh=None, confidence_stop: bool = False) -> EagleHead:
    """The drafter of a loaded head, checked against ``target``."""
    if confidence_stop:
        raise ValueError("draft_stop: the confidence stop is an option of a draft model's rollout")
    check_matches(head.config, target, f"draft={head.name!r}")
    return EagleHead(head.config, where=f"draft={head.name!r}")


__all__ = [
    "CONFIG_FILE",
    "PREFIX",
    "WEIGHTS_FILE",
    "check_matches",
    "EagleHead",
    "Head",
    "HeadConfig",
    "HeadState",
    "default_feature_layers",
    "drafter",
    "forward",
    "fuse",
    "head_for",
    "init_params",
    "load_head",
    "param_shapes",
    "save_head",
    "target_logits",
    "trainable",
]
