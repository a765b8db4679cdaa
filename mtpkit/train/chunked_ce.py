"""Linear + cross-entropy over chunks of tokens, so that no [N, V] logits tensor is ever held.

At large vocabularies the logits are the biggest activation of a step (Qwen3.5: [8192, 248320] fp32 is 8 GB,
and every MTP depth adds one). Forward keeps only running sums; backward recomputes each chunk's logits and
turns them into gradients at once, so peak memory is O(chunk x V) whatever N and the number of depths.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Shard


def forward_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the forward's matmuls run in: autocast does not reach inside backward, so the forward records
    its choice and backward reapplies it."""
    dev = hidden.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype


class ChunkLogits:
    """Each chunk's logits [c, V], in at least fp32 for the softmax statistics, written into two buffers reused by
    every chunk of a pass (the product in the weight's dtype and its fp32 copy): fresh [chunk, V] tensors per chunk
    cost more in page faults and copies than the arithmetic done on them. A call's result is valid until the next
    call, and the caller may overwrite it."""

    def __init__(self, w: torch.Tensor, rows: int):
        self.w = w
        self.product = w.new_empty(rows, w.shape[0])
        acc = torch.promote_types(w.dtype, torch.float32)
        self.logits = self.product if acc == w.dtype else self.product.new_empty(self.product.shape, dtype=acc)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        c = h.shape[0]
        product = torch.mm(h.to(self.w.dtype), self.w.T, out=self.product[:c])
        return product if self.logits is self.product else self.logits[:c].copy_(product)

    def in_weight_dtype(self, g: torch.Tensor) -> torch.Tensor:
        """A call's result g [c, V], as changed in place by the caller, in the weight's dtype (in the product
        buffer), ready for the backward's products."""
        return g if self.logits is self.product else self.product[: g.shape[0]].copy_(g)


class _VocabShard:
    """The rows of the output weight held here: all of them on one device; under tensor parallelism (a DTensor
    sharded on the vocabulary, mtpkit.parallel.tp) this rank's [V/tp, H] slice, with per-token statistics reduced
    over the shards (Megatron-LM's vocabulary-parallel cross-entropy: a max, two sums and a min of [chunk] vectors
    per chunk instead of gathering [chunk, V] logits)."""

    def __init__(self, weight: torch.Tensor):
        self.dtensor = isinstance(weight, DTensor)
        self.weight = weight.to_local() if self.dtensor else weight
        self.vocab = weight.shape[0]
        self.offset = 0
        if self.dtensor:
            if weight.placements != (Shard(0),) or self.vocab % weight.device_mesh.size():
                raise ValueError(f"a DTensor output weight must be sharded evenly on the vocabulary (Shard(0)), not "
                                 f"{weight.placements} over {self.vocab} rows")
            self.mesh, self.placements = weight.device_mesh, weight.placements
            self.offset = self.mesh.get_local_rank() * self.weight.shape[0]

    def reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        if not self.dtensor:
            return x
        return DTensor.from_local(x, self.mesh, [Partial(op)], run_check=False).full_tensor()

    def as_weight_grad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self.dtensor:
            return grad
        return DTensor.from_local(grad, self.mesh, self.placements, run_check=False, shape=weight.shape,
                                  stride=weight.stride())

    def targets(self, t: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(column of each target in the local logits, clamped; whether the target is a valid row held here)."""
        local = t - self.offset
        here = valid & (local >= 0) & (local < self.weight.shape[0])
        return local.clamp(0, self.weight.shape[0] - 1), here


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, ignore_index: int):
        dtype = forward_dtype(hidden)
        shard = _VocabShard(weight)
        with torch.autocast(hidden.device.type, enabled=False):
            chunk_logits = ChunkLogits(shard.weight.to(dtype), min(chunk, hidden.shape[0]))
            loss_sum = hidden.new_zeros((), dtype=torch.promote_types(dtype, torch.float32))
            n_valid = torch.zeros((), dtype=torch.long, device=hidden.device)
            n_correct = torch.zeros_like(n_valid)
            lse = []
            for s in range(0, hidden.shape[0], chunk):
                logits = chunk_logits(hidden[s : s + chunk])  # [c, V] (here: [c, V/tp])
                t = targets[s : s + chunk]
                valid = t != ignore_index
                col, here = shard.targets(t, valid)
                local_top, arg = logits.max(-1)
                top = shard.reduce(local_top, "max")
                target_logit = torch.where(here, logits.gather(1, col[:, None])[:, 0], 0.0)
                sums = shard.reduce(torch.stack([logits.sub_(top[:, None]).exp_().sum(-1), target_logit]), "sum")
                lse.append(top + sums[0].log())
                loss_sum += torch.where(valid, lse[-1] - sums[1], 0.0).sum()
                n_valid += valid.sum()
                # the first maximal column over the whole vocabulary, as argmax picks it
                first = shard.reduce(torch.where(local_top == top, arg + shard.offset, shard.vocab), "min")
                n_correct += (valid & (first == t)).sum()
        ctx.save_for_backward(hidden, weight, targets, torch.cat(lse) if lse else hidden.new_zeros(0))
        ctx.chunk, ctx.ignore_index, ctx.dtype = chunk, ignore_index, dtype
        ctx.mark_non_differentiable(n_valid, n_correct)
        return loss_sum, n_valid, n_correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_valid, _grad_correct):
        hidden, weight, targets, lse = ctx.saved_tensors
        shard = _VocabShard(weight)
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(shard.weight, dtype=torch.promote_types(shard.weight.dtype, torch.float32)) \
            if need_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = shard.weight.to(ctx.dtype)
            chunk_logits = ChunkLogits(w, min(ctx.chunk, hidden.shape[0]))
            for s in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[s : s + ctx.chunk]
                t = targets[s : s + ctx.chunk]
                valid = t != ctx.ignore_index
                col, here = shard.targets(t, valid)
                # d(sum of nll)/d(logits) = softmax - onehot(target), zero on ignored rows: each row's factor
                # (0 or grad_loss) is applied to the [c, H] sides of the products, not to the [c, V] gradient
                g = chunk_logits(h).sub_(lse[s : s + ctx.chunk, None]).exp_()
                g = g.scatter_add_(1, col[:, None], -here[:, None].to(g.dtype))
                g = chunk_logits.in_weight_dtype(g)  # [c, V] (here: [c, V/tp])
                scale = (valid * grad_loss)[:, None]
                if need_h:
                    grad_h[s : s + ctx.chunk] = (g @ w) * scale  # a partial sum over the vocabulary shards
                if need_w:
                    grad_w += g.T @ (h * scale).to(ctx.dtype)
        if need_h:
            grad_h = shard.reduce(grad_h, "sum")
        if need_w:
            grad_w = shard.as_weight_grad(grad_w.to(weight.dtype), weight)
        return grad_h, grad_w, None, None, None


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
