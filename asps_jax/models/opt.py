"""OPT (Zhang et al., 2022) in JAX: pure functions over a dict of stacked parameters.

The forward contract is Llama's (``base.Forward``). What differs from Llama:

* learned absolute positions: row ``position + 2`` of ``embed_positions`` (OPT's offset of 2,
  kept from fairseq's padding-index convention; HF's table has ``max_position_embeddings + 2``
  rows and we store it whole, so it loads as a plain copy);
* ``do_layer_norm_before``: pre-LN (every OPT but 350m) or post-LN (opt-350m: the layer norms
  follow each residual sum, and there is no final layer norm);
* ``word_embed_proj_dim`` P < E (opt-350m: 512 vs 1024): the token embedding and the tied head
  live in P dimensions, ``project_in`` [P, E] and ``project_out`` [E, P] bridge to the stack;
* biased projections, ReLU MLP (``fc1``/``fc2``), queries scaled by 1/sqrt(H) before the product;
* the LM head tied to the token embedding (``tie_word_embeddings``, true for every release).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax.kv_cache import KVBlock, KVCache
from asps_jax.models.base import FirstLayers
from asps_jax.models.hf_table import HFTensor
from asps_jax.models.layers import (
    activation,
    attention,
    attention_out,
    axes_of,
    check_inputs,
    dense_mlp,
    gpt_constant,
    gpt_layer_shapes,
    init_from_shapes,
    layer_norm,
    lookup,
    output_logits,
    project_qkv,
    scan_layers,
    with_features,
)
from asps_jax.models.quant import einsum

MODEL_TYPE = "opt"
ARCHITECTURE = "OPTForCausalLM"
POSITION_OFFSET = 2
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default; OPT's config has no epsilon


@dataclasses.dataclass(frozen=True)
class OPTConfig(FirstLayers):
    vocab_size: int  # V (embedding rows: 50272, more than the tokenizer's 50265 entries)
    hidden_size: int  # E
    ffn_dim: int  # F
    num_hidden_layers: int  # L
    num_attention_heads: int  # NH
    word_embed_proj_dim: int | None = None  # P; None: hidden_size (no projections)
    max_position_embeddings: int = 2048
    do_layer_norm_before: bool = True
    remove_final_layer_norm: bool = False  # HF "_remove_final_layer_norm"
    activation_function: str = "relu"
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 2
    eos_token_id: int | tuple[int, ...] | None = 2
    pad_token_id: int | None = 1
    init_std: float = 0.02

    def __post_init__(self):
        if self.word_embed_proj_dim is None:
            object.__setattr__(self, "word_embed_proj_dim", self.hidden_size)
        sizes = "vocab_size hidden_size ffn_dim num_hidden_layers num_attention_heads"
        for name in (*sizes.split(), "word_embed_proj_dim", "max_position_embeddings"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        activation(self.activation_function)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def projected(self) -> bool:
        return self.word_embed_proj_dim != self.hidden_size

    @property
    def final_layer_norm(self) -> bool:
        return self.do_layer_norm_before and not self.remove_final_layer_norm

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> OPTConfig:
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"config: model_type must be 'opt', got {d.get('model_type')!r}")
        for flag in ("enable_bias", "layer_norm_elementwise_affine"):
            if not d.get(flag, True):
                raise ValueError(f"config: {flag}=false is not supported by this port")
        eos = d.get("eos_token_id", 2)
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            ffn_dim=int(d["ffn_dim"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            word_embed_proj_dim=d.get("word_embed_proj_dim"),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            do_layer_norm_before=bool(d.get("do_layer_norm_before", True)),
            remove_final_layer_norm=bool(d.get("_remove_final_layer_norm", False)),
            activation_function=d.get("activation_function", "relu"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            bos_token_id=d.get("bos_token_id", 2),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=d.get("pad_token_id", 1),
            init_std=float(d.get("init_std", 0.02)),
        )

    def to_hf(self) -> dict[str, Any]:
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "model_type": MODEL_TYPE,
            "architectures": [ARCHITECTURE],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "ffn_dim": self.ffn_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "word_embed_proj_dim": self.word_embed_proj_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "do_layer_norm_before": self.do_layer_norm_before,
            "_remove_final_layer_norm": self.remove_final_layer_norm,
            "activation_function": self.activation_function,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "init_std": self.init_std,
            "enable_bias": True,
            "layer_norm_elementwise_affine": True,
        }


CONFIG_CLASS = OPTConfig
config_from_hf = OPTConfig.from_hf


# --- Parameters -------------------------------------------------------------------------------


def param_shapes(config: OPTConfig) -> dict:
    """``{name: (shape, logical axes)}``. P (``word_embed_proj_dim``) shards like ``embed``."""
    c = config
    E, V, P = c.hidden_size, c.vocab_size, c.word_embed_proj_dim
    shapes = {
        "embed": ((V, P), ("vocab", "embed")),
        "positions": ((c.max_position_embeddings + POSITION_OFFSET, E), ("positions", "embed")),
        "layers": gpt_layer_shapes(c, c.ffn_dim, qkv_bias=True),
    }
    if c.final_layer_norm:
        shapes["final_norm"] = ((E,), ("embed",))
        shapes["final_norm_b"] = ((E,), ("embed",))
    if c.projected:
        shapes["project_in"] = ((P, E), ("embed", "embed"))
        shapes["project_out"] = ((E, P), ("embed", "embed"))
    if not c.tie_word_embeddings:
        shapes["lm_head"] = ((P, V), ("embed", "vocab"))
    return shapes


def param_axes(config: OPTConfig) -> dict:
    return axes_of(param_shapes(config))


@functools.partial(jax.jit, static_argnums=(0, 2))
def init_params(config: OPTConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Weights ~ N(0, init_std), layer-norm scales 1, biases 0."""
    return init_from_shapes(param_shapes(config), key, config.init_std, dtype, gpt_constant)


