"""Inference: caches, sampling, plain and MTP self-speculative generation."""

from .draft_head import frequent_tokens
from .draft_spec import DraftSpec
from .generate import GenerateResult, generate

__all__ = ["DraftSpec", "GenerateResult", "frequent_tokens", "generate"]
