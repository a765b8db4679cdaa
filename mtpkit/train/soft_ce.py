"""Chunked soft cross-entropy against a stored top-k teacher distribution (self-distillation of an MTP head).

The teacher (the trunk) gives p over its top-k ids at each target; the mass it puts elsewhere, 1 - sum(p), is kept
as one "rest" bucket whose student probability is the student's mass on every id outside the top-k (EAGLE-3 and
Medusa-2 train drafters on the target model's own distribution). Per row:

    loss = -sum_j p_j log q(id_j) - p_rest log q(rest),   q = softmax(hidden @ weight.T)

which is KL(p || q) plus p's entropy, a constant. As in chunked_ce, forward keeps running sums only and backward
recomputes each chunk's logits: d loss / d logits = q - scatter(p) - p_rest * softmax(logits outside the top-k).
"""

from __future__ import annotations

import torch

from .chunked_ce import ChunkLogits, forward_dtype


def _chunk_terms(logits, ids, p, valid):
    """logits [c, V] (fp32), ids [c, k] (-1: absent), p [c, k], valid [c] -> (loss [c], rest log-softmax [c, V]
    or None, p_rest [c]). Absent ids carry p = 0 and count in the rest bucket."""
    present = ids >= 0
    p = torch.where(present & valid[:, None], p, 0.0)
    idc = ids.clamp(min=0)
    lse = logits.logsumexp(-1)
    logq = logits.gather(1, idc) - lse[:, None]  # [c, k]
    inside = torch.zeros_like(logits, dtype=torch.long).scatter_add_(1, idc, present.long()) > 0
    rest_logits = logits.masked_fill(inside, float("-inf"))
    rest_lse = rest_logits.logsumexp(-1)
    # no id outside the top-k (k = V): no rest bucket, whatever mass rounding leaves for it
    p_rest = torch.where(valid & rest_lse.isfinite(), (1.0 - p.sum(-1)).clamp(min=0.0), 0.0)
    rest_term = torch.where(p_rest > 0, p_rest * (rest_lse - lse), 0.0)
    loss = -(p * torch.where(present, logq, 0.0)).sum(-1) - rest_term
    return loss, rest_logits, rest_lse, p, p_rest


class _ChunkedSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, logprobs, valid, chunk: int):
        dtype = forward_dtype(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            chunk_logits = ChunkLogits(weight.to(dtype), min(chunk, hidden.shape[0]))
            loss_sum = hidden.new_zeros((), dtype=torch.promote_types(dtype, torch.float32))
            preds = []
            for s in range(0, hidden.shape[0], chunk):
                logits = chunk_logits(hidden[s : s + chunk])
                sl = slice(s, s + chunk)
                loss, *_ = _chunk_terms(logits, ids[sl], logprobs[sl].to(logits.dtype).exp(), valid[sl])
                loss_sum += loss.sum()
                preds.append(logits.argmax(-1))
        ctx.save_for_backward(hidden, weight, ids, logprobs, valid)
        ctx.chunk, ctx.dtype = chunk, dtype
        argmax = torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long, device=hidden.device)
        ctx.mark_non_differentiable(argmax)
        return loss_sum, argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_argmax):
        hidden, weight, ids, logprobs, valid = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) if need_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(ctx.dtype)
            chunk_logits = ChunkLogits(w, min(ctx.chunk, hidden.shape[0]))
            for s in range(0, hidden.shape[0], ctx.chunk):
                sl = slice(s, s + ctx.chunk)
                h = hidden[sl]
                logits = chunk_logits(h)
                _, rest_logits, rest_lse, p, p_rest = _chunk_terms(logits, ids[sl], logprobs[sl].to(logits.dtype).exp(),
                                                                   valid[sl])
                total = p.sum(-1) + p_rest  # 1 on valid rows (0 elsewhere), up to the teacher's rounding
                g = logits.softmax(-1) * total[:, None]
                g.scatter_add_(1, ids[sl].clamp(min=0), -p)
                rest_q = torch.where(p_rest[:, None] > 0, (rest_logits - rest_lse[:, None]).exp(), 0.0)
                g = ((g - p_rest[:, None] * rest_q) * grad_loss).to(ctx.dtype)  # [c, V]
                if need_h:
                    grad_h[sl] = g @ w
                if need_w:
                    grad_w += g.T @ h.to(ctx.dtype)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def chunked_soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor,
                               valid: torch.Tensor, chunk_tokens: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft CE of logits = hidden @ weight.T against a top-k teacher, without materialising all the logits.

    hidden [N, H], weight [V, H]; ids [N, k] teacher ids as columns of weight (-1: absent, e.g. outside a draft
    vocabulary: its mass joins the rest bucket), logprobs [N, k] their teacher log-probabilities; valid [N] bool
    rows that count. Returns (loss_sum, argmax [N]): the summed loss (differentiable w.r.t. hidden and weight)
    and the student's top-1 column per row (for accuracy against hard targets).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, not {chunk_tokens}")
    return _ChunkedSoftCE.apply(hidden, weight, ids, logprobs, valid, chunk_tokens)
