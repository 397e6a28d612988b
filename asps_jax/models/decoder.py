"""The RoPE decoder the Llama-like families share: Qwen2/2.5, Qwen3, Mistral, Gemma 2, Gemma 3.

Every one of them is Llama's pre-norm decoder (RMS norms, RoPE in HF's split-half layout, grouped
query attention, a gated MLP) plus a few switches. Each family module (``qwen2.py``, ``qwen3.py``,
``mistral.py``, ``gemma2.py``, ``gemma3_text.py``) is a config subclass of :class:`DecoderConfig`
that reads its ``config.json`` and sets the switches; the parameters, the HF tensor table and the
forward live here once.

=========================  =============================================================
switch (class attribute)   what it does
=========================  =============================================================
``QKV_BIAS``               q/k/v projections with biases (Qwen2)
``QK_NORM``                an RMS norm over ``head_dim`` of every query and key head, before
                           RoPE (Qwen3, Gemma 3)
``GEMMA``                  RMS norms scale by ``1 + w``; the attention and MLP outputs are
                           normed again before the residual add (pre + post norms); the
                           embedding is scaled by ``sqrt(hidden_size)`` (in its dtype)
=========================  =============================================================

and config fields, each off by default:

* ``sliding_window`` with ``layer_types`` (``"sliding_attention"`` / ``"full_attention"`` per
  layer): a sliding layer sees keys with ``query position - key position < sliding_window``,
  intersected with the caller's mask (``layers.window_mask``), so tree scoring keeps both;
* ``query_pre_attn_scalar``: the scores are scaled by its ``-1/2`` power instead of ``head_dim``'s;
* ``attn_logit_softcapping`` / ``final_logit_softcapping``: ``cap * tanh(x / cap)`` on the scaled
  attention scores (before masking) and on the logits (Gemma 2);
* ``local_rope_theta``: the RoPE base of sliding layers (Gemma 3: 10,000 locally, 1,000,000 and
  the config's ``rope_scaling`` globally).

Stored layout: Llama's (``llama.py``): layers stacked on a leading ``L`` axis, projections
``[in, out]`` with the head axes split. On it the forward is one ``lax.scan`` (what an accelerator
runs, ``base.scan_layout_for``): a ``bool[L]`` scan input tells a sliding layer, which takes the
windowed mask and the local RoPE table, both made once before the scan. :func:`prepare_params`
(the run layout, one CPU device) splits the layers into a tuple, so XLA:CPU reads each layer's
weights (and its per-layer cache) in place; those layers are unrolled, each with its static
window and RoPE table. Both give the same logits (``tests/test_scan_layout.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from asps_jax.kv_cache import KVBlock, KVCache
from asps_jax.models.base import FirstLayers
from asps_jax.models.hf_table import HFTensor
from asps_jax.models.layers import (
    activation,
    attention,
    attention_out,
    axes_of,
    check_inputs,
    check_rope_decoder_sizes,
    init_from_shapes,
    output_logits,
    project_qkv,
    rms_norm,
    rms_norm_offset,
    scan_layers,
    soft_cap,
    split_layers,
    visible_cache_len,
    window_mask,
    with_features,
)
from asps_jax.models.quant import einsum
from asps_jax.models.rope import RopeScaling, apply_rope, rope_tables

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class DecoderConfig(FirstLayers):
    """The fields of every RoPE-decoder family; a family subclass sets the class switches."""

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
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    sliding_window: int | None = None  # None: no layer has a window
    layer_types: tuple[str, ...] | None = None  # per layer; None: all "full_attention"
    query_pre_attn_scalar: float | None = None  # None: scores scaled by head_dim ** -0.5
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None  # sliding layers' RoPE base; None: rope_theta

    MODEL_TYPE: ClassVar[str] = ""
    ARCHITECTURE: ClassVar[str] = ""
    QKV_BIAS: ClassVar[bool] = False
    QK_NORM: ClassVar[bool] = False
    GEMMA: ClassVar[bool] = False

    def __post_init__(self):
        if self.head_dim is None and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        check_rope_decoder_sizes(self)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            object.__setattr__(self, "layer_types", types)
            if len(types) != self.num_hidden_layers or not set(types) <= set(LAYER_TYPES):
                raise ValueError(
                    f"layer_types must list {self.num_hidden_layers} entries of {LAYER_TYPES}, "
                    f"got {types}"
                )
        if self.sliding_window is not None and int(self.sliding_window) < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not float(value) > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        activation(self.hidden_act)

    def first_layers(self, layers: int) -> DecoderConfig:
        types = None if self.layer_types is None else self.layer_types[:layers]
        return dataclasses.replace(self, num_hidden_layers=layers, layer_types=types)

    def has_window(self) -> bool:
        return any(self.window(i) is not None for i in range(self.num_hidden_layers))

    def is_sliding(self, i: int) -> bool:
        return self.layer_types is not None and self.layer_types[i] == "sliding_attention"

    def window(self, i: int) -> int | None:
        """Layer ``i``'s sliding window, or None (full attention)."""
        return self.sliding_window if self.is_sliding(i) else None

    def rope(self, i: int) -> tuple[float, RopeScaling | None]:
        """Layer ``i``'s RoPE ``(theta, scaling)``: a sliding layer with a ``local_rope_theta``
        uses that base without scaling (Gemma 3)."""
        if self.local_rope_theta is not None and self.is_sliding(i):
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def attention_scale(self) -> float:
        scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(scalar) ** -0.5

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` keys every family writes (a family adds its own)."""
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters.update(self.rope_scaling.to_hf())
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "model_type": self.MODEL_TYPE,
            "architectures": [self.ARCHITECTURE],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
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
            "sliding_window": self.sliding_window,
            "layer_types": None if self.layer_types is None else list(self.layer_types),
        }


def rope_from_hf(d: dict, params: dict | None, default_theta: float):
    """``(theta, RopeScaling | None)`` from a flat v5 ``rope_parameters`` dict (``params``) or
    the v4 ``rope_theta`` / ``rope_scaling`` keys of ``d``."""
    max_pos = int(d.get("max_position_embeddings", 2048))
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", d.get("rope_theta", default_theta))
    else:
        theta, params = d.get("rope_theta", default_theta), d.get("rope_scaling")
    return float(theta), RopeScaling.from_hf(params, max_pos)


def hf_fields(d: dict, model_type: str, *, default_theta: float = 10000.0, **defaults) -> dict:
    """The :class:`DecoderConfig` fields every family reads the same way from ``config.json``."""
    if d.get("model_type", model_type) != model_type:
        raise ValueError(f"config: model_type must be {model_type!r}, got {d.get('model_type')!r}")
    if d.get("mlp_bias"):
        raise ValueError("config: mlp_bias=true is not supported by this port")
    heads = int(d["num_attention_heads"])
    theta, scaling = rope_from_hf(d, d.get("rope_parameters"), default_theta)
    eos = d.get("eos_token_id", defaults.get("eos_token_id"))
    return dict(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=int(d["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", defaults.get("tied", False))),
        bos_token_id=d.get("bos_token_id", defaults.get("bos_token_id")),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=d.get("pad_token_id", defaults.get("pad_token_id")),
        initializer_range=float(d.get("initializer_range", 0.02)),
    )


def window_layers(d: dict, num_layers: int, sliding_window, default) -> tuple | None:
    """``layer_types`` from ``config.json``, else ``default(i)`` per layer; None: no window."""
    if sliding_window is None:
        return None
    types = d.get("layer_types")
    if types:
        return tuple(types)
    return tuple("sliding_attention" if default(i) else "full_attention" for i in range(num_layers))


# --- Parameters -------------------------------------------------------------------------------


def param_shapes(config: DecoderConfig) -> dict:
    """Shapes and logical axes of every parameter: ``{name: (shape, axes)}``, nested like params."""
    c = config
    L, E, F, V = c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size
    NH, KVH, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    vec = ((L, E), ("layers", "embed"))
    layers = {
        "attn_norm": vec,
        "wq": ((L, E, NH, H), ("layers", "embed", "heads", "head_dim")),
        "wk": ((L, E, KVH, H), ("layers", "embed", "kv_heads", "head_dim")),
        "wv": ((L, E, KVH, H), ("layers", "embed", "kv_heads", "head_dim")),
        "wo": ((L, NH, H, E), ("layers", "heads", "head_dim", "embed")),
        "mlp_norm": vec,
        "w_gate": ((L, E, F), ("layers", "embed", "mlp")),
        "w_up": ((L, E, F), ("layers", "embed", "mlp")),
        "w_down": ((L, F, E), ("layers", "mlp", "embed")),
    }
    if c.QKV_BIAS:
        layers["bq"] = ((L, NH, H), ("layers", "heads", "head_dim"))
        layers["bk"] = ((L, KVH, H), ("layers", "kv_heads", "head_dim"))
        layers["bv"] = ((L, KVH, H), ("layers", "kv_heads", "head_dim"))
    if c.QK_NORM:
        layers["q_norm"] = ((L, H), ("layers", "head_dim"))
        layers["k_norm"] = ((L, H), ("layers", "head_dim"))
    if c.GEMMA:
        layers["post_attn_norm"] = vec
        layers["post_mlp_norm"] = vec
    shapes = {"embed": ((V, E), ("vocab", "embed")), "layers": layers}
    shapes["final_norm"] = ((E,), ("embed",))
    if not c.tie_word_embeddings:
        shapes["lm_head"] = ((E, V), ("embed", "vocab"))
    return shapes


def param_axes(config: DecoderConfig) -> dict:
    """Same structure as the params; each leaf a tuple of logical axis names."""
    return axes_of(param_shapes(config))


@functools.partial(jax.jit, static_argnums=(0, 2))
def init_params(config: DecoderConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """HF-style init: weights ~ N(0, initializer_range), biases 0, norm scales 1 (Gemma's
    ``1 + w`` norms: w = 0)."""
    norm = 0.0 if config.GEMMA else 1.0

    def constant(name):
        if name.endswith("norm"):
            return norm
        return 0.0 if name in ("bq", "bk", "bv") else None

    return init_from_shapes(param_shapes(config), key, config.initializer_range, dtype, constant)


def hf_tensors(config_class: type) -> tuple:
    """The ``HF_TENSORS`` table of a family, from its class switches (``hf_table.py``)."""
    qkv_bias, qk_norm, gemma = config_class.QKV_BIAS, config_class.QK_NORM, config_class.GEMMA
    layer = "model.layers.{i}."
    out = [
        HFTensor("model.embed_tokens.weight", "embed"),
        HFTensor(layer + "input_layernorm.weight", "layers/attn_norm"),
        HFTensor(layer + "self_attn.q_proj.weight", "layers/wq", "linear"),
        HFTensor(layer + "self_attn.k_proj.weight", "layers/wk", "linear"),
        HFTensor(layer + "self_attn.v_proj.weight", "layers/wv", "linear"),
        HFTensor(layer + "self_attn.o_proj.weight", "layers/wo", "linear", n_in=2),
    ]
    if qkv_bias:
        out += [
            HFTensor(layer + f"self_attn.{x}_proj.bias", f"layers/b{x}", "vector") for x in "qkv"
        ]
    if qk_norm:
        out += [HFTensor(layer + f"self_attn.{x}_norm.weight", f"layers/{x}_norm") for x in "qk"]
    if gemma:  # post_attention_layernorm norms the attention output; the MLP has its own pre-norm
        out += [
            HFTensor(layer + "post_attention_layernorm.weight", "layers/post_attn_norm"),
            HFTensor(layer + "pre_feedforward_layernorm.weight", "layers/mlp_norm"),
            HFTensor(layer + "post_feedforward_layernorm.weight", "layers/post_mlp_norm"),
        ]
    else:
        out.append(HFTensor(layer + "post_attention_layernorm.weight", "layers/mlp_norm"))
    out += [
        HFTensor(layer + "mlp.gate_proj.weight", "layers/w_gate", "linear"),
        HFTensor(layer + "mlp.up_proj.weight", "layers/w_up", "linear"),
        HFTensor(layer + "mlp.down_proj.weight", "layers/w_down", "linear"),
        HFTensor("model.norm.weight", "final_norm"),
        HFTensor("lm_head.weight", "lm_head", "linear", tied=True),
    ]
    return tuple(out)


HF_PREFIX = "model."
HF_IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)


# --- Forward ----------------------------------------------------------------------------------


def prepare_params(config: DecoderConfig, params: dict, wide: bool = False) -> dict:
    """The run layout: ``"layers"`` a tuple of ``L`` per-layer dicts (slices of the stacked
    arrays, made once). Inside a compiled forward a layer sliced out of a stacked parameter is a
    copy on every call; separate arrays are read in place. Idempotent. One orientation for every
    call (``wide`` is accepted and changes nothing): the stored ``[in, out]``, Llama's wide one."""
    layers = params["layers"]
    if isinstance(layers, (tuple, list)):
        return params
    return {**params, "layers": split_layers(config.num_hidden_layers, layers)}


def _layer(
    c: DecoderConfig,
    p: dict,
    x_BTE,
    cache_k,
    cache_v,
    *,
    cos,
    sin,
    mask,
    cache_len=None,
    layer=None,
):
    B, T = x_BTE.shape[:2]
    norm = rms_norm_offset if c.GEMMA else rms_norm
    eps = c.rms_norm_eps
    h = norm(x_BTE, p["attn_norm"], eps)
    q, k, v = project_qkv(h, p)  # [B, T, heads, H], + bq/bk/bv when the family has them
    if c.QK_NORM:
        q, k = norm(q, p["q_norm"], eps), norm(k, p["k_norm"], eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    attn = attention(
        q, k, v, cache_k, cache_v, mask, c.attention_scale, c.attn_logit_softcapping,
        cache_len=cache_len, layer=layer,
    )  # fmt: skip
    out = attention_out(attn, p)
    if c.GEMMA:
        out = norm(out, p["post_attn_norm"], eps)
    x_BTE = x_BTE + out
    h = norm(x_BTE, p["mlp_norm"], eps)
    gate = activation(c.hidden_act)(einsum("bte,ef->btf", h, p["w_gate"]))
    out = einsum("btf,fe->bte", gate * einsum("bte,ef->btf", h, p["w_up"]), p["w_down"])
    if c.GEMMA:
        out = norm(out, p["post_mlp_norm"], eps)
    return x_BTE + out, (k, v)


def forward(
    config: DecoderConfig,
    params: dict,
    tokens: jax.Array,  # int32[B, T]
    positions: jax.Array,  # int32[B, T]
    mask: jax.Array,  # bool[B, T, S+T] (cache slots, then the new tokens) or bool[B, T, T]
    cache: KVCache | None,
    features: tuple[int, ...] = (),
):
    """``(logits float32[B, T, V], new_kv)``; ``new_kv.k/v [L, B, T, KVH, H]`` (k after RoPE).

    ``params`` in the stored (stacked) layout runs the layers as one ``lax.scan``, in the run
    layout (:func:`prepare_params`) unrolled; same logits.
    ``features``: also return the residual stream entering those layers (``llama.forward``).
    """
    check_inputs(config, tokens, positions, mask, cache)
    c = config
    tables = {}
    for i in range(c.num_hidden_layers):
        theta, scaling = c.rope(i)
        if (theta, scaling) not in tables:
            tables[theta, scaling] = rope_tables(
                theta, c.head_dim, scaling, c.max_position_embeddings, positions
            )
    x = params["embed"][tokens]  # [B, T, E]
    if c.GEMMA:  # sqrt(E) rounded to the embedding's dtype, as transformers does
        x = x * jnp.asarray(c.hidden_size**0.5, x.dtype)
    layers = params["layers"]
    if isinstance(layers, (tuple, list)):
        if len(layers) != c.num_hidden_layers:
            raise ValueError(f"params has {len(layers)} layers, config {c.num_hidden_layers}")
        x, new_kv, streams = _unrolled(c, layers, x, cache, tables, mask, positions)
    else:
        x, new_kv, streams = _scanned(c, layers, x, cache, tables, mask, positions, features)
    streams.append(x)
    x = (rms_norm_offset if c.GEMMA else rms_norm)(x, params["final_norm"], c.rms_norm_eps)
    logits = soft_cap(output_logits(x, params, c.tie_word_embeddings), c.final_logit_softcapping)
    return with_features(logits, new_kv, streams, features)


def _unrolled(c: DecoderConfig, layers, x, cache, tables, mask, positions):
    """The per-layer run layout: the layers unrolled, each with its static window and RoPE
    table. ``(x, new_kv, streams)``, ``streams`` the residual stream entering each layer."""
    ks, vs, streams = [], [], []
    for i, p in enumerate(layers):
        streams.append(x)
        kv = (None, None) if cache is None else cache.layer(i)
        window = c.window(i)
        layer_mask = mask if window is None else window_mask(mask, positions, window)
        cos, sin = tables[c.rope(i)]
        x, (k, v) = _layer(c, p, x, *kv, cos=cos, sin=sin, mask=layer_mask)
        ks.append(k)
        vs.append(v)
    return x, KVBlock(k=jnp.stack(ks), v=jnp.stack(vs)), streams


def _scanned(c: DecoderConfig, layers: dict, x, cache, tables, mask, positions, features):
    """The stored stacked layout as one ``lax.scan``: a layer's differences (sliding or full,
    local or global RoPE) are a scan input ``sliding bool[L]`` selecting between the two masks
    and the two RoPE tables, all computed once outside the loop (a select copies the chosen
    values exactly, so the logits are those of :func:`_unrolled`). ``(x, new_kv, streams)``."""
    sliding_L = [c.is_sliding(i) for i in range(c.num_hidden_layers)]
    full_cos, full_sin = tables[c.rope_theta, c.rope_scaling]
    local_cos, local_sin = full_cos, full_sin
    local_mask = mask
    if any(sliding_L):
        local_cos, local_sin = tables[c.rope(sliding_L.index(True))]
        if c.sliding_window is not None:
            local_mask = window_mask(mask, positions, c.sliding_window)

    def body(x_BTE, xs):
        p, sliding, i = xs
        pick = functools.partial(jnp.where, sliding)
        layer_mask = mask if local_mask is mask else pick(local_mask, mask)
        cos, sin = (full_cos, full_sin)
        if local_cos is not full_cos:
            cos, sin = pick(local_cos, full_cos), pick(local_sin, full_sin)
        at = dict(cache_len=filled, layer=i)  # each layer's cache read in place, to `filled`
        return _layer(c, p, x_BTE, *caches, cos=cos, sin=sin, mask=layer_mask, **at)

    caches = (None, None) if cache is None else cache.stacked()
    filled = None if cache is None else visible_cache_len(mask)  # a window only narrows it
    xs = (layers, jnp.asarray(sliding_L, bool), jnp.arange(len(sliding_L), dtype=jnp.int32))
    x, (new_k, new_v), streams = scan_layers(body, x, xs, features)
    return x, KVBlock(k=new_k, v=new_v), streams
