"""Inference: caches, sampling, plain and MTP self-speculative generation."""

from .generate import GenerateResult, generate
from .speculative import frequent_tokens

__all__ = ["GenerateResult", "frequent_tokens", "generate"]
