"""A parallel block drafter (``draft="block:PATH"``): one forward gives the laws of all n draft
positions, from the target's own features; exact under every verifier with sampled drafts.

The model (:mod:`~asps_jax.drafters.block_model`) reads the target's fused features over the
committed prefix (its own small KV cache, one entry per committed position), the embedding of the
bonus token (the step's root) and ``N`` learned mask embeddings, and returns ``N`` logits at once;
the step's draft of depth ``n <= N`` uses the first n. Drafting is then a rollout with no
decoder layer in it: depth i's law is the readout of position i
(:mod:`~asps_jax.drafters.block_readout`; the position-wise one: its logits alone, the recurrent
one: a small map of its state, the parent node's token and the parent's readout state, per chain)
placed on the target's vocabulary (probability 0 outside the draft vocabulary ``d2t``), processed
like every drafter's (:func:`~asps_jax.drafters.model.rollout_proposal`: temperature, top-k /
top-p, every control and constraint on each chain's own path), and its token drawn from it. A
branching tree's siblings share their parent's processed law (drawn without replacement under
``tv``, independently otherwise), exactly as for a draft model. docs/algorithms.md says why every
verifier stays exact.

State. The target's scoring pass returns the feature layers' streams at every scored node; after
verification the accepted path's features (the root's and the accepted draft tokens') are the
drafter's *pending* entries (:meth:`BlockDrafter.take`); the next proposal first writes their keys
/ values into the cache (projections only: the context never runs through the layers), then runs
the block. Prefill writes the prompt's committed positions. The cache has one row per batch row
(the block is recomputed every step, never cached), so K chains cost no replicas.
"""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax import footprint, kv_cache
from asps_jax.drafters import block_layouts, peagle
from asps_jax.drafters import block_model as bm
from asps_jax.drafters import block_readout as br
from asps_jax.drafters.base import Drafter, Proposal, load_named
from asps_jax.drafters.model import rollout_proposal
from asps_jax.models.base import Model
from asps_jax.models.eagle3 import target_logits

PREFIX = "block:"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockState:
    """The drafter's state between steps (a pytree).

    Attributes:
      cache: the context's keys / values, one row per batch row, its lengths the committed
        positions written.
      features: float[B, n + 1, F], the pending entries' target features (F = 3 * E_t).
      count: int32[B], the pending entries (written at the next proposal).
      last: float[B, F], the features of the last position written (zeros before any).
    """

    cache: kv_cache.KVCache
    features: jax.Array
    count: jax.Array
    last: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class Block(Model):
    """A loaded block drafter as the draft :class:`~asps_jax.models.Model` (``params`` are its
    own; ``config`` a :class:`~asps_jax.drafters.block_model.BlockConfig`)."""


def _pick(keep_B, new, old):
    """``new`` where ``keep_B`` (bool[B]) along the rows axis (the first, or the second of a
    stacked ``[L, B, ...]`` cache array; a per-layer cache's ``[B, ...]`` arrays: the first),
    else ``old``."""
    axis = 1 if new.ndim == 5 else 0
    shape = [1] * new.ndim
    shape[axis] = keep_B.shape[0]
    return jnp.where(keep_B.reshape(shape), new, old)


def _last(features_BTF, count_B, old_BF):
    """The features of entry ``count - 1`` of each row (``old`` where ``count`` is 0)."""
    at = jnp.maximum(count_B - 1, 0)[:, None, None]
    new = jnp.take_along_axis(features_BTF, at, axis=1)[:, 0].astype(old_BF.dtype)
    return jnp.where((count_B > 0)[:, None], new, old_BF)


