"""Gated DeltaNet token mixer (Yang et al. 2024, "Gated Delta Networks"), as used by Qwen3.5 and Qwen3-Next.

Qwen3.5 stores flat projections (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`); Qwen3-Next stores them
fused and grouped per key head (`in_proj_qkvz`, `in_proj_ba`). Both feed the same conv + delta-rule core.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.causal_conv import causal_conv1d
from ..kernels.gated_delta_rule import gated_delta_rule, recurrent_gated_delta_rule
from ..kernels.linear import Linear
from .config import ModelConfig
from .layers import GatedRMSNorm


def segment_boundaries(segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For packed rows [B, T]: a flat id per token that differs across rows and documents, and cu_seqlens [N+1]."""
    B, T = segment_ids.shape
    flat = (segment_ids + torch.arange(B, device=segment_ids.device)[:, None] * (segment_ids.max() + 1)).flatten()
    starts = torch.nonzero(torch.diff(flat, prepend=flat[:1] - 1)).flatten()
    cu = torch.cat([starts, starts.new_tensor([flat.numel()])])
    return flat, cu


def segment_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, flat_ids: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over one packed row x [C, N] that never reads across a document boundary."""
    K = weight.shape[-1]
    y = x * weight[:, K - 1 : K]
    for j in range(1, K):  # tap j reads x[t - j] only when it lies in t's document
        same = torch.zeros_like(flat_ids, dtype=torch.bool)
        same[j:] = flat_ids[j:] == flat_ids[:-j]
        shifted = F.pad(x[:, :-j], (j, 0)) * same
        y = y + shifted * weight[:, K - 1 - j : K - j]
    return F.silu(y)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h = config.hidden_size
        self.hk, self.hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.fused = config.fused_gdn_proj
        if self.fused:
            self.in_proj_qkvz = Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = Linear(h, 2 * self.hv, bias=False)
        else:
            self.in_proj_qkv = Linear(h, self.conv_dim, bias=False)
            self.in_proj_z = Linear(h, self.value_dim, bias=False)
            self.in_proj_b = Linear(h, self.hv, bias=False)
            self.in_proj_a = Linear(h, self.hv, bias=False)
        k = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, k, groups=self.conv_dim, padding=k - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():
            self.A_log.copy_(torch.empty(self.hv).uniform_(1.0, 16.0).log())

    def _project(self, x: torch.Tensor):
        """-> qkv [B, T, conv_dim] ordered [q | k | v], z [B, T, Hv, dv], b and a [B, T, Hv]. Head counts come from
        the shapes (-1): under tensor parallelism the projections hold this rank's heads."""
        B, T, _ = x.shape
        if not self.fused:
            z = self.in_proj_z(x).view(B, T, -1, self.dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = self.hv // self.hk  # value heads per key head; rows are grouped per key head
        qkvz = self.in_proj_qkvz(x).view(B, T, -1, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(B, T, -1, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        return qkv, z.reshape(B, T, -1, self.dv), b.reshape(B, T, -1), a.reshape(B, T, -1)

    def forward(self, x: torch.Tensor, state=None, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, H]. `state` (a decode.cache.GDNState) carries conv and recurrent state across calls;
        `segment_ids` [B, T] marks packed documents, whose state is reset at every boundary."""
        B, T, _ = x.shape
        qkv, z, b, a = self._project(x)
        weight = self.conv1d.weight.squeeze(1)  # [C, K]
        cu_seqlens = None
        if segment_ids is not None:
            flat, cu_seqlens = segment_boundaries(segment_ids)
            qkv = segment_causal_conv1d(qkv.reshape(B * T, -1).t(), weight, flat).t().reshape(1, B * T, -1)
        else:
            qkv_t = qkv.transpose(1, 2)  # (B, C, T)
            conv_in = None if state is None else state.conv
            y, conv_out = causal_conv1d(qkv_t, weight, initial_state=conv_in)
            qkv = y.transpose(1, 2)
        n, L = qkv.shape[:2]
        hv = b.shape[-1]  # value heads here: all of them, or this rank's under tensor parallelism
        hk = hv * self.hk // self.hv
        q, k, v = qkv.split([hk * self.dk, hk * self.dk, hv * self.dv], dim=-1)
        q, k = q.reshape(n, L, hk, self.dk), k.reshape(n, L, hk, self.dk)
        v = v.reshape(n, L, hv, self.dv)
        beta = torch.sigmoid(b).reshape(n, L, hv)
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)).reshape(n, L, hv)

        if state is None:
            o, _ = gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens)
        elif state.keep_history:  # verification: keep the state after every token so rollback is a gather
            o, states = recurrent_gated_delta_rule(q, k, v, g, beta, state.recurrent, return_all_states=True)
            state.record(torch.cat([state.conv, qkv_t], dim=-1), states)
        else:
            step = recurrent_gated_delta_rule if T == 1 else gated_delta_rule
            o, final = step(q, k, v, g, beta, state.recurrent)
            state.conv.copy_(conv_out)
            state.recurrent.copy_(final)

        o = self.norm(o.reshape(B, T, hv, self.dv), z)
        return self.out_proj(o.reshape(B, T, -1))
