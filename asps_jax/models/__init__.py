"""Model ports (one module per family), the Hugging Face checkpoint loader and the model cards."""

from asps_jax.models.base import (
    FAMILIES,
    IncompatibleModelsError,
    Model,
    check_compatible,
    family_for_config,
    family_for_type,
    forward_for,
)
from asps_jax.models.cards import MissingWeightsError, UnknownModelError, known_aliases
from asps_jax.models.llama import LlamaConfig
from asps_jax.models.loader import CheckpointError, load_model, save_checkpoint

__all__ = [
    "FAMILIES",
    "CheckpointError",
    "IncompatibleModelsError",
    "LlamaConfig",
    "MissingWeightsError",
    "Model",
    "UnknownModelError",
    "check_compatible",
    "family_for_config",
    "family_for_type",
    "forward_for",
    "known_aliases",
    "load_model",
    "save_checkpoint",
]