@dataclasses.dataclass(frozen=True)
class BlockDrafter(Drafter):
    """The drafter of a block model (``draft="block:PATH"``); see the module docstring."""

    config: bm.BlockConfig

    @property
    def name(self) -> str:
        return "block"

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers

    def check(self, target, spec) -> None:
        if spec.num_draft_tokens > self.config.block_size:
            raise ValueError(
                f"num_draft_tokens={spec.num_draft_tokens}: the block drafter drafts at most "
                f"{self.config.block_size} positions (its block size); use "
                f"num_draft_tokens <= {self.config.block_size}"
            )

    def context(self) -> int | None:
        return self.config.max_position_embeddings

    def default_draft_len(self) -> int | None:
        return self.config.block_size

    def footprint(self, sizes) -> dict[str, int]:
        c = self.config
        itemsize, n = sizes.draft_itemsize, c.block_size + 1
        kv_slot = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
        width = len(c.feature_layers) * c.target_hidden_size
        pending = sizes.rows * (sizes.depth + 1) * width * footprint.F32
        d = dict(heads=c.num_attention_heads, width=4 * c.hidden_size + 3 * c.intermediate_size,
                 kv_slot=kv_slot)  # fmt: skip
        block = footprint.forward_bytes(d, sizes.rows, n, sizes.slots, itemsize)
        prompt = sizes.rows * sizes.prompt * (width + kv_slot) * footprint.F32
        laws = 3 * footprint.F32 * sizes.rows * sizes.depth * sizes.vocab
        return {
            "kv caches": sizes.rows * sizes.slots * kv_slot * itemsize + pending,
            "draft rollout": max(block, prompt) + laws,
            "laws": footprint.rollout_law_bytes(sizes),
        }

    def _empty(self, dec, params, batch: int) -> BlockState:
        c, n = self.config, dec.spec.num_draft_tokens
        width = len(c.feature_layers) * c.target_hidden_size
        per = kv_cache.per_layer_params(params)  # the run layout's cache: a buffer per layer
        return BlockState(
            cache=kv_cache.init_cache(c, batch, dec.cache_len, bm.dtype_of(params), per_layer=per),
            features=jnp.zeros((batch, n + 1, width), params["fc"].dtype),
            count=jnp.zeros((batch,), jnp.int32),
            last=jnp.zeros((batch, width), params["fc"].dtype),
        )

    def init(self, dec, params, batch: int):
        return self._empty(dec, params, batch)

    def _write(self, dec, params, cache, features_BTF, count_B):
        """The cache with the first ``count_B`` of ``features_BTF`` written at its lengths."""
        B, T = features_BTF.shape[:2]
        positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        new_kv = bm.context_kv(self.config, params, features_BTF, positions)
        nodes = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        row_loop = kv_cache.row_loop_for(dec.mesh)
        return kv_cache.commit(cache, new_kv, nodes, count_B, row_loop=row_loop)

    def prefill(self, dec, params, state, prompts_BP, committed_B, features=None):
        """The prompt's committed positions into the cache (the root, at position
        ``committed``, is the first proposal's bonus token)."""
        state = self._empty(dec, params, prompts_BP.shape[0])
        committed_B = committed_B.astype(jnp.int32)
        cache = self._write(dec, params, state.cache, features, committed_B)
        return dataclasses.replace(
            state, cache=cache, last=_last(features, committed_B, state.last)
        )

    def refill(self, dec, params, state, take_B, prompts_BP, committed_B, features=None):
        fresh = self.prefill(dec, params, state, prompts_BP, committed_B, features)
        new, old = fresh.cache, state.cache
        cache = kv_cache.KVCache(
            k=jax.tree.map(lambda a, b: _pick(take_B, a, b), new.k, old.k),
            v=jax.tree.map(lambda a, b: _pick(take_B, a, b), new.v, old.v),
            lengths=jnp.where(take_B, new.lengths, old.lengths),
        )
        return BlockState(
            cache=cache,
            features=_pick(take_B, fresh.features, state.features),
            count=jnp.where(take_B, fresh.count, state.count),
            last=_pick(take_B, fresh.last, state.last),
        )

    def block_hidden(self, dec, params, own, root_B):
        """``(state, h [B, n, E])``: the pending entries written, then the block of ``root_B``
        (each row's bonus token) over them: its first n output states."""
        c, n = self.config, dec.spec.num_draft_tokens
        cache = self._write(dec, params, own.cache, own.features, own.count)
        last = _last(own.features, own.count, own.last)
        S = cache.max_len
        valid_B1S = (jnp.arange(S, dtype=jnp.int32)[None, :] < cache.lengths[:, None])[:, None]
        last_B1E = bm.context(c, params, last[:, None])
        h = bm.hidden(
            c, params, cache.k, cache.v, valid_B1S, last_B1E, root_B[:, None],
            cache.lengths[:, None],
        )  # fmt: skip
        after = BlockState(cache, own.features, jnp.zeros_like(own.count), last)
        return after, h[:, 0, :n]

    def _feed(self, params, h_BnE, k: int):
        """The rollout's feed: depth's logits on the target's vocabulary, float32[R, 1, V]
        (position-wise: the block's own, for every chain; recurrent: one readout step of each
        chain's parent token and readout state, the feed's carry)."""
        c = self.config
        if c.readout != "recurrent":
            laws_RnV = jnp.repeat(
                target_logits(params, br.head(c, params, h_BnE), c.vocab_size), k, 0
            )

            def feed(carry, token_R, depth):  # depth's logits of the one block
                del token_R
                return carry, jax.lax.dynamic_slice_in_dim(laws_RnV, depth, 1, axis=1)

            return feed, None
        h_RnE = jnp.repeat(h_BnE, k, axis=0)

        def feed(prev_RE, token_R, depth):  # one readout step on each chain's own path
            h_RE = jax.lax.dynamic_index_in_dim(h_RnE, depth, axis=1, keepdims=False)
            out_RE, logits_RD = br.step(c, params, h_RE, token_R, prev_RE)
            return out_RE, target_logits(params, logits_RD[:, None], c.vocab_size)

        return feed, jnp.zeros_like(h_RnE[:, 0])

    def propose(self, dec, params, sampling, state) -> Proposal:
        k = dec.spec.tree.num_chains
        after, h_BnE = self.block_hidden(dec, params, state.draft, state.root.astype(jnp.int32))
        feed, carry = self._feed(params, h_BnE, k)
        _, drawn = rollout_proposal(dec, sampling, state, feed, carry, store_last=False)
        # A law with no mass and no NaN (a constraint that allows only tokens outside the draft
        # vocabulary) ends the chain before it: a stopping time of the drafter's own laws, so
        # exact; the row goes on (the target's law draws the next token).
        lp = drawn["logprobs_BKDV"]
        empty = ~jnp.any(lp > -jnp.inf, axis=-1) & ~jnp.any(jnp.isnan(lp), axis=-1)
        first_empty = jnp.where(jnp.any(empty, -1), jnp.argmax(empty, -1), empty.shape[-1])
        drawn["usable_BK"] = jnp.minimum(drawn["usable_BK"], first_empty.astype(jnp.int32))
        drawn["ok_BKD"] = drawn["ok_BKD"] | empty
        return Proposal(**drawn, state=after)

    def commit(self, dec, before, after, winner_B, num_B):
        return after  # the context grows by the accepted path's features (take)

    def take(self, dec, state, features_BTF, tokens_BT, num_B):
        """The accepted path's target features (slot j: the path's node j, the root first)
        become the pending entries."""
        return dataclasses.replace(
            state, features=features_BTF.astype(state.features.dtype), count=num_B.astype(jnp.int32)
        )


