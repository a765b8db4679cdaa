"""Parallel multi-token heads (Gloeckle et al. 2024, "Better & Faster Large Language Models via Multi-token
Prediction") on the shared trunk, drafting for blockwise parallel decoding (Stern et al. 2018). Training with the
per-head sequential backward: `mtpkit.train.parallel_heads_loss`; decoding: `mtpkit.decode.blockwise`.

Head j (0-based) predicts token t+1+j from the trunk at t. Head 0 is the trunk itself (its last layer, final
norm and lm_head), so a pretrained model keeps its exact next-token distribution, which is also the verifier's.
Heads 1..D (`config.mtp_parallel_heads` = D) are one full-attention decoder layer each (mixture-of-experts when
the trunk's MTP layers would be), then the trunk's final norm and the shared unembedding. Unlike the sequential
MTP module, head j never reads a token after t: all D drafts come from one verified hidden state at once.

The heads read the trunk's post-final-norm hidden (`ModelOutput.hidden`), not Gloeckle's pre-norm residual
stream: it is the tensor CausalLM returns in training and in the verify forward alike, and what the sequential
MTP module reads too (docs/MTP.md section 2). Each head's input_layernorm renormalises it anyway.

Checkpoint layout (mtpkit's own: vLLM and SGLang do not serve it): `mtp_heads.layers.{j-1}.*` for head j, and
`mtp_parallel_heads: D` in config.json (`mtp_parallel_intermediate_size` when the heads' MLP width differs).
"""

from __future__ import annotations

import torch
from torch import nn

from .block import DecoderLayer
from .config import ModelConfig
from .init import copy_last_attention_layer, init_weights


class ParallelHeads(nn.Module):
    """Heads 1..D; `layers[j - 1]` is head j. `n` = D + 1 counts the trunk's head too (Gloeckle's n)."""

    draft_vocab: torch.Tensor | None = None  # ids the heads were trained to draft from, as MTP.draft_vocab

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.mtp_parallel_heads < 1:
            raise ValueError(f"mtp_parallel_heads must be >= 1, not {config.mtp_parallel_heads}")
        width = config.mtp_parallel_intermediate_size or config.intermediate_size
        layer_config = config.replace(intermediate_size=width)
        self.layers = nn.ModuleList(
            DecoderLayer(layer_config, "full_attention", config.num_experts > 0)
            for _ in range(config.mtp_parallel_heads)
        )
        init_weights(self)

    @property
    def n(self) -> int:
        return len(self.layers) + 1

    def forward(self, model, hidden: torch.Tensor, ctx, j: int, cache=None) -> torch.Tensor:
        """Head j >= 1 on the trunk's hidden [B, T, H] -> [B, T, H] after the trunk's final norm (row i predicts
        token i+1+j); model.logits of it are the head's logits."""
        return model.model.norm(self.layers[j - 1](hidden, ctx, cache))


def head_outputs(model, hidden: torch.Tensor, positions: torch.Tensor, k: int, cache, cache_positions=None,
                 kv_len: int | None = None) -> torch.Tensor:
    """Heads 1..k over trunk rows hidden [B, T, H] at positions [B, T] (or MRoPE [3, B, T]): [B, T, k, H], row i
    head j predicting token i+1+j. cache: one KV cache per head (`Cache.mtp`), written at `cache_positions`
    (default: the positions); stale slots past them (rejected drafts) are masked and later overwritten."""
    ctx = model.context(positions, cache=cache[0], cache_positions=cache_positions, dtype=hidden.dtype,
                        kv_len=kv_len)
    return torch.stack([model.mtp_heads(model, hidden, ctx, j, cache[j - 1]) for j in range(1, k + 1)], dim=2)


def add_parallel_heads(model: nn.Module, heads: int, init: str = "random", intermediate_size: int = 0) -> nn.Module:
    """Give a model D = `heads` parallel heads in place (replacing any MTP module or heads it has), their MLPs
    `intermediate_size` wide (0: the trunk's width).

    init="random": normal(0.02) weights, identity norms. init="last_layer": every head starts as a copy of the
    trunk's last full-attention layer, so each starts out predicting roughly the next token.
    """
    if init not in ("random", "last_layer"):
        raise ValueError(f"init must be 'random' or 'last_layer', not {init!r}")
    if heads < 1:
        raise ValueError(f"heads must be >= 1, not {heads}")
    cfg = model.config.replace(mtp_num_hidden_layers=0, mtp_parallel_heads=heads,
                               mtp_parallel_intermediate_size=intermediate_size)
    ref = model.model.embed_tokens.weight
    module = ParallelHeads(cfg).to(device=ref.device, dtype=ref.dtype)
    if init == "last_layer":
        if cfg.mtp_parallel_intermediate_size not in (0, cfg.intermediate_size):
            raise ValueError("init='last_layer' copies the trunk's layer, so the heads keep its MLP width: "
                             "remove mtp_parallel_intermediate_size or use init='random'")
        copy_last_attention_layer(model, module.layers)
    model.config = cfg
    model.mtp = None
    model.mtp_heads = module
    return model
