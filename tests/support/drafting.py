"""Tiny random models whose MTP head drafts well but not perfectly, so speculative tests see both accepted and
rejected drafts."""

from __future__ import annotations

import torch


def make_drafting(model, noise: float = 0.17, seed: int = 0, never: list[int] = ()):
    """In place, on any model with an untied lm_head and an MTP module: embeddings of std 1 dominate the residual
    stream and lm_head row v is the embedding of a random predecessor of v, so the trunk is close to a bigram
    model that walks a random permutation; the MTP's fc reads the embedding half, so its draft for token i+2 is
    the walk's successor of token i+1. The trunk's other weights (a vision tower's too) are random with std
    `noise`, which sets how often the trunk departs from the walk, i.e. how many drafts are rejected. Tokens in
    `never` get a zero lm_head row, so greedy decoding never emits them (e.g. image placeholders)."""
    torch.manual_seed(seed)
    h, V = model.config.hidden_size, model.config.vocab_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05 if name.startswith("mtp.") else noise)
        E = model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.copy_(E[torch.randperm(V).argsort()] / h**0.5)
        model.lm_head.weight[list(never)] = 0
        model.mtp.fc.weight.add_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
    return model.eval()
