"""Qwen3 (``model_type`` "qwen3"): Llama with an RMS norm over ``head_dim`` of every query and
key head (before RoPE), and ``head_dim`` decoupled from ``hidden_size / num_attention_heads``
(Qwen3-0.6B: 1024 / 16 heads, head_dim 128).

The forward, parameters and tensor table are the shared RoPE decoder's (``decoder.py``); the
window keys are Qwen2's (``qwen2.sliding_fields``).
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
from asps_jax.models.qwen2 import sliding_fields, sliding_hf

MODEL_TYPE = "qwen3"
ARCHITECTURE = "Qwen3ForCausalLM"


@dataclasses.dataclass(frozen=True)
class Qwen3Config(decoder.DecoderConfig):
    MODEL_TYPE = MODEL_TYPE
    ARCHITECTURE = ARCHITECTURE
    QK_NORM = True

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Qwen3Config:
        if d.get("attention_bias"):
            raise ValueError("config: attention_bias=true is not supported by this port")
        return cls(**sliding_fields(d, decoder.hf_fields(d, MODEL_TYPE)))

    def to_hf(self) -> dict[str, Any]:
        return {**super().to_hf(), **sliding_hf(self), "attention_bias": False}


CONFIG_CLASS = Qwen3Config
config_from_hf = Qwen3Config.from_hf
HF_TENSORS = decoder.hf_tensors(Qwen3Config)
