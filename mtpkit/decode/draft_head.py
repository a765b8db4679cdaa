"""`DraftHead`: the lm_head a drafter turns its hidden states into drafts with (any head kind, over the whole
vocabulary or a draft vocabulary), optionally gated by confidence; `frequent_tokens` picks a draft vocabulary."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..kernels.linear import linear
from .matmul_routing import weight_version
from .sampling import SamplingParams, probs, sample


def frequent_tokens(token_ids: Iterable, n: int) -> torch.Tensor:
    """The n most frequent ids (most frequent first) in an iterable of ids or of id sequences (documents),
    to use as `draft_vocab`."""
    counts = Counter()
    for item in token_ids:
        counts.update(torch.as_tensor(item).flatten().tolist())
    if not counts:
        raise ValueError("frequent_tokens got no token ids to count")
    return torch.tensor([t for t, _ in counts.most_common(n)], dtype=torch.long)


# output weight -> (its version, the draft vocabulary, its rows), dropped with the weight
_DRAFT_ROWS = WeakIdKeyDictionary()


def _draft_rows(weight: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """weight[vocab] [N, H], made once per weight and vocabulary, not per generate call: the copy cost the first
    call of a process ~90 ms (first touch of 19 MB for SmolLM2's 8,192 ids), 7% of a 128-token chat answer.
    An fp32 CPU copy is rounded to bf16 values, which the decode router streams from a bf16 copy: half the bytes
    of each draft depth's projection; only q changes (by rounding), which verification corrects. An in-place
    change of the weight (training, load_state_dict) bumps its version, and the rows are made again (a weight made
    under inference_mode has no version counter: its rows are kept, as the decode router keeps its copies)."""
    version = weight_version(weight)
    kept = _DRAFT_ROWS.get(weight)
    if kept is not None and kept[0] == version and torch.equal(kept[1], vocab):
        return kept[2]
    rows = weight[vocab]
    if rows.dtype == torch.float32 and rows.device.type == "cpu":
        rows = rows.bfloat16().float()
    _DRAFT_ROWS[weight] = (version, vocab, rows)
    return rows


class DraftHead:
    """The lm_head used for drafting: the full output weight, or only the rows of a reduced draft vocabulary.
    Drafting from a subset changes only q (zero outside it), which rejection sampling corrects exactly.

    min_prob > 0 gates drafting by confidence (llama.cpp's `p_min`, EAGLE-2's confidence, transformers'
    `assistant_confidence_threshold`): the head probability of a draft is q(d), the draft distribution's
    probability of the token drafted (greedy: its top-1 probability, softmax at temperature 1 over the draft
    vocabulary). Sampling uses q(d), not max q: a draw from q's tail is unlikely to be accepted however peaked q
    is, and EAGLE-2 finds q(d) tracks the acceptance rate. The rule reads only the draft side, so output
    stays exact."""

    def __init__(self, model, params: SamplingParams, vocab: torch.Tensor | None = None, min_prob: float = 0.0):
        self.params, self.min_prob = params, float(min_prob)
        self.vocab_size = model.config.vocab_size
        weight = model.output_weight
        # a quantised model drafts with its int8 projection too (half the bytes; verification decides anyway)
        self.projection = model.output_projection
        self.vocab = None
        if vocab is not None:
            vocab = torch.as_tensor(vocab, dtype=torch.long, device=weight.device).flatten()
            if vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= self.vocab_size:
                raise ValueError(f"draft_vocab must hold token ids in [0, {self.vocab_size}) and not be empty")
            self.vocab = vocab.unique()
            if self.projection is None:
                weight = _draft_rows(weight, self.vocab)
            else:
                self.projection = self.projection.rows(self.vocab)
        self.weight = weight

    def __call__(self, hidden: torch.Tensor, generator, width: int = 1) -> HeadDraft:
        """MTP output [B, H] -> one draft per row, its q, its gate, for width w > 1 the w - 1 next most likely ids,
        and its probability under the head (see `HeadDraft`)."""
        logits = linear(hidden, self.weight) if self.projection is None else self.projection(hidden)  # [B, V or N]
        if self.params.greedy:
            top = logits.topk(width, dim=-1).indices if width > 1 else logits.argmax(dim=-1, keepdim=True)
            idx, others = top[:, 0], (self._ids(top[:, 1:]) if width > 1 else None)
            # softmax at the argmax = exp(max - logsumexp): one pass over the draft vocabulary
            confidence = (logits.gather(1, idx[:, None])[:, 0].float() - logits.float().logsumexp(dim=-1)).exp()
            q = None
        else:
            q = probs(logits, self.params)
            idx = sample(q, generator)
            confidence = q.gather(1, idx[:, None])[:, 0]
            # the most likely ids besides the one drawn (q of the drawn one set below any probability)
            others = self._ids(q.scatter(1, idx[:, None], -1.0).topk(width - 1, dim=-1).indices) if width > 1 else None
            if self.vocab is not None:
                q = q.new_zeros(q.shape[0], self.vocab_size).index_copy_(1, self.vocab, q)
        sure = confidence >= self.min_prob if self.min_prob else None
        return HeadDraft(self._ids(idx), q, sure, others, confidence)

    def top(self, hidden: torch.Tensor) -> torch.Tensor:
        """MTP outputs [..., H] -> the head's most likely token id at each."""
        logits = linear(hidden, self.weight) if self.projection is None else self.projection(hidden)
        return self._ids(logits.argmax(dim=-1))

    def _ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into the drafting rows -> token ids."""
        return idx if self.vocab is None else self.vocab[idx]


class HeadDraft(NamedTuple):
    ids: torch.Tensor  # [B] the draft of each row
    q: torch.Tensor | None  # [B, V] the draft distribution over the full vocabulary; None when greedy
    sure: torch.Tensor | None  # [B] bool, when gating: the draft is confident enough to draft on after it
    others: torch.Tensor | None  # [B, w - 1] the next most likely ids, most likely first, for a draft tree
    confidence: torch.Tensor  # [B] the head's probability of the draft (greedy: its top-1 probability)