_D = "model.decoder."
_LAYER = _D + "layers.{i}."
HF_PREFIX = "model."  # facebook/opt-* checkpoints were saved from OPTModel: "decoder.layers..."
HF_TENSORS = (
    HFTensor(_D + "embed_tokens.weight", "embed"),
    HFTensor(_D + "embed_positions.weight", "positions"),
    HFTensor(_D + "project_in.weight", "project_in", "linear"),
    HFTensor(_D + "project_out.weight", "project_out", "linear"),
    HFTensor(_LAYER + "self_attn_layer_norm.weight", "layers/attn_norm"),
    HFTensor(_LAYER + "self_attn_layer_norm.bias", "layers/attn_norm_b"),
    HFTensor(_LAYER + "self_attn.q_proj.weight", "layers/wq", "linear"),
    HFTensor(_LAYER + "self_attn.k_proj.weight", "layers/wk", "linear"),
    HFTensor(_LAYER + "self_attn.v_proj.weight", "layers/wv", "linear"),
    HFTensor(_LAYER + "self_attn.q_proj.bias", "layers/bq", "vector"),
    HFTensor(_LAYER + "self_attn.k_proj.bias", "layers/bk", "vector"),
    HFTensor(_LAYER + "self_attn.v_proj.bias", "layers/bv", "vector"),
    HFTensor(_LAYER + "self_attn.out_proj.weight", "layers/wo", "linear", n_in=2),
    HFTensor(_LAYER + "self_attn.out_proj.bias", "layers/bo", "vector"),
    HFTensor(_LAYER + "final_layer_norm.weight", "layers/mlp_norm"),
    HFTensor(_LAYER + "final_layer_norm.bias", "layers/mlp_norm_b"),
    HFTensor(_LAYER + "fc1.weight", "layers/w_in", "linear"),
    HFTensor(_LAYER + "fc1.bias", "layers/b_in", "vector"),
    HFTensor(_LAYER + "fc2.weight", "layers/w_out", "linear"),
    HFTensor(_LAYER + "fc2.bias", "layers/b_out", "vector"),
    HFTensor(_D + "final_layer_norm.weight", "final_norm"),
    HFTensor(_D + "final_layer_norm.bias", "final_norm_b"),
    HFTensor("lm_head.weight", "lm_head", "linear", tied=True),
)
HF_IGNORED = ()


# --- Forward ----------------------------------------------------------------------------------


def forward(
    config: OPTConfig,
    params: dict,
    tokens: jax.Array,  # int32[B, T]
    positions: jax.Array,  # int32[B, T]
    mask: jax.Array,  # bool[B, T, S+T] or bool[B, T, T]
    cache: KVCache | None,
    features: tuple[int, ...] = (),
):
    """``(logits float32[B, T, V], new_kv)``; ``new_kv.k/v [L, B, T, NH, H]``; ``features``:
    also the residual stream entering those layers (``llama.forward``)."""
    check_inputs(config, tokens, positions, mask, cache)
    c = config
    act = activation(c.activation_function)
    scale = np.float32(c.head_dim**-0.5)

    def norm(x, p, name):
        return layer_norm(x, p[name], p[name + "_b"], LAYER_NORM_EPS)

    def layer(x_BTE, xs):
        p, cache_k, cache_v = xs
        h = norm(x_BTE, p, "attn_norm") if c.do_layer_norm_before else x_BTE
        q, k, v = project_qkv(h, p)
        # HF scales the biased query before the product (q_proj(h) * scaling).
        attn = attention(q * scale.astype(h.dtype), k, v, cache_k, cache_v, mask, 1.0)
        x_BTE = x_BTE + attention_out(attn, p)
        if not c.do_layer_norm_before:
            x_BTE = norm(x_BTE, p, "attn_norm")
        h = norm(x_BTE, p, "mlp_norm") if c.do_layer_norm_before else x_BTE
        x_BTE = x_BTE + dense_mlp(h, p, act)
        if not c.do_layer_norm_before:
            x_BTE = norm(x_BTE, p, "mlp_norm")
        return x_BTE, (k, v)

    x = params["embed"][tokens]  # [B, T, P]
    if c.projected:
        x = einsum("btp,pe->bte", x, params["project_in"])
    x = x + lookup(params["positions"], positions + POSITION_OFFSET).astype(x.dtype)
    xs = (params["layers"], None, None) if cache is None else (params["layers"], *cache.stacked())
    x, (new_k, new_v), streams = scan_layers(layer, x, xs, features)
    streams.append(x)
    if c.final_layer_norm:
        x = layer_norm(x, params["final_norm"], params["final_norm_b"], LAYER_NORM_EPS)
    if c.projected:
        x = einsum("bte,ep->btp", x, params["project_out"])
    logits = output_logits(x, params, c.tie_word_embeddings)
    return with_features(logits, KVBlock(k=new_k, v=new_v), streams, features)
