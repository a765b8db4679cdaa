"""mtpkit: multi-token prediction for Qwen3.5, Qwen3-VL and Llama-family models."""

from .checkpoint.hf import CheckpointError, build_model, load_model, save_model
from .decode.generate import generate
from .models.config import ModelConfig, config_from_hf
from .models.mtp import add_mtp
from .models.transformer import CausalLM, ModelOutput

__all__ = [
    "CausalLM",
    "CheckpointError",
    "ModelConfig",
    "ModelOutput",
    "add_mtp",
    "build_model",
    "config_from_hf",
    "generate",
    "load_model",
    "save_model",
]
__version__ = "0.1.0"
