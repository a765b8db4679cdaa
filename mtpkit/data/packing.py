"""Packing: tokenized documents -> packed fixed-length rows with segment ids, an endless and resumable stream.

Every document becomes a token array and a loss mask (True where the token may be a training target: every
token in pretraining, assistant turns only in chat SFT). Documents are concatenated in a shuffled order, cut into
rows of `seq_len` tokens and the rows shuffled again; a fresh, seeded permutation per epoch. Within a row,
`segment_ids` number the documents 0, 1, 2, ... (the padding tail of the last row gets its own segment and no
loss), so attention, the Gated DeltaNet state and the MTP targets never cross a document boundary.

The stream is addressed by a global row index, so the data position is a single integer (`rows_consumed`) that
goes into every checkpoint: resuming replays exactly the rows an uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import numpy as np
import torch

from .images import batch_vision
from .reading import DataError

logger = logging.getLogger("mtpkit")


@dataclass
class Packed:
    """One epoch of packed rows: tokens, segment ids and loss mask, all [R, T]; with whole-document packing also
    the documents (indices into the packed list) of each row."""

    input_ids: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray
    docs: list[list[int]] | None = None

    def take(self, rows: np.ndarray) -> "Packed":
        docs = None if self.docs is None else [self.docs[r] for r in rows]
        return Packed(self.input_ids[rows], self.segment_ids[rows], self.loss_mask[rows], docs)


def pack(docs: list[tuple[np.ndarray, np.ndarray | None]], seq_len: int, pad_id: int = 0) -> Packed:
    """Concatenate documents in the given order and cut the stream into rows of seq_len tokens."""
    ids = np.concatenate([d for d, _ in docs])
    mask = np.concatenate([m if m is not None else np.ones(len(d), dtype=bool) for d, m in docs])
    doc = np.repeat(np.arange(len(docs), dtype=np.int64), [len(d) for d, _ in docs])
    R = -(-len(ids) // seq_len)
    pad = R * seq_len - len(ids)
    ids = np.concatenate([ids, np.full(pad, pad_id, dtype=np.int64)]).reshape(R, seq_len)
    mask = np.concatenate([mask, np.zeros(pad, dtype=bool)]).reshape(R, seq_len)
    doc = np.concatenate([doc, np.full(pad, len(docs), dtype=np.int64)]).reshape(R, seq_len)
    return Packed(ids, doc - doc[:, :1], mask)  # segment ids restart at 0 in every row


def pack_whole(docs: list[tuple[np.ndarray, np.ndarray | None]], seq_len: int, pad_id: int = 0) -> Packed:
    """Whole documents, in the given order, into rows of seq_len tokens (a document that does not fit starts the
    next row; the rest of a row is padding with its own segment and no loss): for documents with images, whose
    placeholder tokens must stay with their patches, and data.whole_documents."""
    too_long = [len(d) for d, _ in docs if len(d) > seq_len]
    if too_long:
        raise DataError(f"{len(too_long)} documents are longer than data.seq_len = {seq_len} tokens (the longest "
                        f"has {max(too_long)}, image tokens counted) and cannot be packed whole: raise data.seq_len")
    rows, row, used = [], [], 0
    for i, (d, _) in enumerate(docs):
        if used + len(d) > seq_len:
            rows.append(row)
            row, used = [], 0
        row.append(i)
        used += len(d)
    rows.append(row)
    ids = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    seg = np.zeros((len(rows), seq_len), dtype=np.int64)
    mask = np.zeros((len(rows), seq_len), dtype=bool)
    for r, members in enumerate(rows):
        at = 0
        for s, i in enumerate(members):
            d, m = docs[i]
            ids[r, at : at + len(d)] = d
            mask[r, at : at + len(d)] = True if m is None else m
            seg[r, at : at + len(d)] = s
            at += len(d)
        seg[r, at:] = len(members)
    return Packed(ids, seg, mask, rows)


class PackedData:
    """Documents -> an endless, deterministic stream of packed rows, addressed by global row index."""

    def __init__(self, docs, seq_len: int, *, seed: int = 0, shuffle: bool = True, pad_id: int = 0,
                 min_doc_tokens: int = 2, vision: list | None = None, whole: bool = False):
        """docs: (ids, loss mask or None) each; vision: per document (pixel_values, image_grid_thw) or None, to
        pack documents whole and batch their patches with their rows; whole: pack documents whole without images."""
        short = [i for i, (d, _) in enumerate(docs) if len(d) < min_doc_tokens]
        if short:
            if len(short) == len(docs):
                raise DataError(
                    f"all {len(docs)} documents are shorter than {min_doc_tokens} tokens (the longest has "
                    f"{max(len(d) for d, _ in docs)}): with MTP depth {min_doc_tokens - 2} a document needs at least "
                    "depth + 2 tokens to give a target at every depth"
                )
            logger.warning("skipping %d of %d documents shorter than %d tokens (too short for the MTP depth)",
                           len(short), len(docs), min_doc_tokens)
            keep = sorted(set(range(len(docs))) - set(short))
            docs = [docs[i] for i in keep]
            vision = None if vision is None else [vision[i] for i in keep]
        if not any(m is None or m[1:].any() for _, m in docs):
            raise DataError("no document has a token to train on (every loss mask is empty: no assistant turns?)")
        self.docs, self.seq_len, self.seed, self.shuffle, self.pad_id = docs, seq_len, seed, shuffle, pad_id
        self.vision, self.whole = vision, whole or vision is not None
        self._epoch, self._packed = None, None
        self.num_tokens = int(sum(len(d) for d, _ in docs))
        # whole-document packing leaves row tails empty, so its row count depends on the order: fix it per epoch
        self.rows_per_epoch = len(self.epoch(0).input_ids) if self.whole else -(-self.num_tokens // seq_len)
        self.val: PackedData | None = None  # held-out documents (build_data with data.val_docs)

    def fingerprint(self) -> str:
        """Identifies the document set and packing, so a resume on different data is caught."""
        h = hashlib.sha256()
        h.update(f"{len(self.docs)}:{self.num_tokens}:{self.seq_len}:{self.seed}:{self.shuffle}".encode())
        if self.whole and self.vision is None:  # packed otherwise than before the option existed
            h.update(b":whole")
        for d, _ in self.docs[:64]:
            h.update(d[:64].tobytes())
        return h.hexdigest()[:16]

    def epoch(self, e: int) -> Packed:
        if self._epoch != e:
            order = np.arange(len(self.docs))
            rng = np.random.default_rng([self.seed, e])
            if self.shuffle:
                order = rng.permutation(len(self.docs))
            docs = [self.docs[i] for i in order]
            if not self.whole:
                p = pack(docs, self.seq_len, self.pad_id)
            else:
                p = pack_whole(docs, self.seq_len, self.pad_id)
                p.docs = [[int(order[i]) for i in row] for row in p.docs]
                if e and len(p.docs) != self.rows_per_epoch:  # the same row count every epoch: pad or drop
                    p = p.take(np.resize(np.arange(len(p.docs)), self.rows_per_epoch))
            if self.shuffle:
                p = p.take(rng.permutation(len(p.input_ids)))
            self._epoch, self._packed = e, p
        return self._packed

    def target_ids(self) -> np.ndarray:
        """Every token that is a training target (loss mask on), for counting frequent ids (mtp.draft_vocab)."""
        return np.concatenate([d if m is None else d[m] for d, m in self.docs])

    def rows(self, start: int, n: int) -> dict[str, torch.Tensor]:
        """Rows start .. start+n-1 of the endless stream, as tensors [n, T]."""
        parts = {"input_ids": [], "segment_ids": [], "loss_mask": []}
        docs = []
        i = start
        while i < start + n:
            e, r = divmod(i, self.rows_per_epoch)
            take = min(start + n - i, self.rows_per_epoch - r)
            p = self.epoch(e)
            parts["input_ids"].append(p.input_ids[r : r + take])
            parts["segment_ids"].append(p.segment_ids[r : r + take])
            parts["loss_mask"].append(p.loss_mask[r : r + take])
            docs += p.docs[r : r + take] if p.docs is not None else []
            i += take
        batch = {k: torch.from_numpy(np.concatenate(v)) for k, v in parts.items()}
        if self.vision is not None:
            batch.update(batch_vision(docs, self.vision))
        return batch


class DataLoader:
    """Global batches of packed rows; each rank takes its contiguous share. Its state is the data position."""

    def __init__(self, data: PackedData, global_batch: int, rank: int = 0, world: int = 1):
        if global_batch % world:
            raise DataError(f"train.batch_size = {global_batch} is not divisible by the {world} ranks")
        self.data, self.global_batch, self.rank, self.world = data, global_batch, rank, world
        self.rows_consumed = 0

    def next_batch(self) -> dict[str, torch.Tensor]:
        per_rank = self.global_batch // self.world
        batch = self.data.rows(self.rows_consumed + self.rank * per_rank, per_rank)
        self.rows_consumed += self.global_batch
        return batch

    @property
    def epoch(self) -> float:
        return self.rows_consumed / self.data.rows_per_epoch

    def state_dict(self) -> dict:
        return {"rows_consumed": self.rows_consumed, "fingerprint": self.data.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        if state["fingerprint"] != self.data.fingerprint():
            raise DataError(
                "the checkpoint was written while training on different data (or a different seq_len/seed/shuffle): "
                "resume with the same data settings, or start a new run_dir"
            )
        self.rows_consumed = int(state["rows_consumed"])
