"""A draft vocabulary at training time (FR-Spec: Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary
Language Models via Frequency-Ranked Speculative Sampling"): the head's CE runs over the N most frequent target
ids of the training data, and the same ids are what it drafts from, so its lm_head costs N/V of the full one.

The trainer writes the ids to run_dir/draft_vocab.json (checkpoint.hf.write_draft_vocab); `mtpkit export` puts them
in the head file (`--mtp-only`) or beside the exported checkpoint.
"""

from __future__ import annotations

import numpy as np
import torch


def draft_vocabulary(target_ids, n: int, vocab_size: int) -> torch.Tensor:
    """The n most frequent ids among target_ids (ties to the lower id), sorted ascending."""
    if not 1 <= n <= vocab_size:
        raise ValueError(f"mtp.draft_vocab = {n} must lie in 1..vocab_size ({vocab_size}); 0 turns it off")
    counts = np.bincount(np.asarray(target_ids, dtype=np.int64), minlength=vocab_size)
    return torch.from_numpy(np.sort(np.argsort(-counts, kind="stable")[:n]))
