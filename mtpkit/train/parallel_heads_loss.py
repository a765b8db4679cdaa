"""Training parallel heads (Gloeckle et al. 2024) with the sequential per-head forward/backward."""

from __future__ import annotations

from ..models.parallel_heads import ParallelHeads
from ..models.transformer import default_positions
from .chunked_ce import chunked_cross_entropy
from .loss import IGNORE, mtp_targets


def parallel_heads_loss_backward(model, heads: ParallelHeads, batch: dict, ce_chunk_tokens: int = 2048) -> dict:
    """Backpropagate sum_j (mean CE of head j), one head at a time (Gloeckle et al. 2024, section 2): the trunk
    runs once and its output becomes a leaf; each head's forward, chunked CE and backward accumulate the gradient
    at that leaf; one backward then carries it through the trunk. Only one head's activations are alive at a time.

    batch: input_ids, labels (train.loss.shift_labels), optional segment_ids and positions, all [B, T].
    Returns {"head_j": detached mean CE} (head_0: the trunk's next-token loss).
    """
    ids, labels, seg = batch["input_ids"], batch["labels"], batch.get("segment_ids")
    pos = batch.get("positions")
    if pos is None:
        pos = default_positions(ids, seg)
    out = model(ids, positions=pos, segment_ids=seg, return_logits=False)
    leaf = out.hidden.detach().requires_grad_()  # [B, T, H]
    ctx = model.context(pos, seg, dtype=leaf.dtype)
    losses = {}
    for j in range(heads.n):
        targets = labels if j == 0 else mtp_targets(labels, seg, j)  # [B, T-j]: same roll as MTP depth j
        h = (leaf if j == 0 else heads(model, leaf, ctx, j))[:, : targets.shape[1]]
        loss_sum, n_valid, _ = chunked_cross_entropy(
            h.reshape(-1, h.shape[-1]), model.output_weight, targets.reshape(-1), ce_chunk_tokens, IGNORE
        )
        loss = loss_sum / n_valid.clamp(min=1)
        loss.backward()  # frees head j's graph; the leaf, the heads and lm_head accumulate their gradients
        losses[f"head_{j}"] = loss.detach()
    out.hidden.backward(leaf.grad)
    return losses
