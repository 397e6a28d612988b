"""A learned head on the target's own features (``draft="eagle3:PATH"``): EAGLE-3's one decoder
layer, drafting from the target's hidden states, exact under every verifier.

The head (Li et al. 2025, EAGLE-3) reads, at position t, the target's residual stream entering
three of its layers (a low, a middle and a high one: ``HeadConfig.feature_layers``) fused by
``fc`` into one hidden vector, and the embedding of token t + 1. One Llama decoder layer whose
attention reads both (``[input_norm(embed); hidden_norm(hidden)]``, 2E wide) and keeps its own
small KV cache over the committed text; its output hidden vector, through ``norm`` and its own
``lm_head`` over a draft vocabulary of ``V_d <= V`` tokens (``d2t`` maps each to its target id),
gives the law of token t + 2. Drafting deeper, the head feeds its own output hidden vector in
place of the target's features (as it was trained: :mod:`asps_jax.drafters.train`).

Exactness: the draft law is the softmax of those logits placed on the target's vocabulary
(probability 0 outside the draft vocabulary: the residual covers those tokens), then processed
like every drafter's (:func:`asps_jax.controls.penalties.process`: temperature, every control and
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

Checkpoints are in the EAGLE-3 layout (SpecForge, the EAGLE repository, vLLM and SGLang read
it): ``config.json`` with ``"architectures": ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``
and ``eagle_config.eagle_aux_hidden_state_layer_ids``, and ``model.safetensors`` with ``fc``,
``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` (offsets: target id = draft id + ``d2t[id]``),
``t2d`` and optionally ``embed_tokens`` (else the target's embedding is used); a head's files are
checked field by field and tensor by tensor (:mod:`asps_jax.drafters.head_checks`).
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax import footprint, kv_cache, scoring
from asps_jax.drafters import head_axes, head_checks
from asps_jax.drafters.base import Drafter, Proposal, load_named
from asps_jax.drafters.model import rollout_proposal
from asps_jax.models import loader
from asps_jax.models.base import Model
from asps_jax.models.layers import attention, rms_norm
from asps_jax.models.rope import RopeScaling, apply_rope, rope_tables

PREFIX = "eagle3:"
ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """The head's static sizes (hashable: a field of the drafter, static under jit).

    ``hidden_size`` E is the head's (EAGLE-3 heads use the target's); ``target_hidden_size`` the
    target's (``fc`` maps ``3 * target_hidden_size`` to E); ``vocab_size`` V the target's and
    ``draft_vocab_size`` V_d the head's own; ``feature_layers`` the target layers whose input
    streams it reads (Hugging Face's ``hidden_states[i]``).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    num_hidden_layers: int = 1  # the head's cache has one layer (kv_cache reads this)

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int | None = None, layers=None):
        """A head for ``target_config`` (any family: the head is a Llama layer of the target's
        width, heads and MLP size; RoPE and RMS norm settings the target's where it has them),
        the default feature layers (:func:`default_feature_layers`) and ``V_d`` (default: V)."""
        c = target_config
        heads = c.num_attention_heads
        ffn = getattr(c, "intermediate_size", None) or getattr(c, "ffn_dim", None)
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=ffn or 4 * c.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", heads),
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size or c.vocab_size,
            target_hidden_size=c.hidden_size,
            feature_layers=tuple(layers or default_feature_layers(c.num_hidden_layers)),
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
            rope_theta=getattr(c, "rope_theta", 10000.0),
            rope_scaling=getattr(c, "rope_scaling", None),
            max_position_embeddings=c.max_position_embeddings,
        )

    @classmethod
    def from_hf(cls, d: dict, target_config, where: str = "config.json") -> HeadConfig:
        """From an EAGLE-3 ``config.json`` (SpecForge / EAGLE layout) for ``target_config``, its
        fields checked (:func:`asps_jax.drafters.head_checks.config_fields`)."""
        fields = head_checks.config_fields(d, where)
        layers = fields.pop("feature_layers")
        layers = layers or default_feature_layers(target_config.num_hidden_layers)
        return cls(**fields, feature_layers=layers)

    def to_hf(self) -> dict:
        """The ``config.json`` of this head in the EAGLE-3 layout."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.feature_layers)},
        }


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers: ``(2, L // 2, L - 3)`` (vLLM and SpecForge's
    default); a target of fewer than 8 layers gets ``(1, L // 2, L - 1)``."""
    if num_layers >= 8:
        return (2, num_layers // 2, num_layers - 3)
    return (min(1, num_layers - 1), num_layers // 2, max(num_layers - 1, 0))


# --- Parameters -------------------------------------------------------------------------------

# Our name -> the EAGLE-3 checkpoint's (HF nn.Linear orientation [out, in], kept as is).
TENSORS = {
    "fc": "fc.weight",
    "input_norm": "midlayer.input_layernorm.weight",
    "hidden_norm": "midlayer.hidden_norm.weight",
    "wq": "midlayer.self_attn.q_proj.weight",
    "wk": "midlayer.self_attn.k_proj.weight",
    "wv": "midlayer.self_attn.v_proj.weight",
    "wo": "midlayer.self_attn.o_proj.weight",
    "post_norm": "midlayer.post_attention_layernorm.weight",
    "w_gate": "midlayer.mlp.gate_proj.weight",
    "w_up": "midlayer.mlp.up_proj.weight",
    "w_down": "midlayer.mlp.down_proj.weight",
    "norm": "norm.weight",
    "lm_head": "lm_head.weight",
}


def param_shapes(c: HeadConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every learned parameter (``embed`` and ``d2t`` come with the head)."""
    E, F, NH, KVH, H = (
        c.hidden_size,
        c.intermediate_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
    )
    return {
        "fc": (E, len(c.feature_layers) * c.target_hidden_size),
        "input_norm": (E,),
        "hidden_norm": (E,),
        "wq": (NH * H, 2 * E),
        "wk": (KVH * H, 2 * E),
        "wv": (KVH * H, 2 * E),
        "wo": (E, NH * H),
        "post_norm": (E,),
        "w_gate": (F, E),
        "w_up": (F, E),
        "w_down": (E, F),
        "norm": (E,),
        "lm_head": (c.draft_vocab_size, E),
    }


def init_params(c: HeadConfig, key, embed, d2t, std: float = 0.02, dtype=jnp.float32) -> dict:
    """Random weights (:func:`random_params` of :func:`param_shapes`)."""
    return random_params(param_shapes(c), key, embed, d2t, std, dtype)


def random_params(shapes: dict, key, embed, d2t, std: float = 0.02, dtype=jnp.float32) -> dict:
    """Weights of ``shapes`` ~ N(0, std), norm scales 1, with the target's ``embed [V, E]`` and
    ``d2t`` (int32[V_d], the target id of each draft id); the block drafter's too."""
    keys = jax.random.split(key, len(shapes))
    params = {
        name: jnp.ones(shape, dtype)
        if name.endswith("norm")
        else (std * jax.random.normal(k, shape)).astype(dtype)
        for k, (name, shape) in zip(keys, shapes.items())
    }
    return dict(params, embed=jnp.asarray(embed), d2t=jnp.asarray(d2t, jnp.int32))


def trainable(params: dict) -> dict:
    """The learned parameters (everything but the target's embedding and the vocabulary map)."""
    return {k: v for k, v in params.items() if k not in ("embed", "d2t")}


# --- Forward ----------------------------------------------------------------------------------


def fuse(params: dict, features_BTF) -> jax.Array:
    """``fc``: the target's concatenated features ``[B, T, 3 * E_t]`` -> ``[B, T, E]``."""
    w = params["fc"]
    return jnp.einsum("btf,ef->bte", features_BTF.astype(w.dtype), w)


def forward(c: HeadConfig, params: dict, hidden_BTE, tokens_BT, positions_BT, mask, cache):
    """One head layer over T entries: ``(draft logits float32[B, T, V_d], hidden out [B, T, E],
    new_kv [1, B, T, KVH, H])``.

    Entry t reads ``hidden_BTE[:, t]`` (the fused target features, or the head's own output of
    the previous depth) and the embedding of ``tokens_BT[:, t]``; ``mask`` is ``bool[B, T, S + T]``
    over the head's cache (``cache``, may be None with a ``[B, T, T]`` mask) and the new entries.
    """
    B, T = tokens_BT.shape
    NH, KVH, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    dtype = params["wq"].dtype
    hidden = hidden_BTE.astype(dtype)
    embeds = params["embed"][tokens_BT].astype(dtype)
    x = jnp.concatenate(
        [
            rms_norm(embeds, params["input_norm"], c.rms_norm_eps),
            rms_norm(hidden, params["hidden_norm"], c.rms_norm_eps),
        ],
        axis=-1,
    )

    def proj(h, name):
        return jnp.einsum("bti,oi->bto", h, params[name])

    cos, sin = rope_tables(c.rope_theta, H, c.rope_scaling, c.max_position_embeddings, positions_BT)
    q = apply_rope(proj(x, "wq").reshape(B, T, NH, H), cos, sin)
    k = apply_rope(proj(x, "wk").reshape(B, T, KVH, H), cos, sin)
    v = proj(x, "wv").reshape(B, T, KVH, H)
    cache_kv = (None, None) if cache is None else cache.layer(0)
    attn = attention(q, k, v, *cache_kv, mask, H**-0.5)
    hidden = hidden + proj(attn.reshape(B, T, NH * H), "wo")
    h = rms_norm(hidden, params["post_norm"], c.rms_norm_eps)
    hidden = hidden + proj(jax.nn.silu(proj(h, "w_gate")) * proj(h, "w_up"), "w_down")
    out = rms_norm(hidden, params["norm"], c.rms_norm_eps)
    logits = jnp.einsum("bte,ve->btv", out, params["lm_head"], preferred_element_type=jnp.float32)
    return logits.astype(jnp.float32), hidden, kv_cache.KVBlock(k=k[None], v=v[None])


def target_logits(params: dict, logits_BTD, vocab_size: int) -> jax.Array:
    """The draft logits placed on the target's vocabulary: ``-inf`` (probability 0) at every
    token outside the draft vocabulary, ``float32[B, T, V]``."""
    full = jnp.full(logits_BTD.shape[:-1] + (vocab_size,), -jnp.inf, jnp.float32)
    return full.at[..., params["d2t"]].set(logits_BTD)


# The family the models' helpers look up (``models.base.family_for_config``): no run layout.
HeadConfig.FAMILY = head_axes.family(forward, param_shapes)


# --- The drafter ------------------------------------------------------------------------------


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


@dataclasses.dataclass(frozen=True, eq=False)
class Head(Model):
    """A loaded head as the draft :class:`~asps_jax.models.Model` (``params`` are the head's;
    ``config`` a :class:`HeadConfig`)."""


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
    logits, hidden, new_kv = forward(
        c, params, hidden_RTE, tokens_RT, positions_RT, _mask(cache, valid_RT), cache
    )
    nodes = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (R, T))
    return kv_cache.commit(cache, new_kv, nodes, count_R), logits, hidden


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


# --- Checkpoints ------------------------------------------------------------------------------

_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tensors(folder: Path, where: str) -> dict[str, np.ndarray]:
    """Every tensor of the head's weight files (safetensors, sharded or not, or a PyTorch
    ``.bin``: ``models.loader``'s readers, any dtype), names without a ``model.`` prefix."""
    try:
        return {name.removeprefix("model."): a for name, a in loader.iter_tensors(folder)}
    except loader.CheckpointError as e:
        raise ValueError(f"{where}: {e}") from None


def check_matches(c, target, where: str, noun: str = "head", kind: str = "a learned head") -> None:
    """A one-line error unless the ``noun`` of config ``c`` (a head, or the block drafter's
    config: the same fields) fits ``target`` (feature width, layers, vocab)."""
    t = target.config
    if not hasattr(t, "hidden_size") or not hasattr(t, "num_hidden_layers"):
        raise ValueError(f"{where}: {kind} needs a decoder target, got {type(t).__name__}")
    if c.target_hidden_size != t.hidden_size:
        raise ValueError(
            f"{where}: the {noun} reads features of width {c.target_hidden_size}, the target "
            f"{target.name!r} has hidden size {t.hidden_size}; it was trained for another target"
        )
    if c.vocab_size != t.vocab_size:
        raise ValueError(
            f"{where}: the {noun} maps to a vocabulary of {c.vocab_size} tokens, the target "
            f"{target.name!r} has {t.vocab_size}; it was trained for another target"
        )
    if any(not 0 <= i < t.num_hidden_layers for i in c.feature_layers):
        raise ValueError(
            f"{where}: the {noun} reads target layers {list(c.feature_layers)}, the target has "
            f"{t.num_hidden_layers} (ids 0 .. {t.num_hidden_layers - 1})"
        )


def load_head(path, target, *, dtype=None) -> Head:
    """The EAGLE-3-layout head in folder ``path`` for ``target`` (one-line errors for a missing
    or corrupt file, a missing tensor, a wrong shape, or a head made for another target)."""
    folder = Path(path)
    where = f"draft={PREFIX}{path}"
    if not (folder / CONFIG_FILE).is_file() or not loader.weight_files(folder):
        found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "no such folder"
        raise ValueError(
            f"{where}: expected an EAGLE-3 head folder with {CONFIG_FILE} and {WEIGHTS_FILE} (or "
            f"{loader.BIN_FILE}), found {found}"
        )
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} is not a JSON object")
    c = HeadConfig.from_hf(raw, target.config, where=f"{where}: {CONFIG_FILE}")
    check_matches(c, target, where)
    tensors = _tensors(folder, where)
    want_dtype = np.dtype(dtype or jnp.dtype(jax.tree.leaves(target.params)[0].dtype))
    params = {}
    for name, shape in param_shapes(c).items():
        a = tensors.get(TENSORS[name])
        if a is None:
            raise ValueError(f"{where}: the weights lack tensor {TENSORS[name]!r}")
        if tuple(a.shape) != shape:
            raise ValueError(
                f"{where}: tensor {TENSORS[name]!r} has shape {list(a.shape)}, the config "
                f"says {list(shape)}"
            )
        head_checks.check_weight(TENSORS[name], a, where)
        params[name] = jnp.asarray(a.astype(np.float32), want_dtype)
    ids = head_checks.target_ids(tensors, c.draft_vocab_size, c.vocab_size, where)
    embed = tensors.get("embed_tokens.weight")
    target_embed = target.params["embed"]
    if embed is None:
        embed = target_embed
    elif tuple(embed.shape) != tuple(target_embed.shape):
        raise ValueError(
            f"{where}: tensor 'embed_tokens.weight' has shape {list(embed.shape)}, the "
            f"target's embedding {list(target_embed.shape)}"
        )
    else:
        head_checks.check_weight("embed_tokens.weight", embed, where)
    params["embed"] = jnp.asarray(np.asarray(embed, np.float32), want_dtype)
    params["d2t"] = jnp.asarray(ids, jnp.int32)
    return Head(
        name=f"{PREFIX}{path}",
        path=str(folder),
        config=c,
        params=params,
        tokenizer=target.tokenizer,
    )


def save_head(path, config: HeadConfig, params: dict, *, embed: bool = False) -> Path:
    """Write the head in the EAGLE-3 layout (``config.json`` + ``model.safetensors``, with
    ``d2t`` offsets and the ``t2d`` mask; ``embed``: also its embedding), each file replaced
    only once both are written."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    host = {k: np.asarray(jax.device_get(v)) for k, v in params.items()}
    tensors = {TENSORS[name]: host[name].astype(np.float32) for name in param_shapes(config)}
    ids = host["d2t"].astype(np.int64)
    tensors["d2t"] = ids - np.arange(config.draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(config.vocab_size, bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    if embed:
        tensors["embed_tokens.weight"] = host["embed"].astype(np.float32)
    # Both files written in full first, then renamed: a failed write (a full disk) leaves the
    # folder's previous head as it was and no temporary file.
    weights, conf = folder / (WEIGHTS_FILE + ".tmp"), folder / (CONFIG_FILE + ".tmp")
    try:
        loader.write_safetensors(weights, list(tensors.items()))
        conf.write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    except BaseException:
        weights.unlink(missing_ok=True)
        conf.unlink(missing_ok=True)
        raise
    weights.replace(folder / WEIGHTS_FILE)
    conf.replace(folder / CONFIG_FILE)
    return folder


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
    "PREFIX",
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
