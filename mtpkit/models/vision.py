"""The Qwen3-VL / Qwen3.5 vision tower: patches in, one LLM-sized embedding per 2x2 merged patch out.

Parameter names are the checkpoint's (under `model.visual.`): `patch_embed.proj`, `pos_embed`, `blocks.{j}`,
`merger`, and for Qwen3-VL `deepstack_merger_list.{k}`. Qwen3.5 is the same tower without DeepStack.
Patches arrive as the HF processor makes them: rows of (C, T, p, p) values, each image or frame in merge-window
order (for every 2x2 window, its four patches in raster order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_ACTS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def vision_config_from_hf(raw: dict) -> VisionConfig:
    """From a VLM config.json's `vision_config`. The HF Qwen3-VL class defaults DeepStack to [8, 16, 24]."""
    v = raw["vision_config"]
    default_ds = (8, 16, 24) if raw.get("model_type", "").startswith("qwen3_vl") else ()
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in _ACTS:
        raise ValueError(f"vision hidden_act '{act}' is not supported; supported: {', '.join(_ACTS)}")
    return VisionConfig(
        depth=v["depth"],
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_heads=v["num_heads"],
        out_hidden_size=v["out_hidden_size"],
        patch_size=v.get("patch_size", 16),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        in_channels=v.get("in_channels", 3),
        num_position_embeddings=v.get("num_position_embeddings", 2304),
        deepstack_visual_indexes=tuple(v.get("deepstack_visual_indexes", default_ds) or ()),
        hidden_act=act,
        rope_theta=(v.get("rope_parameters") or {}).get("rope_theta", v.get("rope_theta", 10000.0)),
    )


def check_grid(pixel_values: torch.Tensor, grid_thw: torch.Tensor, config: VisionConfig, what: str = "image") -> None:
    """A clear error when the patches and their grid disagree (instead of a reshape error deep inside)."""
    if grid_thw is None:
        raise ValueError(f"{what} pixels were given without their {what}_grid_thw")
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"{what}_grid_thw must be [n, 3] (t, h, w per {what}), got shape {tuple(grid_thw.shape)}")
    if pixel_values.dim() != 2 or pixel_values.shape[1] != config.patch_dim:
        raise ValueError(
            f"{what} pixel values must be [patches, {config.patch_dim}] (C*T*p*p = {config.in_channels}*"
            f"{config.temporal_patch_size}*{config.patch_size}*{config.patch_size}), got {tuple(pixel_values.shape)}"
        )
    m = config.spatial_merge_size
    if bool(((grid_thw[:, 1:] % m) != 0).any()) or bool((grid_thw <= 0).any()):
        raise ValueError(f"{what}_grid_thw {grid_thw.tolist()}: h and w must be positive multiples of {m}")
    n = int(grid_thw.prod(-1).sum())
    if n != pixel_values.shape[0]:
        raise ValueError(
            f"{what}_grid_thw {grid_thw.tolist()} describes {n} patches but the pixel values hold "
            f"{pixel_values.shape[0]}: the grid does not match the pixels"
        )


