"""Model ports (one module per family), the Hugging Face checkpoint loader and the model cards."""

from asps_jax.models.base import (
    FAMILIES,
    FAMILY_MODULES,
    Family,
    Forward,
    Model,
    ModelConfig,
    family_for_config,
    family_for_type,
    forward_for,
)
from asps_jax.models.cards import MissingWeightsError, UnknownModelError, known_aliases
from asps_jax.models.gemma2 import Gemma2Config
from asps_jax.models.gemma3_text import Gemma3TextConfig
from asps_jax.models.gpt2 import GPT2Config
from asps_jax.models.gpt_neo import GPTNeoConfig
from asps_jax.models.hf_table import HFTensor
from asps_jax.models.llama import LlamaConfig
from asps_jax.models.loader import CheckpointError, load_model, save_checkpoint
from asps_jax.models.mistral import MistralConfig
from asps_jax.models.opt import OPTConfig
from asps_jax.models.own import ContractError, OwnConfig, nnx_model, own_model
from asps_jax.models.qwen2 import Qwen2Config
from asps_jax.models.qwen3 import Qwen3Config
from asps_jax.models.vocab import IncompatibleModelsError, check_compatible

__all__ = [
    "FAMILIES",
    "FAMILY_MODULES",
    "CheckpointError",
    "ContractError",
    "Family",
    "Gemma2Config",
    "Gemma3TextConfig",
    "Forward",
    "GPT2Config",
    "GPTNeoConfig",
    "HFTensor",
    "IncompatibleModelsError",
    "LlamaConfig",
    "MistralConfig",
    "MissingWeightsError",
    "Model",
    "ModelConfig",
    "OPTConfig",
    "OwnConfig",
    "Qwen2Config",
    "Qwen3Config",
    "UnknownModelError",
    "check_compatible",
    "family_for_config",
    "family_for_type",
    "forward_for",
    "known_aliases",
    "load_model",
    "nnx_model",
    "own_model",
    "save_checkpoint",
]
