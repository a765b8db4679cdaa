"""mtpkit: multi-token prediction for Qwen3.5, Qwen3-VL and Llama-family models."""

from .checkpoint.hf import CheckpointError, build_model, load_model, save_model
from .decode.draft_spec import DraftSpec
from .decode.generate import generate
from .decode.int8 import quantize_int8
from .loading import load_for_decoding
from .models.config import ModelConfig, config_from_hf
from .models.mtp import add_mtp
from .models.multimodal import image_inputs, load_processor
from .models.transformer import CausalLM, ModelOutput
from .models.vlm import VisionLanguageModel

__all__ = [
    "CausalLM",
    "CheckpointError",
    "DraftSpec",
    "ModelConfig",
    "ModelOutput",
    "add_mtp",
    "build_model",
    "config_from_hf",
    "VisionLanguageModel",
    "generate",
    "image_inputs",
    "load_for_decoding",
    "load_model",
    "load_processor",
    "quantize_int8",
    "save_model",
]
__version__ = "0.1.0"
