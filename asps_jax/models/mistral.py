"""Mistral (``model_type`` "mistral"): Llama with a sliding window on every layer when
``sliding_window`` is set (Mistral-7B-v0.1: 4096; v0.2 and later: null, i.e. none).

A query at position ``q`` sees keys at positions ``k`` with ``q - k < sliding_window``
(transformers' mask), intersected with the caller's mask. The forward, parameters and tensor
table are the shared RoPE decoder's (``decoder.py``).
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

MODEL_TYPE = "mistral"
ARCHITECTURE = "MistralForCausalLM"


@dataclasses.dataclass(frozen=True)
class MistralConfig(decoder.DecoderConfig):
    MODEL_TYPE = MODEL_TYPE
    ARCHITECTURE = ARCHITECTURE

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> MistralConfig:
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config: hidden_act {d['hidden_act']!r} unsupported (only 'silu')")
        fields = decoder.hf_fields(d, MODEL_TYPE, bos_token_id=1, eos_token_id=2)
        window = d.get("sliding_window")
        types = decoder.window_layers({}, fields["num_hidden_layers"], window, lambda i: True)
        return cls(**fields, sliding_window=window, layer_types=types)

    def to_hf(self) -> dict[str, Any]:
        d = super().to_hf()
        del d["layer_types"]  # every layer slides when sliding_window is set
        return d


CONFIG_CLASS = MistralConfig
config_from_hf = MistralConfig.from_hf
HF_TENSORS = decoder.hf_tensors(MistralConfig)
