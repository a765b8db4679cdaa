"""Full (softmax) attention: GQA, optional QKV bias, QK-norm and the Qwen3.5 sigmoid output gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.linear import Linear
from ..kernels.packed_attention import PackedCausal
from .config import ModelConfig
from .layers import RMSNorm, apply_rotary


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.gated = config.attn_output_gate
        # with the output gate, q_proj yields per head [q_h | gate_h] (not [Q | G])
        self.q_proj = Linear(h, self.n_heads * d * (2 if self.gated else 1), bias=config.qkv_bias)
        self.k_proj = Linear(h, self.n_kv * d, bias=config.qkv_bias)
        self.v_proj = Linear(h, self.n_kv * d, bias=config.qkv_bias)
        self.o_proj = Linear(self.n_heads * d, h, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, config.zero_centered_norm)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, config.zero_centered_norm)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, rope, mask=None, kv_cache=None, cache_positions=None):
        """x [B, T, H]; rope = (cos, sin) [B, T, r]; mask [B, 1, T, S]: bool (True = attend) or additive (0 / -inf),
        a PackedCausal (packed training rows), or None for causal."""
        B, T, _ = x.shape
        # head counts come from the shapes (-1): under tensor parallelism the projections hold this rank's heads
        q = self.q_proj(x).view(B, T, -1, self.head_dim * (2 if self.gated else 1))
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
            gate = gate.reshape(B, T, -1)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if kv_cache is not None:
            k, v = kv_cache.update(cache_positions, k, v, mask.shape[-1])  # [B, S, n_kv, D], S = slots attended
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T|S, D)
        if isinstance(mask, PackedCausal):
            o = mask.attend(q, k, v)
        else:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1]
            )
        o = o.transpose(1, 2).reshape(B, T, -1)
        if self.gated:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)
