"""Gemma 2 (``model_type`` "gemma2"), the shared RoPE decoder (``decoder.py``) with:

* RMS norms scaling by ``1 + w``, computed in float32; a norm before *and after* attention and
  the MLP (``input_layernorm`` / ``post_attention_layernorm``, ``pre_feedforward_layernorm`` /
  ``post_feedforward_layernorm``);
* the embedding scaled by ``sqrt(hidden_size)`` (rounded to its dtype) and tied to the head;
* attention scores scaled by ``query_pre_attn_scalar ** -0.5`` (9B: 256 = head_dim; 27B: 144);
* soft-capping, ``cap * tanh(x / cap)``, of the attention scores (50) and the logits (30);
* layers alternating a local sliding window (4096; even layers) and global attention;
* a GELU (tanh) gated MLP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from asps_jax.models import decoder
from asps_jax.models.decoder import (  # noqa: F401  (the family contract's module-level names)
    HF_IGNORED,
    HF_PREFIX,
    forward,
    init_params,
    param_axes,
    param_shapes,
    prepare_params,
)

MODEL_TYPE = "gemma2"
ARCHITECTURE = "Gemma2ForCausalLM"


def gemma_fields(d: dict, model_type: str, default_theta: float, final_cap: float | None) -> dict:
    """What Gemma 2 and Gemma 3 read alike: the activation, the scaling and the capping
    (``final_cap``: transformers' default ``final_logit_softcapping`` of the family)."""
    for flag in ("attention_bias", "use_bidirectional_attention"):
        if d.get(flag):
            raise ValueError(f"config: {flag}=true is not supported by this port")
    fields = decoder.hf_fields(
        d,
        model_type,
        default_theta=default_theta,
        tied=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    return dict(
        fields,
        hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
        query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256),
        final_logit_softcapping=d.get("final_logit_softcapping", final_cap),
    )


def _int_if_whole(x):
    return int(x) if x is not None and float(x).is_integer() else x  # transformers wants an int


def gemma_hf(config: decoder.DecoderConfig) -> dict:
    return {
        "hidden_activation": config.hidden_act,
        "query_pre_attn_scalar": _int_if_whole(config.query_pre_attn_scalar),
        "final_logit_softcapping": config.final_logit_softcapping,
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "attention_bias": False,
    }


@dataclasses.dataclass(frozen=True)
class Gemma2Config(decoder.DecoderConfig):
    MODEL_TYPE = MODEL_TYPE
    ARCHITECTURE = ARCHITECTURE
    GEMMA = True

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Gemma2Config:
        fields = gemma_fields(d, MODEL_TYPE, 10000.0, 30.0)
        window = d.get("sliding_window", 4096)
        types = decoder.window_layers(
            d, fields["num_hidden_layers"], window, lambda i: (i + 1) % 2 != 0
        )
        return cls(
            **fields,
            sliding_window=window,
            layer_types=types,
            attn_logit_softcapping=d.get("attn_logit_softcapping", 50.0),
        )

    def to_hf(self) -> dict[str, Any]:
        return {**super().to_hf(), **gemma_hf(self)}


CONFIG_CLASS = Gemma2Config
config_from_hf = Gemma2Config.from_hf
HF_TENSORS = decoder.hf_tensors(Gemma2Config)
