"""Model ports (one module per family), the Hugging Face checkpoint loader and the model cards."""

from asps_jax.models.base import (
    FAMILIES,
    FAMILY_MODULES,
    Family,
    Forward,
    IncompatibleModelsError,
    Model,
    ModelConfig,
    check_compatible,
    family_for_config,
    family_for_type,
    forward_for,
)
from asps_jax.models.cards import MissingWeightsError, UnknownModelError, known_aliases
from asps_jax.models.gpt2 import GPT2Config
from asps_jax.models.gpt_neo import GPTNeoConfig
from asps_jax.models.hf_table import HFTensor
from asps_jax.models.llama import LlamaConfig
from asps_jax.models.loader import CheckpointError, load_model, save_checkpoint
from asps_jax.models.opt import OPTConfig

__all__ = [
    "FAMILIES",
    "FAMILY_MODULES",
    "CheckpointError",
    "Family",
    "Forward",
    "GPT2Config",
    "GPTNeoConfig",
    "HFTensor",
    "IncompatibleModelsError",
    "LlamaConfig",
    "MissingWeightsError",
    "Model",
    "ModelConfig",
    "OPTConfig",
    "UnknownModelError",
    "check_compatible",
    "family_for_config",
    "family_for_type",
    "forward_for",
    "known_aliases",
    "load_model",
    "save_checkpoint",
]
