"""The pre-norm decoder layer: a token mixer (full attention or Gated DeltaNet) and an MLP (dense or MoE)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.linear import routed_layer
from ..kernels.packed_attention import PackedCausal
from .attention import Attention
from .config import ModelConfig
from .gated_deltanet import GatedDeltaNet
from .layers import MLP, RMSNorm, SparseMoE, rope_cos_sin


@dataclass
class Context:
    """Per-forward inputs that every layer reads: rotary tables, attention mask, packing and cache slots."""

    rope: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor | PackedCausal | None  # None: causal
    segment_ids: torch.Tensor | None
    cache_positions: torch.Tensor | None


def training_context(config: ModelConfig, positions: torch.Tensor, segment_ids: torch.Tensor | None,
                     dtype: torch.dtype) -> Context:
    """The Context of a forward without a cache: causal attention, kept inside each packed segment."""
    mask = None if segment_ids is None else PackedCausal.from_segments(segment_ids)
    return Context(rope_cos_sin(config, positions, dtype), mask, segment_ids, None)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, moe: bool):
        super().__init__()
        self.config = config  # what the fused decode op (kernels/decode_layer.supports) decides on
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = Attention(config)
        if moe:
            self.mlp = SparseMoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        eps, zc = config.rms_norm_eps, config.zero_centered_norm
        self.input_layernorm = RMSNorm(config.hidden_size, eps, zc)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, zc)

    def forward(self, x: torch.Tensor, ctx: Context, cache=None) -> torch.Tensor:
        fused = routed_layer(self, x, ctx, cache)  # decoding on CPU: the whole layer as one op, where measured faster
        if fused is not None:
            return fused
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, cache, ctx.segment_ids)
        else:
            h = self.self_attn(h, ctx.rope, ctx.mask, cache, ctx.cache_positions)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))
