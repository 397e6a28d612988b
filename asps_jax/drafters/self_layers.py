"""Self-drafting (``draft="self:L"``): the target's first ``L`` layers, its final norm and its head
as the draft model, drafting from the target's own KV cache.

The draft model (:func:`self_draft`) is a :class:`SelfDraft`: the target's config cut to ``L``
layers (``config.first_layers``, :class:`~asps_jax.models.base.FirstLayers`) and the target's
run-layout parameters with their first ``L`` layers (:func:`truncate_params`). In the per-layer
run layout (Llama and the ``decoder.py`` families on one CPU device) those are the target's own
buffers, nothing is copied; in a stacked layout (GPT-2, OPT, GPT-Neo, and every family on an
accelerator, ``base.scan_layout_for``) the first ``L`` layers are a copy
(``L / num_layers`` of the layer weights), the embedding, final norm and head are shared either
way. Its law is a proper law computed from the committed text and the chain's own tokens, so every
verification method stays exact with it, as with any draft model.

Cache sharing (:class:`SharedLayers`). Layer ``i``'s keys and values of a token depend only on
layers ``< i``, so for every committed token the draft's K/V of layers ``0 .. L-1`` *are* the
target's (the same weights on the same text). The draft then keeps no cache of its own: each
rollout step (:func:`shared_feed`) reads layers ``< L`` of the target cache for the committed
prefix (slots ``< lengths[b]``) and writes its own rollout tokens into a per-step scratch of
``n * K`` slots past each row's committed length, in the same cache (those slots are stale by the
cache's invariant, never read by the target, and overwritten by the commit of the accepted path).
Chain ``k``'s token at depth ``j`` sits at slot ``lengths[b] + j * K + k``, at position
``lengths[b] + j``; a chain sees the committed slots and its own earlier scratch slots. So nothing
of the prefix is stored twice, the draft needs no prefill, and the rollout skips the last feed (the
target commits the accepted tokens itself). The target cache is ``n * K`` slots longer
(:meth:`SharedLayers.cache_slots`).

A config with an attention window among its first ``L`` layers (``config.has_window()``:
Mistral-7B-v0.1, Gemma 2 / 3, GPT-Neo's local layers) reads key positions from slot indices, so
its draft keeps a cache of its own (:class:`~asps_jax.drafters.model.ModelDraft`); the law is the
same either way (``tests/test_self_draft.py``).
"""

from __future__ import annotations

import dataclasses
import weakref

import jax
import jax.numpy as jnp

from asps_jax import footprint, kv_cache
from asps_jax.drafters.base import Proposal
from asps_jax.drafters.model import ModelDraft, rollout_proposal
from asps_jax.models import forward_for
from asps_jax.models.base import FirstLayers, Model, prepare_params

PREFIX = "self:"


@dataclasses.dataclass(frozen=True, eq=False)
class SelfDraft(Model):
    """The draft model of ``draft="self:L"``: a :class:`~asps_jax.models.Model` whose config is
    the target's cut to ``num_layers`` layers and whose params are views of the target's."""

    num_layers: int = 0
    source: weakref.ref | None = None  # the target (weak: the target keys its drafts)

    def view_of_placed(self, place):
        """Its parameters on a mesh: the target's as ``place(target)`` placed them, cut to the
        first layers the same way (:func:`asps_jax.sharding.place_model_params`)."""
        return truncate_params(place(self.source()), self.num_layers)


def parse_layers(spec: str, num_layers: int) -> int:
    """``L`` of ``"self:L"``; a one-line error naming ``draft`` unless ``0 < L < num_layers``."""
    text = spec[len(PREFIX) :]
    try:
        layers = int(text, 10)
    except ValueError:
        layers = None
    if num_layers < 2:
        raise ValueError(
            f"draft={spec!r}: self-drafting takes fewer layers than the target has, and the "
            f"target has {num_layers}; give a draft model or draft='lookup'"
        )
    if layers is None or not 0 < layers < num_layers:
        raise ValueError(
            f"draft={spec!r}: self-drafting takes the target's first L layers, an integer "
            f"with 0 < L < {num_layers} (the target's layers), e.g. "
            f"'self:{max(num_layers // 4, 1)}'"
        )
    return layers


