"""The sequential MTP module (DeepSeek-V3 / Qwen3.5 layout) and `add_mtp` for models released without one."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.linear import Linear
from .block import Context, DecoderLayer, training_context
from .config import ModelConfig
from .init import copy_last_attention_layer, init_weights
from .layers import RMSNorm


def is_mtp_param(name: str) -> bool:
    """Whether a parameter or checkpoint tensor name belongs to a drafting head: the MTP module (`mtp.*`) or the
    parallel heads (`mtp_heads.*`). Wrappers (whole-model compile, FSDP, activation checkpointing) may add a
    prefix, but the module path keeps `mtp.` or `mtp_heads.` as a component."""
    return any(name.startswith(p) or f".{p}" in name for p in ("mtp.", "mtp_heads."))


class MTP(nn.Module):
    """Sequential MTP module (DeepSeek-V3 / Qwen3.5 layout), one full-attention decoder layer per depth:
    norm(layer(fc(cat[pre_fc_norm_embedding(emb(t_{i+d})), pre_fc_norm_hidden(h_i)])))."""

    draft_vocab: torch.Tensor | None = None  # ids the head was trained to draft from (mtp.draft_vocab), if any

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, eps, zc = config.hidden_size, config.rms_norm_eps, config.zero_centered_norm
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zc)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, zc)
        self.fc = Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, "full_attention", config.num_experts > 0)
            for _ in range(config.mtp_num_hidden_layers)
        )
        self.norm = RMSNorm(h, eps, zc)

    def forward(self, embeds, hidden, ctx: Context, depth: int, cache=None) -> torch.Tensor:
        """embeds, hidden [B, T, H] -> post-norm output [B, T, H]. Depth d uses layer min(d, D) - 1."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x = self.layers[min(depth, len(self.layers)) - 1](x, ctx, cache)
        return self.norm(x)


def teacher_forced(mtp: nn.Module, config: ModelConfig, embeds, hidden, positions, segment_ids,
                   depths: int, as_drafted: bool = False) -> list[torch.Tensor]:
    """Teacher-forced outputs of depths 1..depths, [B, T-d, H] each: depth d, row i reads the embedding of token
    i+d (embeds [B, T, H]) and depth d-1's output at row i (the trunk's post-norm hidden [B, T, H] for d = 1), at
    position p_i + d - 1 (vLLM's convention: row i keeps h_i's position, +1 per chained step). positions: [B, T] or
    MRoPE [3, B, T]; segment_ids [B, T] keep attention inside packed documents; config: the trunk's (its rotary).

    Depth d's attention: by default over depth d's own rows 0..i. `as_drafted=True` (one shared MTP layer): over
    what a chained draft step reads from the decode cache, `_DraftedKV`, so that every depth is trained on exactly
    the computation that drafts with it."""
    if as_drafted and len(mtp.layers) != 1:
        raise ValueError(f"as_drafted depths need one shared MTP layer (the decode cache holds depth 1's keys for "
                         f"every row); this module has {len(mtp.layers)}")
    outs, prev = [], hidden
    T = embeds.shape[1]
    drafted = _DraftedKV(segment_ids, T) if as_drafted else None
    for d in range(1, depths + 1):
        n = T - d
        if n <= 0:
            outs.append(hidden.new_zeros(hidden.shape[0], 0, hidden.shape[2]))
            continue
        pos = positions[..., :n] + (d - 1)
        seg = None if segment_ids is None else segment_ids[:, :n]
        ctx = training_context(config, pos, seg, embeds.dtype)
        if drafted is not None:
            ctx = Context(ctx.rope, drafted.mask(d, n, embeds.device), seg, None)
        prev = mtp(embeds[:, d:], prev[:, :n], ctx, d, drafted)
        outs.append(prev)
    return outs


class _DraftedKV:
    """The MTP layer's keys and values as a chained draft reads them, for every row at once (used as the layer's
    cache). Decoding fills the MTP cache with depth 1 over the kept tokens (row j's keys at slot j), and the chain
    from row i writes depth e at slot i + e - 1 and reads every slot up to its own: depth 1's rows 0..i, then its
    own depths 2..d. Depth d here attends to [depth 1's rows | depth 2's | ... | its own], masked to that pattern."""

    def __init__(self, segment_ids, T: int):
        self.k = self.v = None  # [B, S, n_kv, D]: depth 1's T-1 rows, then depth 2's T-2, ...
        self.segment_ids, self.T = segment_ids, T

    def update(self, positions, k, v, length):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)
        return self.k, self.v

    def mask(self, depth: int, n: int, device) -> torch.Tensor:
        """[B or 1, 1, n, S] bool: row i sees depth 1's rows j <= i (in its packed document) and its own rows of
        depths 2..depth."""
        rows = torch.arange(n, device=device)
        first = torch.arange(self.T - 1, device=device)
        history = (first[None, :] <= rows[:, None])[None]  # [1, n, T-1]
        if self.segment_ids is not None:
            seg = self.segment_ids
            history = history & (seg[:, :n, None] == seg[:, None, : self.T - 1])
        own = [(torch.arange(self.T - e, device=device)[None, :] == rows[:, None])[None] for e in range(2, depth + 1)]
        own = [o.expand(history.shape[0], -1, -1) for o in own]
        return torch.cat([history, *own], dim=2)[:, None]


def add_mtp(model: nn.Module, depth: int = 1, init: str = "random") -> nn.Module:
    """Give a model without one (Qwen3-VL, Llama, SmolLM2) an MTP module of `depth` layers, in place (replacing
    any parallel heads it has).

    init="random": normal(0.02) weights, identity norms. init="last_layer": every MTP decoder layer starts as a
    copy of the trunk's last full-attention layer (its MLP too), the rest random.
    """
    if init not in ("random", "last_layer"):
        raise ValueError(f"init must be 'random' or 'last_layer', not {init!r}")
    if depth < 1:
        raise ValueError(f"depth must be >= 1, not {depth}")
    cfg = model.config.replace(mtp_num_hidden_layers=depth, mtp_parallel_heads=0)
    ref = model.model.embed_tokens.weight
    mtp = MTP(cfg).to(device=ref.device, dtype=ref.dtype)
    init_weights(mtp)
    if init == "last_layer":
        copy_last_attention_layer(model, mtp.layers)
    model.config = cfg
    model.mtp = mtp
    model.mtp_heads = None  # a model drafts with one kind of head
    return model
