"""Tiny random models whose MTP head drafts well but not perfectly, so speculative tests see both accepted and
rejected drafts: one config per text family (vocab 32) and prompts for them."""

from __future__ import annotations

import torch

import mtpkit

_BASE = dict(vocab_size=32, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, rms_norm_eps=1e-6, max_position_embeddings=256, mtp_num_hidden_layers=1)
_GDN = dict(head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
CONFIGS = {
    "qwen3_5": dict(_BASE, **_GDN, model_type="qwen3_5_text", rope_parameters=dict(_ROPE, mrope_section=[2, 1, 1])),
    "qwen3_5_moe": dict(_BASE, **_GDN, **_MOE, model_type="qwen3_5_moe_text",
                        rope_parameters=dict(_ROPE, mrope_section=[2, 1, 1])),
    "qwen3_next": dict(_BASE, **_GDN, **_MOE, model_type="qwen3_next", decoder_sparse_step=2, mlp_only_layers=[2],
                       rope_parameters=_ROPE),
    "llama": dict(_BASE, head_dim=16, num_hidden_layers=3, model_type="llama"),
    # untied: with a tied lm_head this construction would only ever repeat the last token
    "qwen3": dict(_BASE, head_dim=16, num_hidden_layers=3, model_type="qwen3"),
}


def make_drafting(model, noise: float = 0.17, seed: int = 0, never: list[int] = ()):
    """In place, on any model with an untied lm_head (and an MTP module, or parallel heads left random):
    embeddings of std 1 dominate the residual stream and lm_head row v is the embedding of a random predecessor
    of v, so the trunk is close to a bigram model that walks a random permutation; the MTP's fc reads the
    embedding half, so its draft for token i+2 is the walk's successor of token i+1. The trunk's other weights
    (a vision tower's too) are random with std `noise`, which sets how often the trunk departs from the walk,
    i.e. how many drafts are rejected. Tokens in `never` get a zero lm_head row, so greedy decoding never emits
    them (e.g. image placeholders)."""
    torch.manual_seed(seed)
    h, V = model.config.hidden_size, model.config.vocab_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05 if name.startswith("mtp.") else noise)
        E = model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.copy_(E[torch.randperm(V).argsort()] / h**0.5)
        model.lm_head.weight[list(never)] = 0
        if model.mtp is not None:
            model.mtp.fc.weight.add_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
    return model.eval()


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [30, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]]


def drafting_model(family: str, mtp_layers: int = 1, noise: float = 0.17, seed: int = 0):
    """A tiny random model (vocab 32) whose MTP head drafts well but not perfectly (see `make_drafting`)."""
    torch.manual_seed(seed)
    return make_drafting(mtpkit.build_model(dict(CONFIGS[family], mtp_num_hidden_layers=mtp_layers)), noise, seed)


def parallel_drafting_model(family: str, heads: int = 3, noise: float = 0.14, seed: int = 0):
    """A tiny model (vocab 32) with `heads` parallel heads that draft well but not perfectly: the trunk of
    `make_drafting`, and heads trained for 60 Adam steps (MTP-only, about a second) on the trunk's own greedy
    continuations of 32 random prompts, from its stored hidden states. Head j must learn the walk's (j+1)-th
    successor; `noise` sets how often the trunk departs from the walk, i.e. how many drafts are rejected."""
    from mtpkit.train.config import MTPSection
    from mtpkit.train.loss import freeze_trunk, shift_labels
    from mtpkit.train.parallel_heads_loss import parallel_heads_loss

    torch.manual_seed(seed)
    raw = dict(CONFIGS[family], mtp_num_hidden_layers=0, mtp_parallel_heads=heads)
    model = freeze_trunk(make_drafting(mtpkit.build_model(raw), noise, seed))
    prompts = torch.randint(0, model.config.vocab_size, (32, 4), generator=torch.Generator().manual_seed(seed))
    ids = torch.cat([prompts, torch.tensor(mtpkit.generate(model, prompts, max_new_tokens=16).tokens)], dim=1)
    with torch.no_grad():
        batch = {"input_ids": ids, "labels": shift_labels(ids), "hidden": model(ids, return_logits=False).hidden}
    opt = torch.optim.Adam(model.mtp_heads.parameters(), lr=1e-2)
    for _ in range(60):
        parallel_heads_loss(model, batch, MTPSection(depth=heads, kind="parallel", only=True, weights=[1.0] * heads),
                            with_main=False, backward=True)
        opt.step()
        opt.zero_grad()
    return model.eval()


def assert_greedy_is_full_forward_argmax(model, prompts, outputs) -> None:
    """Each decoded token is the argmax of a full forward (no cache) over its prompt and the tokens before it."""
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            ids = list(prompt)
            for t in out:
                assert t == model(torch.tensor([ids])).logits[0, -1].argmax().item(), (ids, t)
                ids.append(t)