def truncate_config(config, layers: int):
    """``config`` with its first ``layers`` layers (its per-layer fields cut to match)."""
    if not isinstance(config, FirstLayers):
        raise ValueError(
            f"draft='self:{layers}': self-drafting needs a model family whose layers can be cut "
            f"(Llama, Qwen2/3, Mistral, Gemma 2/3, GPT-2, OPT, GPT-Neo); got "
            f"{type(config).__name__}"
        )
    return config.first_layers(layers)


def truncate_params(params: dict, layers: int) -> dict:
    """The first ``layers`` layers of ``params`` and everything else as it is: the same buffers
    for a per-layer run layout (a tuple of layer dicts), a slice (a copy) of each stacked array."""
    stack = params["layers"]
    if isinstance(stack, (tuple, list)):
        return {**params, "layers": tuple(stack[:layers])}
    return {**params, "layers": jax.tree.map(lambda a: a[:layers], stack)}


# One draft per (target, L): its run layout and compiled programs are cached per Model object.
_DRAFTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def self_draft(target: Model, spec: str) -> SelfDraft:
    """The draft model of ``draft="self:L"`` for ``target`` (one object per target and L)."""
    layers = parse_layers(spec, target.config.num_hidden_layers)
    config = truncate_config(target.config, layers)
    per_target = _DRAFTS.setdefault(target, {})
    if layers not in per_target:
        per_target[layers] = SelfDraft(
            name=f"{target.name}[{PREFIX}{layers}]",
            path=target.path,
            config=config,
            # Its own one-row run layout of its first layers only (the target's loop runs on
            # the wide one, sampler.wide_layouts); the embedding, head and norm are the target's.
            params=prepare_params(config, truncate_params(target.params, layers)),
            tokenizer=target.tokenizer,
            num_layers=layers,
            source=weakref.ref(target),
        )
    return per_target[layers]


def can_share_cache(config) -> bool:
    """Whether the draft of cut ``config`` can read the target's cache (:func:`shared_feed`): no
    attention window among its layers (a window derives key positions from slot indices, which
    the scratch layout does not keep)."""
    return isinstance(config, FirstLayers) and not config.has_window()


def drafter(model: SelfDraft, *, mesh=None, confidence_stop: bool = False):
    """The drafter of a self-draft: :class:`SharedLayers` when its layers can read the target's
    cache, else a :class:`~asps_jax.drafters.model.ModelDraft` of its own cache."""
    if not can_share_cache(model.config):
        return ModelDraft(model.config, confidence_stop=confidence_stop)
    if confidence_stop:
        raise ValueError(
            "draft_stop: confidence-stopped chains need the draft's own cache; draft='self:L' "
            "shares the target's (drop draft_stop)"
        )
    return SharedLayers(model.config)


