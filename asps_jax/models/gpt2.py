"""GPT-2 (Radford et al., 2019) in JAX: pure functions over a dict of stacked parameters.

The forward contract is Llama's (``base.Forward``). What differs from Llama:

* learned absolute positions (``wpe``, ``n_positions`` rows);
* pre-LN blocks with biased LayerNorms, biased projections and a GELU MLP (``gelu_new``: the tanh
  approximation);
* HF's ``Conv1D`` stores weights ``[in, out]`` and computes ``x @ W`` — our layout already, so
  they load without a transpose (kind ``"conv1d"``); the attention's fused ``c_attn`` ``[E, 3E]``
  is q | k | v side by side and is split in three at load;
* the LM head tied to the token embedding.
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
    gpt_param_shapes,
    init_from_shapes,
    layer_norm,
    lookup,
    output_logits,
    project_qkv,
    scan_layers,
    with_features,
)

MODEL_TYPE = "gpt2"
ARCHITECTURE = "GPT2LMHeadModel"


@dataclasses.dataclass(frozen=True)
class GPT2Config(FirstLayers):
    vocab_size: int  # V
    hidden_size: int  # E (HF "n_embd")
    num_hidden_layers: int  # L ("n_layer")
    num_attention_heads: int  # NH ("n_head")
    intermediate_size: int | None = None  # F ("n_inner"); None: 4 * E
    max_position_embeddings: int = 1024  # ("n_positions")
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 50256
    eos_token_id: int | tuple[int, ...] | None = 50256
    pad_token_id: int | None = None
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.intermediate_size is None:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings"):  # fmt: skip
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"n_embd ({self.hidden_size}) must be a multiple of n_head "
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

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> GPT2Config:
        """From ``config.json`` (HF's ``n_embd`` / ``n_layer`` / ``n_head`` / ``n_positions``)."""
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"config: model_type must be 'gpt2', got {d.get('model_type')!r}")
        if d.get("add_cross_attention"):
            raise ValueError("config: add_cross_attention=true is not supported by this port")

        def get(name, alias, default=None):
            return d.get(name, d.get(alias, default))

        eos = d.get("eos_token_id", 50256)
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(get("n_embd", "hidden_size", 768)),
            num_hidden_layers=int(get("n_layer", "num_hidden_layers", 12)),
            num_attention_heads=int(get("n_head", "num_attention_heads", 12)),
            intermediate_size=get("n_inner", "intermediate_size"),
            max_position_embeddings=int(get("n_positions", "max_position_embeddings", 1024)),
            activation_function=d.get("activation_function", "gelu_new"),
            layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)),
            scale_attn_weights=bool(d.get("scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(d.get("scale_attn_by_inverse_layer_idx", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            bos_token_id=d.get("bos_token_id", 50256),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=d.get("pad_token_id"),
            initializer_range=float(d.get("initializer_range", 0.02)),
        )

    def to_hf(self) -> dict[str, Any]:
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "model_type": MODEL_TYPE,
            "architectures": [ARCHITECTURE],
            "vocab_size": self.vocab_size,
            "n_embd": self.hidden_size,
            "n_layer": self.num_hidden_layers,
            "n_head": self.num_attention_heads,
            "n_inner": self.intermediate_size,
            "n_positions": self.max_position_embeddings,
            "activation_function": self.activation_function,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "scale_attn_weights": self.scale_attn_weights,
            "scale_attn_by_inverse_layer_idx": self.scale_attn_by_inverse_layer_idx,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "initializer_range": self.initializer_range,
        }


CONFIG_CLASS = GPT2Config
config_from_hf = GPT2Config.from_hf


# --- Parameters -------------------------------------------------------------------------------


def param_shapes(config: GPT2Config) -> dict:
    return gpt_param_shapes(config, config.intermediate_size, qkv_bias=True)


def param_axes(config: GPT2Config) -> dict:
    return axes_of(param_shapes(config))


