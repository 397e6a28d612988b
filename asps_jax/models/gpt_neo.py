"""GPT-Neo (Black et al., 2021) in JAX: pure functions over a dict of stacked parameters.

The forward contract is Llama's (``base.Forward``). What differs from GPT-2, its closest kin:

* layers alternate global and local attention (``attention_types``, e.g.
  ``[[["global", "local"], 16]]``); a local layer sees only keys whose position is within
  ``window_size`` (256 in the released checkpoints) of the query's: ``q - k < window``. The
  window is intersected with the caller's mask, so tree scoring keeps both constraints;
* NO 1/sqrt(H) scaling of the attention scores (the Mesh-TensorFlow original has none); scores in
  float32 as in HF;
* ``nn.Linear`` projections (transposed at load), unbiased q/k/v, biased output projection;
* learned absolute positions, GELU (tanh) MLP, tied LM head.
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
    window_mask,
    with_features,
)

MODEL_TYPE = "gpt_neo"
ARCHITECTURE = "GPTNeoForCausalLM"
ATTENTION_KINDS = ("global", "local")


@dataclasses.dataclass(frozen=True)
class GPTNeoConfig(FirstLayers):
    vocab_size: int  # V
    hidden_size: int  # E
    num_hidden_layers: int  # L (HF "num_layers")
    num_attention_heads: int  # NH ("num_heads")
    attention_types: tuple  # ((("global", "local"), n), ...), HF's nested lists as tuples
    intermediate_size: int | None = None  # F; None: 4 * E
    window_size: int = 256
    max_position_embeddings: int = 2048
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 50256
    eos_token_id: int | tuple[int, ...] | None = 50256
    pad_token_id: int | None = None
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.intermediate_size is None:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)
        types = tuple((tuple(kinds), int(n)) for kinds, n in self.attention_types)
        object.__setattr__(self, "attention_types", types)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "window_size", "max_position_embeddings"):  # fmt: skip
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                f"({self.num_attention_heads})"
            )
        bad = sorted(set(self.attention_layers) - set(ATTENTION_KINDS))
        if bad:
            raise ValueError(f"config: attention types {bad} unknown; use {ATTENTION_KINDS}")
        if len(self.attention_layers) != self.num_hidden_layers:
            raise ValueError(
                f"config: attention_types expand to {len(self.attention_layers)} layers but "
                f"num_layers is {self.num_hidden_layers}"
            )
        activation(self.activation_function)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    def first_layers(self, layers: int) -> GPTNeoConfig:
        kinds = self.attention_layers[:layers]
        return dataclasses.replace(
            self, num_hidden_layers=layers, attention_types=tuple(((k,), 1) for k in kinds)
        )

    def has_window(self) -> bool:
        return "local" in self.attention_layers

    @property
    def attention_layers(self) -> tuple[str, ...]:
        """One kind per layer, as HF's ``expand_attention_types_params``."""
        return tuple(kind for kinds, n in self.attention_types for _ in range(n) for kind in kinds)

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> GPTNeoConfig:
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"config: model_type must be 'gpt_neo', got {d.get('model_type')!r}")

        def get(name, alias, default=None):
            return d.get(name, d.get(alias, default))

        eos = d.get("eos_token_id", 50256)
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=int(get("num_layers", "num_hidden_layers")),
            num_attention_heads=int(get("num_heads", "num_attention_heads")),
            attention_types=d.get("attention_types") or [[["global", "local"], 12]],
            intermediate_size=d.get("intermediate_size"),
            window_size=int(d.get("window_size", 256)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            activation_function=d.get("activation_function", "gelu_new"),
            layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)),
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
            "hidden_size": self.hidden_size,
            "num_layers": self.num_hidden_layers,
            "num_heads": self.num_attention_heads,
            "attention_types": [[list(kinds), n] for kinds, n in self.attention_types],
            "intermediate_size": self.intermediate_size,
            "window_size": self.window_size,
            "max_position_embeddings": self.max_position_embeddings,
            "activation_function": self.activation_function,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "initializer_range": self.initializer_range,
        }


