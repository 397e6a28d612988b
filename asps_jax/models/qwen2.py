"""Qwen2 and Qwen2.5 (``model_type`` "qwen2"): Llama with biased q/k/v projections.

The forward, parameters and tensor table are the shared RoPE decoder's (``decoder.py``). A
sliding window is used only when ``use_sliding_window`` is true (released Qwen2.5 checkpoints set
it false), on the layers from ``max_window_layers`` on, or as ``layer_types`` says.
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

MODEL_TYPE = "qwen2"
ARCHITECTURE = "Qwen2ForCausalLM"


@dataclasses.dataclass(frozen=True)
class Qwen2Config(decoder.DecoderConfig):
    MODEL_TYPE = MODEL_TYPE
    ARCHITECTURE = ARCHITECTURE
    QKV_BIAS = True

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Qwen2Config:
        return cls(**sliding_fields(d, decoder.hf_fields(d, MODEL_TYPE)))

    def to_hf(self) -> dict[str, Any]:
        return {**super().to_hf(), **sliding_hf(self)}


def sliding_fields(d: dict, fields: dict) -> dict:
    """Qwen's window keys: ``use_sliding_window``, ``sliding_window``, ``max_window_layers``."""
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config: hidden_act {d['hidden_act']!r} unsupported (only 'silu')")
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    first = int(d.get("max_window_layers", 28))
    types = decoder.window_layers(d, fields["num_hidden_layers"], window, lambda i: i >= first)
    return dict(fields, sliding_window=window, layer_types=types)


def sliding_hf(config: decoder.DecoderConfig) -> dict:
    sliding = [i for i in range(config.num_hidden_layers) if config.is_sliding(i)]
    return {
        "use_sliding_window": config.sliding_window is not None,
        "max_window_layers": sliding[0] if sliding else config.num_hidden_layers,
    }


CONFIG_CLASS = Qwen2Config
config_from_hf = Qwen2Config.from_hf
HF_TENSORS = decoder.hf_tensors(Qwen2Config)
