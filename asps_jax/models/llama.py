"""Llama in JAX: pure functions over a plain dict of stacked parameters.

The forward takes the caller's positions, attention mask and KV cache, and returns the new keys and
values instead of writing them, which is what tree scoring needs (docs/design.md, models): the
decode loop scores a whole draft tree in one call and commits only the accepted path.

Layout choices:
* stored (checkpoints, sharding rules, ``param_shapes``): layers stacked on a leading ``L`` axis,
  projections ``[in, out]`` (``x @ W``) with the head axes split out, e.g. ``wq [L, E, NH, H]``;
  HF's ``nn.Linear`` stores ``[out, in]`` and computes ``x @ W.T``, so every HF projection is
  transposed once at load (``HF_TENSORS``, kind ``"linear"``, hf_table.py). On this layout the
  forward is one ``lax.scan`` (one compiled layer): what the decoding loop runs on an
  accelerator (``base.scan_layout_for``);
* run (:func:`prepare_params`, what the decoding loop uses on one CPU device): per-layer weights,
  the layers unrolled, in one of two orientations chosen by how many rows a call multiplies:
  ``[out, in]`` for one row (a matrix-vector product: the draft, AR at batch 1), ``[in, out]`` for
  two or more (the target scoring a chain or tree, a batch); same logits, the fast path on CPU;
* RoPE in HF's split-half layout (``rope.py``), so q/k weights need no permutation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from asps_jax.kv_cache import KVBlock, KVCache
from asps_jax.models.base import FirstLayers
from asps_jax.models.hf_table import HFTensor
from asps_jax.models.layers import (
    attention,
    axes_of,
    check_inputs,
    check_rope_decoder_sizes,
    init_from_shapes,
    output_logits,
    rms_norm,
    scan_layers,
    split_layers,
    visible_cache_len,
    with_features,
)
from asps_jax.models.quant import einsum, merge
from asps_jax.models.rope import RopeScaling, apply_rope, rope_tables

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"


@dataclasses.dataclass(frozen=True)
class LlamaConfig(FirstLayers):
    vocab_size: int  # V
    hidden_size: int  # E
    intermediate_size: int  # F
    num_hidden_layers: int  # L
    num_attention_heads: int  # NH
    num_key_value_heads: int  # KVH
    head_dim: int | None = None  # H; None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    pad_token_id: int | None = None
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.head_dim is None and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        check_rope_decoder_sizes(self)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> LlamaConfig:
        """From ``config.json``: v4 ``rope_theta``/``rope_scaling`` or v5 ``rope_parameters``."""
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"config: model_type must be 'llama', got {d.get('model_type')!r}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config: hidden_act {d['hidden_act']!r} unsupported (only 'silu')")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise ValueError(f"config: {flag}=true is not supported by this port")
        max_pos = int(d.get("max_position_embeddings", 2048))
        rope_params = d.get("rope_parameters")
        if isinstance(rope_params, dict) and rope_params:
            theta = rope_params.get("rope_theta", d.get("rope_theta", 10000.0))
        else:
            theta = d.get("rope_theta", 10000.0)
            rope_params = d.get("rope_scaling")
        heads = int(d["num_attention_heads"])
        eos = d.get("eos_token_id", 2)
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=RopeScaling.from_hf(rope_params, max_pos),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id", 1),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=d.get("pad_token_id"),
            initializer_range=float(d.get("initializer_range", 0.02)),
        )

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict for transformers (both the v5 and the v4 RoPE keys)."""
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters.update(self.rope_scaling.to_hf())
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "model_type": MODEL_TYPE,
            "architectures": [ARCHITECTURE],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "initializer_range": self.initializer_range,
            "attention_bias": False,
            "mlp_bias": False,
        }


CONFIG_CLASS = LlamaConfig
config_from_hf = LlamaConfig.from_hf


# --- Parameters -------------------------------------------------------------------------------