CONFIG_CLASS = GPTNeoConfig
config_from_hf = GPTNeoConfig.from_hf


# --- Parameters -------------------------------------------------------------------------------


def param_shapes(config: GPTNeoConfig) -> dict:
    return gpt_param_shapes(config, config.intermediate_size, qkv_bias=False)


def param_axes(config: GPTNeoConfig) -> dict:
    return axes_of(param_shapes(config))


@functools.partial(jax.jit, static_argnums=(0, 2))
def init_params(config: GPTNeoConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Weights ~ N(0, initializer_range), layer-norm scales 1, biases 0."""
    return init_from_shapes(
        param_shapes(config), key, config.initializer_range, dtype, gpt_constant
    )


_H = "transformer.h.{i}."
HF_PREFIX = "transformer."
HF_TENSORS = (
    HFTensor("transformer.wte.weight", "embed"),
    HFTensor("transformer.wpe.weight", "positions"),
    HFTensor(_H + "ln_1.weight", "layers/attn_norm"),
    HFTensor(_H + "ln_1.bias", "layers/attn_norm_b"),
    HFTensor(_H + "attn.attention.q_proj.weight", "layers/wq", "linear"),
    HFTensor(_H + "attn.attention.k_proj.weight", "layers/wk", "linear"),
    HFTensor(_H + "attn.attention.v_proj.weight", "layers/wv", "linear"),
    HFTensor(_H + "attn.attention.out_proj.weight", "layers/wo", "linear", n_in=2),
    HFTensor(_H + "attn.attention.out_proj.bias", "layers/bo", "vector"),
    HFTensor(_H + "ln_2.weight", "layers/mlp_norm"),
    HFTensor(_H + "ln_2.bias", "layers/mlp_norm_b"),
    HFTensor(_H + "mlp.c_fc.weight", "layers/w_in", "linear"),
    HFTensor(_H + "mlp.c_fc.bias", "layers/b_in", "vector"),
    HFTensor(_H + "mlp.c_proj.weight", "layers/w_out", "linear"),
    HFTensor(_H + "mlp.c_proj.bias", "layers/b_out", "vector"),
    HFTensor("transformer.ln_f.weight", "final_norm"),
    HFTensor("transformer.ln_f.bias", "final_norm_b"),
    HFTensor("lm_head.weight", "lm_head", "linear", tied=True),
)
# The causal / local mask buffers older checkpoints carry.
HF_IGNORED = (r"transformer\.h\.\d+\.attn\.attention\.(masked_)?bias",)


# --- Forward ----------------------------------------------------------------------------------


def forward(
    config: GPTNeoConfig,
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
    eps = c.layer_norm_epsilon
    local_L = jnp.asarray(np.array([kind == "local" for kind in c.attention_layers]))
    local_mask = window_mask(mask, positions, c.window_size)

    def layer(x_BTE, xs):
        p, is_local, cache_k, cache_v = xs
        q, k, v = project_qkv(layer_norm(x_BTE, p["attn_norm"], p["attn_norm_b"], eps), p)
        layer_mask = jnp.where(is_local, local_mask, mask)
        attn = attention(q, k, v, cache_k, cache_v, layer_mask, 1.0)  # no 1/sqrt(H)
        x_BTE = x_BTE + attention_out(attn, p)
        h = layer_norm(x_BTE, p["mlp_norm"], p["mlp_norm_b"], eps)
        return x_BTE + dense_mlp(h, p, act), (k, v)

    x = params["embed"][tokens]
    x = x + lookup(params["positions"], positions).astype(x.dtype)
    caches = (None, None) if cache is None else cache.stacked()
    xs = (params["layers"], local_L, *caches)
    x, (new_k, new_v), streams = scan_layers(layer, x, xs, features)
    streams.append(x)
    x = layer_norm(x, params["final_norm"], params["final_norm_b"], eps)
    logits = output_logits(x, params, c.tie_word_embeddings)
    return with_features(logits, KVBlock(k=new_k, v=new_v), streams, features)