@functools.partial(jax.jit, static_argnums=(0, 2))
def init_params(config: GPT2Config, key: jax.Array, dtype=jnp.float32) -> dict:
    """Weights ~ N(0, initializer_range), layer-norm scales 1, biases 0."""
    return init_from_shapes(
        param_shapes(config), key, config.initializer_range, dtype, gpt_constant
    )


_H = "transformer.h.{i}."
HF_PREFIX = "transformer."  # openai-community/gpt2* were saved from GPT2Model: "h.0.attn..."
HF_TENSORS = (
    HFTensor("transformer.wte.weight", "embed"),
    HFTensor("transformer.wpe.weight", "positions"),
    HFTensor(_H + "ln_1.weight", "layers/attn_norm"),
    HFTensor(_H + "ln_1.bias", "layers/attn_norm_b"),
    # Conv1D [E, 3E] = q | k | v along its output axis: split in three.
    HFTensor(_H + "attn.c_attn.weight", ("layers/wq", "layers/wk", "layers/wv"), "conv1d"),
    HFTensor(_H + "attn.c_attn.bias", ("layers/bq", "layers/bk", "layers/bv"), "vector"),
    HFTensor(_H + "attn.c_proj.weight", "layers/wo", "conv1d", n_in=2),
    HFTensor(_H + "attn.c_proj.bias", "layers/bo", "vector"),
    HFTensor(_H + "ln_2.weight", "layers/mlp_norm"),
    HFTensor(_H + "ln_2.bias", "layers/mlp_norm_b"),
    HFTensor(_H + "mlp.c_fc.weight", "layers/w_in", "conv1d"),
    HFTensor(_H + "mlp.c_fc.bias", "layers/b_in", "vector"),
    HFTensor(_H + "mlp.c_proj.weight", "layers/w_out", "conv1d"),
    HFTensor(_H + "mlp.c_proj.bias", "layers/b_out", "vector"),
    HFTensor("transformer.ln_f.weight", "final_norm"),
    HFTensor("transformer.ln_f.bias", "final_norm_b"),
    HFTensor("lm_head.weight", "lm_head", "linear", tied=True),
)
# The causal-mask buffers older checkpoints carry ("h.0.attn.bias", "h.0.attn.masked_bias").
HF_IGNORED = (r"transformer\.h\.\d+\.attn\.(masked_)?bias",)


# --- Forward ----------------------------------------------------------------------------------


def forward(
    config: GPT2Config,
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
    scale = c.head_dim**-0.5 if c.scale_attn_weights else 1.0
    layer_scale = np.full(c.num_hidden_layers, scale, np.float32)
    if c.scale_attn_by_inverse_layer_idx:
        layer_scale = layer_scale / np.arange(1, c.num_hidden_layers + 1, dtype=np.float32)
    eps = c.layer_norm_epsilon

    def layer(x_BTE, xs):
        p, s, cache_k, cache_v = xs
        q, k, v = project_qkv(layer_norm(x_BTE, p["attn_norm"], p["attn_norm_b"], eps), p)
        x_BTE = x_BTE + attention_out(attention(q, k, v, cache_k, cache_v, mask, s), p)
        h = layer_norm(x_BTE, p["mlp_norm"], p["mlp_norm_b"], eps)
        return x_BTE + dense_mlp(h, p, act), (k, v)

    x = params["embed"][tokens]
    x = x + lookup(params["positions"], positions).astype(x.dtype)
    caches = (None, None) if cache is None else cache.stacked()
    xs = (params["layers"], jnp.asarray(layer_scale), *caches)
    x, (new_k, new_v), streams = scan_layers(layer, x, xs, features)
    streams.append(x)
    x = layer_norm(x, params["final_norm"], params["final_norm_b"], eps)
    logits = output_logits(x, params, c.tie_word_embeddings)
    return with_features(logits, KVBlock(k=new_k, v=new_v), streams, features)