def param_shapes(config: LlamaConfig) -> dict:
    """Shapes and logical axes of every parameter: ``{name: (shape, axes)}``, nested like params."""
    c = config
    L, E, F, V = c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size
    NH, KVH, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    shapes = {
        "embed": ((V, E), ("vocab", "embed")),
        "layers": {
            "attn_norm": ((L, E), ("layers", "embed")),
            "wq": ((L, E, NH, H), ("layers", "embed", "heads", "head_dim")),
            "wk": ((L, E, KVH, H), ("layers", "embed", "kv_heads", "head_dim")),
            "wv": ((L, E, KVH, H), ("layers", "embed", "kv_heads", "head_dim")),
            "wo": ((L, NH, H, E), ("layers", "heads", "head_dim", "embed")),
            "mlp_norm": ((L, E), ("layers", "embed")),
            "w_gate": ((L, E, F), ("layers", "embed", "mlp")),
            "w_up": ((L, E, F), ("layers", "embed", "mlp")),
            "w_down": ((L, F, E), ("layers", "mlp", "embed")),
        },
        "final_norm": ((E,), ("embed",)),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head"] = ((E, V), ("embed", "vocab"))
    return shapes


def param_axes(config: LlamaConfig) -> dict:
    """Same structure as the params; each leaf a tuple of logical axis names."""
    return axes_of(param_shapes(config))


@functools.partial(jax.jit, static_argnums=(0, 2))
def init_params(config: LlamaConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """HF-style init: weights ~ N(0, initializer_range), norm scales = 1 (one compiled call)."""
    return init_from_shapes(
        param_shapes(config),
        key,
        config.initializer_range,
        dtype,
        lambda name: 1.0 if name.endswith("norm") else None,
    )


# HF tensor name <-> our parameter, with its layout transform (hf_table.py). HF nn.Linear stores
# [out, in] and computes x @ W.T; we store [in, out (split into heads)] so x @ W needs no
# transpose at run time. "{i}" is the layer index; those go to slot i of the stacked L axis.
HF_PREFIX = "model."  # the base model's prefix: a bare LlamaModel checkpoint lacks it
HF_TENSORS = (
    HFTensor("model.embed_tokens.weight", "embed"),
    HFTensor("model.layers.{i}.input_layernorm.weight", "layers/attn_norm"),
    HFTensor("model.layers.{i}.self_attn.q_proj.weight", "layers/wq", "linear"),
    HFTensor("model.layers.{i}.self_attn.k_proj.weight", "layers/wk", "linear"),
    HFTensor("model.layers.{i}.self_attn.v_proj.weight", "layers/wv", "linear"),
    HFTensor("model.layers.{i}.self_attn.o_proj.weight", "layers/wo", "linear", n_in=2),
    HFTensor("model.layers.{i}.post_attention_layernorm.weight", "layers/mlp_norm"),
    HFTensor("model.layers.{i}.mlp.gate_proj.weight", "layers/w_gate", "linear"),
    HFTensor("model.layers.{i}.mlp.up_proj.weight", "layers/w_up", "linear"),
    HFTensor("model.layers.{i}.mlp.down_proj.weight", "layers/w_down", "linear"),
    HFTensor("model.norm.weight", "final_norm"),
    HFTensor("lm_head.weight", "lm_head", "linear", tied=True),
)
# Non-parameter buffers some older checkpoints carry; recomputed from the config.
HF_IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)


# --- Forward ----------------------------------------------------------------------------------


# The run layout of one layer (``prepare_params``): the same keys in both orientations. One row
# (``wide=False``): every projection ``[out, in]``, HF's own orientation, as one matrix (head axes
# merged: ``wq [NH * H, E]``). Two or more rows (``wide=True``): the stored ``[in, out]`` slices,
# head axes split (``wq [E, NH, H]``). ``wq``'s rank tells the forward which one it holds.
RUN_LAYER_KEYS = frozenset(
    {"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"}
)


@jax.jit
def _run_layer(p: dict) -> dict:
    """One layer of the stored layout (``[in, out]``, head axes split) in the one-row run layout."""
    E = p["wq"].shape[0]
    # quant.merge and .transpose() (not reshape and .T): a quantized matrix (qwix.QArray)
    # reshapes and transposes its scales with it.
    size = {name: math.prod(p[name].shape) // E for name in ("wq", "wk", "wv", "w_gate", "w_up")}
    run = {name: merge(p[name], (E, out)).transpose() for name, out in size.items()}
    inner = math.prod(p["wo"].shape) // E
    run.update(wo=merge(p["wo"], (inner, E)).transpose(), w_down=p["w_down"].transpose())
    return dict(run, attn_norm=p["attn_norm"], mlp_norm=p["mlp_norm"])


def prepare_params(config: LlamaConfig, params: dict, wide: bool = False) -> dict:
    """The run layout of ``params``: ``"layers"`` a tuple of ``L`` per-layer dicts. ``wide``
    False (a call multiplies one row: the draft's rollout, AR at batch 1): projections stored
    ``[out, in]``, e.g. ``wq [NH * H, E]``; True (two or more rows: the target scoring a chain or a
    tree, any batch > 1): the stored ``[in, out]`` slices, head axes split. The embedding, final
    norm and head are the stored arrays themselves (the head's ``[E, V]`` reads as fast as
    ``[V, E]``, within 2%, at both benchmark shapes).

    Made once where parameters are loaded or placed (``base.run_params``), never per forward, and
    only for a CPU device (an accelerator runs the stored layout, ``base.scan_layout_for``):
    * per layer: inside a compiled forward, slicing layer ``i`` out of a stacked ``[L, ...]``
      parameter is a copy of its weights on every call (XLA cannot alias a slice of an input
      buffer), which doubled the bytes a one-token forward moves;
    * the orientation: XLA:CPU's matrix-vector product reads a ``[out, in]`` matrix (one dot
      product per output, contiguous rows) faster than an ``[in, out]`` one (28 against 15.5 GB
      per CPU second for llama-68m's ``w_down`` on 2 cores), while its product with 2 to 17 rows
      runs 1.5-2x faster on ``[in, out]`` (the 0.5B shape's ``w_up``: 4.3 against 8.5 ms at 5 rows;
      docs/benchmarks.md, the chain-forward layout).

    The logits equal those of the stored layout to float tolerance. Idempotent: a run layout (of
    either orientation) is returned as it is. The layer arrays are new buffers (a copy of the
    weights; the stored ``params`` stay valid).
    """
    layers = params["layers"]
    if isinstance(layers, (tuple, list)):
        return params
    L = config.num_hidden_layers
    if wide:
        return {**params, "layers": split_layers(L, layers)}
    per_layer = tuple(_run_layer({k: a[i] for k, a in layers.items()}) for i in range(L))
    return {**params, "layers": per_layer}


def _layer(
    c: LlamaConfig,
    p: dict,
    x_BTE,
    cache_k,
    cache_v,
    *,
    run,
    cos,
    sin,
    mask,
    scale,
    heads=False,
    cache_len=None,
    layer=None,
):
    """One decoder layer; ``p`` holds that layer's parameters, ``[out, in]`` matrices when
    ``run`` (the one-row run layout), else ``[in, out]`` with the head axes split (the stored
    layout's slice, also the wide run layout). ``heads`` (the scan over the stored layout): the
    attention projections contract with their head axes split (``bte,enh->btnh``), as the
    ``decoder.py`` families do: merging a tiled ``[E, NH, H]`` slice into ``[E, NH * H]`` made
    XLA:TPU re-lay out an attention matrix of every layer at batch 8."""
    B, T = x_BTE.shape[:2]
    NH, KVH, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def proj(h_BTI, name):  # [B, T, in] -> [B, T, out]
        w = p[name]
        if run:
            return einsum("bti,oi->bto", h_BTI, w)
        if heads and name in ("wq", "wk", "wv"):
            return einsum("bte,enh->btnh", h_BTI, w).reshape(B, T, -1)
        if heads and name == "wo":
            return einsum("btnh,nhe->bte", h_BTI.reshape(B, T, NH, H), w)
        inputs = h_BTI.shape[-1]
        return einsum("bti,io->bto", h_BTI, merge(w, (inputs, math.prod(w.shape) // inputs)))

    h = rms_norm(x_BTE, p["attn_norm"], c.rms_norm_eps)
    q = apply_rope(proj(h, "wq").reshape(B, T, NH, H), cos, sin)
    k = apply_rope(proj(h, "wk").reshape(B, T, KVH, H), cos, sin)
    v = proj(h, "wv").reshape(B, T, KVH, H)
    attn = attention(q, k, v, cache_k, cache_v, mask, scale, cache_len=cache_len, layer=layer)
    x_BTE = x_BTE + proj(attn.reshape(B, T, NH * H), "wo")
    h = rms_norm(x_BTE, p["mlp_norm"], c.rms_norm_eps)
    x_BTE = x_BTE + proj(jax.nn.silu(proj(h, "w_gate")) * proj(h, "w_up"), "w_down")
    return x_BTE, (k, v)


def forward(
    config: LlamaConfig,
    params: dict,
    tokens: jax.Array,  # int32[B, T]
    positions: jax.Array,  # int32[B, T]
    mask: jax.Array,  # bool[B, T, S+T] (cache slots, then the new tokens) or bool[B, T, T]
    cache: KVCache | None,
    features: tuple[int, ...] = (),
):
    """``(logits float32[B, T, V], new_kv)``; ``new_kv.k/v [L, B, T, KVH, H]`` (k after RoPE).

    ``params`` in the stored (stacked) layout runs the layers as one ``lax.scan``; in a run
    layout of :func:`prepare_params` (either orientation) the layers are unrolled over the
    per-layer weights (the fast path: no weight is copied per call). All give the same logits to
    float tolerance.

    ``features`` (static layer ids): also return ``float[B, T, len(features) * E]``, the
    residual stream entering each listed layer (Hugging Face's ``hidden_states[i]``; ``L`` is the
    last layer's output before the final norm), concatenated: what a learned head reads
    (:mod:`asps_jax.drafters.head`), in the result's ``features`` (``models.output.ForwardOut``).
    """
    check_inputs(config, tokens, positions, mask, cache)
    c = config
    cos, sin = rope_tables(
        c.rope_theta, c.head_dim, c.rope_scaling, c.max_position_embeddings, positions
    )
    kw = dict(cos=cos, sin=sin, mask=mask, scale=c.head_dim**-0.5)
    x = params["embed"][tokens]  # [B, T, E]
    layers = params["layers"]
    streams = []  # the residual stream entering each layer, then the last layer's output
    if isinstance(layers, (tuple, list)):
        if len(layers) != c.num_hidden_layers:
            raise ValueError(f"params has {len(layers)} layers, config {c.num_hidden_layers}")
        ks, vs = [], []
        for i, p in enumerate(layers):
            streams.append(x)
            if set(p) != RUN_LAYER_KEYS:
                want = sorted(RUN_LAYER_KEYS)
                raise ValueError(f"params layer {i} has keys {sorted(p)}; the run layout: {want}")
            kv = (None, None) if cache is None else cache.layer(i)
            x, (k, v) = _layer(c, p, x, *kv, run=p["wq"].ndim == 2, **kw)
            ks.append(k)
            vs.append(v)
        new_k, new_v = jnp.stack(ks), jnp.stack(vs)
    else:

        def body(x_BTE, xs):
            p, i = xs
            at = dict(cache_len=filled, layer=i)
            return _layer(c, p, x_BTE, *cache_kv, run=False, heads=True, **at, **kw)

        # The scan is the accelerator path: its attention reads each layer's cache in place
        # (the stacked arrays and the layer's index) up to the last slot a query sees, not
        # all of it (``layers.attention``'s ``cache_len`` and ``layer``).
        cache_kv = (None, None) if cache is None else cache.stacked()
        filled = None if cache is None else visible_cache_len(mask)
        xs = (layers, jnp.arange(jax.tree.leaves(layers)[0].shape[0], dtype=jnp.int32))
        x, (new_k, new_v), streams = scan_layers(body, x, xs, features)
    streams.append(x)
    logits = output_logits(
        rms_norm(x, params["final_norm"], c.rms_norm_eps), params, c.tie_word_embeddings
    )
    return with_features(logits, KVBlock(k=new_k, v=new_v), streams, features)
