"""Gemma 3's text decoder (``model_type`` "gemma3_text": Gemma-3-1B and 270M, and the language
model inside the multimodal 4B/12B/27B checkpoints). Gemma 2's decoder (``gemma2.py``) with:

* an RMS norm (``1 + w``) over ``head_dim`` of every query and key head, before RoPE, and no
  attention soft-capping (transformers ignores ``attn_logit_softcapping`` for Gemma 3; so do we);
* five local layers (window 512 at 1B, 1024 above) to one global one (``sliding_window_pattern``
  6, or ``layer_types``); local layers use RoPE base ``rope_local_base_freq`` (10,000) unscaled,
  global ones ``rope_theta`` (1,000,000) with the config's ``rope_scaling`` (linear 8 above 1B);
* no final soft-capping in the released configs (``final_logit_softcapping`` null).

``config.json`` comes in two forms: transformers 4's ``rope_theta`` / ``rope_local_base_freq`` /
``rope_scaling``, and 5's ``rope_parameters`` per layer type; both are read.
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
from asps_jax.models.gemma2 import gemma_fields, gemma_hf

MODEL_TYPE = "gemma3_text"
ARCHITECTURE = "Gemma3ForCausalLM"


@dataclasses.dataclass(frozen=True)
class Gemma3TextConfig(decoder.DecoderConfig):
    MODEL_TYPE = MODEL_TYPE
    ARCHITECTURE = ARCHITECTURE
    GEMMA = True
    QK_NORM = True

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Gemma3TextConfig:
        per_type = d.get("rope_parameters")
        if isinstance(per_type, dict) and "full_attention" in per_type:
            full = per_type.get("full_attention") or {}
            local = per_type.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise ValueError("config: a scaled RoPE on sliding layers is not supported")
            d = dict(d, rope_parameters=full)
            local_theta = local.get("rope_theta", 10000.0)
        else:
            local_theta = d.get("rope_local_base_freq", 10000.0)
        fields = gemma_fields(d, MODEL_TYPE, 1_000_000.0, None)
        window = d.get("sliding_window", 4096)
        pattern = int(d.get("sliding_window_pattern", 6))
        types = decoder.window_layers(
            d, fields["num_hidden_layers"], window, lambda i: (i + 1) % pattern != 0
        )
        return cls(
            **fields, sliding_window=window, layer_types=types, local_rope_theta=float(local_theta)
        )

    def to_hf(self) -> dict[str, Any]:
        d = {**super().to_hf(), **gemma_hf(self)}
        d.update(
            rope_local_base_freq=self.local_rope_theta,
            rope_parameters={
                "full_attention": d["rope_parameters"],
                "sliding_attention": {"rope_type": "default", "rope_theta": self.local_rope_theta},
            },
        )
        return d


CONFIG_CLASS = Gemma3TextConfig
config_from_hf = Gemma3TextConfig.from_hf
HF_TENSORS = decoder.hf_tensors(Gemma3TextConfig)