@dataclasses.dataclass(frozen=True)
class SharedLayers(ModelDraft):
    """The target's first ``config.num_hidden_layers`` layers over the target's own cache: no
    state of its own; each step's rollout is scratch in the target cache."""

    @property
    def name(self) -> str:
        return f"{PREFIX}{self.config.num_hidden_layers}"

    def cache_slots(self, num_draft_tokens: int, num_chains: int) -> int:
        return num_draft_tokens * num_chains

    def footprint(self, sizes) -> dict[str, int]:
        # K queries per row over the target cache's first layers; no prefill, no cache.
        d = footprint.model_sizes(self.config)
        step_laws = 3 * footprint.F32 * sizes.rows * sizes.replicas * sizes.vocab
        rollout_bytes = footprint.forward_bytes(
            d, sizes.rows, sizes.replicas, sizes.slots, sizes.draft_itemsize
        )
        return {
            "draft rollout": rollout_bytes + step_laws,
            "laws": footprint.rollout_law_bytes(sizes),
        }

    def init(self, dec, params, batch: int):
        return None

    def prefill(self, dec, params, state, prompts_BP, committed_B):
        return None

    def refill(self, dec, params, state, take_B, prompts_BP, committed_B):
        return None

    def propose(self, dec, params, sampling, state) -> Proposal:
        layers, row_loop = self.config.num_hidden_layers, kv_cache.row_loop_for(dec.mesh, state)
        forward = forward_for(self.config)

        def feed(cache, token_R, depth):
            logits_R1V, cache = shared_feed(
                forward, params, cache, token_R, depth, layers, row_loop
            )
            return cache, logits_R1V

        cache, drawn = rollout_proposal(
            dec, sampling, state, feed, state.target_cache, store_last=False
        )
        return Proposal(**drawn, target_cache=cache)

    def commit(self, dec, before, after, winner_B, num_B):
        return None  # the scratch past the committed slots is stale now


def _first(a, layers: int):
    return a[:layers]


def _put(a, first):
    """``a`` with its first layers replaced by ``first`` (a tuple, or a stacked array)."""
    if isinstance(a, tuple):
        return tuple(first) + a[len(first) :]
    return jax.lax.dynamic_update_slice_in_dim(a, first, 0, axis=0)


def shared_feed(forward, params, cache: kv_cache.KVCache, token_R, depth, layers: int, row_loop):
    """One rollout step of ``R = B * K`` chains over the *target* cache (batch B).

    Feeds each chain's token at depth ``depth`` (position ``lengths[b] + depth``) through the
    draft forward (``layers`` layers) reading layers ``< layers`` of ``cache``: the committed
    slots ``< lengths[b]`` and the chain's own scratch slots ``lengths[b] + j * K + k``,
    ``j < depth``; writes this token's keys/values at ``lengths[b] + depth * K + k``.

    Returns ``(logits float32[R, 1, V], cache)`` with ``cache.lengths`` unchanged.
    """
    batch = cache.lengths.shape[0]
    chains = token_R.shape[0] // batch
    slots = cache.max_len
    base_B = cache.lengths.astype(jnp.int32)
    rel_BS = jnp.arange(slots, dtype=jnp.int32)[None, :] - base_B[:, None]
    chain_K = jnp.arange(chains, dtype=jnp.int32)
    own_BKS = (
        (rel_BS[:, None, :] >= 0)
        & (rel_BS[:, None, :] < depth * chains)
        & (rel_BS[:, None, :] % chains == chain_K[None, :, None])
    )
    mask_BKS = (rel_BS[:, None, :] < 0) | own_BKS
    eye_BKK = jnp.broadcast_to(jnp.eye(chains, dtype=bool), (batch, chains, chains))
    mask = jnp.concatenate([mask_BKS, eye_BKK], axis=-1)
    positions_BK = jnp.broadcast_to(base_B[:, None] + depth, (batch, chains)).astype(jnp.int32)
    view = kv_cache.KVCache(
        k=_first(cache.k, layers), v=_first(cache.v, layers), lengths=base_B + depth * chains
    )
    out = forward(params, token_R.reshape(batch, chains), positions_BK, mask, view)
    logits_BKV, new_kv = out.logits, out.kv
    nodes_BK = jnp.broadcast_to(chain_K, (batch, chains))
    written = kv_cache.commit(
        view, new_kv, nodes_BK, jnp.full((batch,), chains, jnp.int32), row_loop=row_loop
    )
    cache = kv_cache.KVCache(
        k=_put(cache.k, written.k), v=_put(cache.v, written.v), lengths=cache.lengths
    )
    return logits_BKV.reshape(batch * chains, 1, -1), cache