def merge_order(h: int, w: int, m: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of an h x w grid, listed in merge-window order: [h*w] each."""
    raster = torch.arange(h * w, device=device).reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
    return raster // w, raster % w


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        k = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel_size=k, stride=k, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # kernel == stride == the patch, so the conv is a matmul over the flattened (C, T, p, p) patch
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)  # [N, Cv]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.num_heads = c.num_heads
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor, rope, seqlens: list[int]) -> torch.Tensor:
        """x [N, Cv]; rope = (cos, sin) [N, d]; bidirectional attention inside each of the `seqlens` runs."""
        N = x.shape[0]
        q, k, v = self.qkv(x).view(N, 3, self.num_heads, -1).unbind(1)  # [N, heads, d]
        cos, sin = (t[:, None].float() for t in rope)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, N, d]
        if len(set(seqlens)) == 1:  # one image, or frames of one size: a single batched call
            S, L = len(seqlens), seqlens[0]
            q, k, v = (t.reshape(self.num_heads, S, L, -1).transpose(0, 1) for t in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(self.num_heads, N, -1)
        else:
            o = torch.cat([
                F.scaled_dot_product_attention(*parts)
                for parts in zip(q.split(seqlens, 1), k.split(seqlens, 1), v.split(seqlens, 1))
            ], dim=1)
        return self.proj(o.transpose(0, 1).reshape(N, -1))


class VisionMLP(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.approximate = _ACTS[c.hidden_act]
        self.linear_fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.linear_fc2 = nn.Linear(c.intermediate_size, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.attn = VisionAttention(c)
        self.mlp = VisionMLP(c)

    def forward(self, x, rope, seqlens):
        x = x + self.attn(self.norm1(x), rope, seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """2x2 patches -> one LLM embedding. DeepStack mergers normalise after the shuffle (over 4*Cv)."""

    def __init__(self, c: VisionConfig, postshuffle_norm: bool = False):
        super().__init__()
        self.dim = c.hidden_size * c.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.dim if postshuffle_norm else c.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.dim, self.dim)
        self.linear_fc2 = nn.Linear(self.dim, c.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.dim)) if self.postshuffle_norm else self.norm(x).view(-1, self.dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        c = config
        self.patch_embed = PatchEmbed(c)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.side = int(c.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c)
        if c.deepstack_visual_indexes:
            self.deepstack_merger_list = nn.ModuleList(PatchMerger(c, True) for _ in c.deepstack_visual_indexes)

    def _grid_tables(self, grid_thw: torch.Tensor, device):
        """Per patch (merge-window order, frames repeated): learned position (bilinear) and 2-D rotary angles."""
        m, side = self.config.spatial_merge_size, self.side
        table = self.pos_embed.weight
        # 2-D RoPE: head_dim/4 frequencies, angles from the row for the first half and the column for the second.
        # Computed here, not held in a buffer, so a meta-device build and a dtype cast leave them exact.
        half = self.config.hidden_size // self.config.num_heads // 2
        exponents = torch.arange(0, half, 2, dtype=torch.float32, device=device) / half
        inv_freq = 1.0 / self.config.rope_theta**exponents
        pos, angles, seqlens = [], [], []
        for t, h, w in grid_thw.tolist():
            rows, cols = merge_order(h, w, m, device)
            # align_corners bilinear sampling of the side x side table at (rows, cols) rescaled to [0, side-1]
            r = rows.float() * (side - 1) / max(h - 1, 1)
            c = cols.float() * (side - 1) / max(w - 1, 1)
            r0, c0 = r.floor().long(), c.floor().long()
            r1, c1 = (r0 + 1).clamp(max=side - 1), (c0 + 1).clamp(max=side - 1)
            fr, fc = (r - r0)[:, None], (c - c0)[:, None]  # fp32 weights: the sum is fp32, as in HF
            p = (
                table[r0 * side + c0] * ((1 - fr) * (1 - fc))
                + table[r0 * side + c1] * ((1 - fr) * fc)
                + table[r1 * side + c0] * (fr * (1 - fc))
                + table[r1 * side + c1] * (fr * fc)
            )
            a = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)  # [h*w, d/2]
            pos.append(p.repeat(t, 1))
            angles.append(a.repeat(t, 1))
            seqlens += [h * w] * t  # attention stays within one frame
        angles = torch.cat(angles)
        emb = torch.cat([angles, angles], dim=-1)
        return torch.cat(pos), (emb.cos(), emb.sin()), seqlens

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [N, C*T*p*p], grid_thw [n, 3] -> (embeddings [N/4, out], DeepStack embeddings, each
        [N/4, out], one per `deepstack_visual_indexes` entry)."""
        check_grid(pixel_values, grid_thw, self.config)
        x = self.patch_embed(pixel_values)
        pos, rope, seqlens = self._grid_tables(grid_thw, x.device)
        x = x + pos.to(x.dtype)
        deepstack = []
        ds_index = self.config.deepstack_visual_indexes
        for j, block in enumerate(self.blocks):
            x = block(x, rope, seqlens)
            if j in ds_index:
                deepstack.append(self.deepstack_merger_list[ds_index.index(j)](x))
        return self.merger(x), deepstack
