"""The documents of a transformers training batch: segment ids for padded and packed rows."""

from __future__ import annotations

import torch
from torch import Tensor



def segment_ids(attention_mask: Tensor | None, position_ids: Tensor | None) -> Tensor | None:
    """[B, T] ids of the contiguous documents of a batch, or None for one unpadded document per row.

    Packed rows (TRL's packing and padding-free collators) start a document wherever position_ids do not step by
    one, as transformers' own packed-sequence detection reads them; padding (attention_mask 0) is a segment of its
    own (id 0), so no target and no MTP attention crosses from a pad into a document or back."""
    seg = None
    if position_ids is not None and position_ids.dim() == 2:
        step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
        if (step != 1).any():
            seg = (step != 1).long().cumsum(-1) + 1
    if attention_mask is not None and attention_mask.dim() == 2 and not attention_mask.bool().all():
        seg = attention_mask.long() * (1 if seg is None else seg)
    return seg