# --- Loading ----------------------------------------------------------------------------------

_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def load_block(path, target, *, dtype=jnp.float32) -> Block:
    """The block drafter in folder ``path`` for ``target`` (one-line errors for a missing or
    corrupt file, a missing tensor, a wrong shape, or a drafter made for another target); its
    weights in ``dtype`` (float32: it is small, and XLA:CPU has no bfloat16 dot of its shapes)."""
    folder = Path(path)
    where = f"draft={PREFIX}{path}"
    published = block_layouts.read(folder, target, np.dtype(dtype), where)
    if published is not None:  # a DFlash or P-EAGLE folder (drafters/block_layouts.py)
        c, params = published
        return Block(name=f"{PREFIX}{path}", path=str(folder), config=c, params=params,
                     tokenizer=target.tokenizer)  # fmt: skip
    c = bm.read_config(folder, target.config, where)
    bm.check_matches(c, target, where)
    want = np.dtype(dtype)
    params, embed = bm.read_params(folder, c, want, where)
    target_embed = target.params["embed"]
    if embed is None:
        embed = target_embed
    elif tuple(embed.shape) != tuple(target_embed.shape):
        raise ValueError(
            f"{where}: tensor 'embed_tokens.weight' has shape {list(embed.shape)}, the "
            f"target's embedding {list(target_embed.shape)}"
        )
    params["embed"] = jnp.asarray(np.asarray(embed, np.float32), want)
    params["d2t"] = jnp.asarray(params["d2t"], jnp.int32)
    return Block(
        name=f"{PREFIX}{path}",
        path=str(folder),
        config=c,
        params=params,
        tokenizer=target.tokenizer,
    )


def block_for(target, spec: str) -> Block:
    """The drafter that ``draft="block:PATH"`` names for ``target`` (loaded once per target and
    path; a bundled alias is a folder under ``models/``)."""
    return load_named(target, spec, PREFIX, _BLOCKS, load_block, "drafter")


def drafter(block: Block, target, *, mesh=None, confidence_stop: bool = False) -> BlockDrafter:
    """The drafter of a loaded block model, checked against ``target``."""
    if confidence_stop:
        raise ValueError("draft_stop: the confidence stop is an option of a draft model's rollout")
    bm.check_matches(block.config, target, f"draft={block.name!r}")
    if isinstance(block.config, peagle.PEagleConfig):  # a P-EAGLE folder (block_layouts.py)
        return peagle.PEagleDrafter(block.config, where=f"draft={block.name!r}")
    return BlockDrafter(block.config)


__all__ = ["PREFIX", "Block", "BlockDrafter", "BlockState", "block_for", "drafter", "load_block"]
