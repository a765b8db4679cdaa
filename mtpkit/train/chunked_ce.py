"""Linear + cross-entropy over chunks of tokens, so that no [N, V] logits tensor is ever held.

At large vocabularies the logits are the biggest activation of a step (Qwen3.5: [8192, 248320] fp32 is 8 GB,
and every MTP depth adds one). Forward keeps only running sums; backward recomputes each chunk's logits and
turns them into gradients at once, so peak memory is O(chunk x V) whatever N and the number of depths.
"""

from __future__ import annotations

import torch


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    # autocast does not reach inside backward, so the forward's choice is recorded and reapplied there
    dev = hidden.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype


def _chunk_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # [c, V]; softmax statistics in at least fp32
    return (h.to(w.dtype) @ w.T).to(torch.promote_types(w.dtype, torch.float32))


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, ignore_index: int):
        dtype = _compute_dtype(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            loss_sum = hidden.new_zeros((), dtype=torch.promote_types(dtype, torch.float32))
            n_valid = torch.zeros((), dtype=torch.long, device=hidden.device)
            n_correct = torch.zeros_like(n_valid)
            for s in range(0, hidden.shape[0], chunk):
                logits = _chunk_logits(hidden[s : s + chunk], w)
                t = targets[s : s + chunk]
                valid = t != ignore_index
                tc = t.clamp(min=0)  # ignored rows gather any column, then get masked out
                nll = logits.logsumexp(-1) - logits.gather(1, tc[:, None])[:, 0]
                loss_sum += torch.where(valid, nll, 0.0).sum()
                n_valid += valid.sum()
                n_correct += (valid & (logits.argmax(-1) == tc)).sum()
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk, ctx.ignore_index, ctx.dtype = chunk, ignore_index, dtype
        ctx.mark_non_differentiable(n_valid, n_correct)
        return loss_sum, n_valid, n_correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_valid, _grad_correct):
        hidden, weight, targets = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) if need_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(ctx.dtype)
            for s in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[s : s + ctx.chunk]
                t = targets[s : s + ctx.chunk]
                valid = (t != ctx.ignore_index)[:, None]
                # d(sum of nll)/d(logits) = softmax - onehot(target), zero on ignored rows
                g = _chunk_logits(h, w).softmax(-1)
                g = g.scatter_add_(1, t.clamp(min=0)[:, None], -valid.to(g.dtype))
                g = (g * (valid * grad_loss)).to(ctx.dtype)  # [c, V]
                if need_h:
                    grad_h[s : s + ctx.chunk] = g @ w
                if need_w:
                    grad_w += g.T @ h.to(ctx.dtype)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = 2048,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy of logits = hidden @ weight.T against targets, without materialising all the logits.

    hidden [N, H], weight [V, H], targets [N] (ignore_index rows add nothing). Returns (loss_sum, n_valid,
    n_correct): the summed NLL (differentiable w.r.t. hidden and weight) and, as 0-dim int64 tensors (no host
    sync), the number of valid targets and of valid targets that are the logits' argmax (top-1 accuracy).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, not {chunk_tokens}")
    return _ChunkedCE.apply(hidden, weight, targets, chunk_tokens, ignore_index)
