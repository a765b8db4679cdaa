"""Offline trunk features: the frozen trunk's outputs over the training records, so an MTP head trains without it.

Medusa-1 and SpecForge's offline mode cache what the head reads from the trunk; with a frozen trunk the head's
training then costs only the head (one layer) and its output CE, not 30 trunk layers per step. For every token
position t of every record, a features directory holds

    meta.json            model identity (type, sizes, a weight fingerprint), records checksum, dtypes, top-k
    progress.json        records done so far (a killed run continues from there)
    input_ids.npy        int32 [N]           the records' tokens, concatenated (N = sum of record lengths)
    loss_mask.npy        bool  [N]
    offsets.npy          int64 [R+1]         record r is rows offsets[r]:offsets[r+1]
    hidden.npy           uint16 [N, H]       the trunk's post-norm hidden h_t, bf16 bits (float32 [N, H] if asked)
    topk_ids.npy         int32 [N, k]        the trunk's top-k next-token ids at t (with --topk k > 0)
    topk_logprobs.npy    float32 [N, k]      their log-probabilities under the full softmax

Numpy .npy files written through `np.lib.format.open_memmap`: the sizes are known before the trunk runs, so each
array is preallocated once and filled in place batch by batch (a resumed run writes only the missing rows), and
training maps the same files read-only (pages come from the OS cache, bf16 bits are viewed as torch.bfloat16
without a copy of the file). safetensors is written whole from tensors in memory, so it cannot be filled
incrementally or resumed after a kill. `mtpkit features` builds a directory (mtpkit/datasets/features.py); this
file reads one for training.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from .packing import PackedData
from .reading import DataError

VERSION = 1
HIDDEN_DTYPES = {"bfloat16": np.uint16, "float32": np.float32}  # hidden storage dtype -> numpy dtype of the file


REBUILD = "delete the directory and build it again with `mtpkit features`"


# ----------------------------------------------------------------------------------------------------- arrays
def array_shapes(meta: dict) -> dict[str, tuple[tuple[int, ...], type]]:
    """Each array's shape and numpy dtype, as meta.json describes the directory."""
    N, R, H, k = meta["tokens"], meta["records"], meta["model"]["hidden_size"], meta["topk"]
    shapes = {"input_ids": ((N,), np.int32), "loss_mask": ((N,), np.bool_), "offsets": ((R + 1,), np.int64),
              "hidden": ((N, H), HIDDEN_DTYPES[meta["hidden_dtype"]])}
    if k:
        shapes.update(topk_ids=((N, k), np.int32), topk_logprobs=((N, k), np.float32))
    return shapes


def load_array(path: Path, shape: tuple[int, ...], dtype, mode: str = "r") -> np.ndarray:
    """A features array, memory-mapped, checked against the shape and dtype meta.json gives it: one line naming
    the file when it is cut short, unreadable or another run's."""
    try:
        a = np.load(path, mmap_mode=mode)
    except (OSError, ValueError, EOFError) as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise DataError(f"{path} cannot be read as a numpy array ({why}): {REBUILD}") from None
    if a.shape != shape or a.dtype != np.dtype(dtype):
        raise DataError(f"{path} holds {a.dtype} {a.shape}, but meta.json describes {np.dtype(dtype)} {shape} (a "
                        f"file of another run, or cut short): {REBUILD}")
    return a


# --------------------------------------------------------------------------------------------------- identity
def model_identity(model) -> dict:
    """What a features directory must match: the trunk's sizes and a fingerprint of its weights (the final norm
    and a strided sample of the embedding, so two checkpoints of one architecture differ)."""
    cfg = model.config
    h = hashlib.sha256()
    for t in (model.model.norm.weight, model.model.embed_tokens.weight[::97, ::7]):
        h.update(t.detach().float().cpu().numpy().tobytes())
    return {"model_type": cfg.model_type, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "num_hidden_layers": cfg.num_hidden_layers, "fingerprint": h.hexdigest()[:16]}


def bf16_to_numpy(t: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> its bits as uint16 (numpy has no bfloat16)."""
    return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


def numpy_to_bf16(a: np.ndarray) -> torch.Tensor:
    """uint16 bf16 bits -> a torch.bfloat16 tensor sharing the array's memory."""
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


# ------------------------------------------------------------------------------------------------------ store
class FeatureStore:
    """A finished features directory, memory-mapped read-only."""

    def __init__(self, root):
        self.root = Path(root).expanduser()
        meta_path = self.root / "meta.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"data.features: {self.root} holds no meta.json: build it with "
                                    "`mtpkit features --model M --records R.jsonl --out DIR`")
        self.meta = json.loads(meta_path.read_text())
        done = json.loads((self.root / "progress.json").read_text())["records_done"]
        if done < self.meta["records"]:
            raise DataError(f"{self.root} is incomplete ({done} of {self.meta['records']} records): run the same "
                            "`mtpkit features` command again to finish it")

        shapes = array_shapes(self.meta)

        def load(name):
            return load_array(self.root / f"{name}.npy", *shapes[name]) if name in shapes else None

        self.input_ids, self.loss_mask, self.offsets = load("input_ids"), load("loss_mask"), load("offsets")
        if self.offsets[0] != 0 or self.offsets[-1] != len(self.input_ids) or (np.diff(self.offsets) < 0).any():
            raise DataError(f"{self.root / 'offsets.npy'} does not split the {len(self.input_ids)} tokens into "
                            f"records: the directory is damaged; {REBUILD}")
        self._hidden = load("hidden")
        self.topk = self.meta["topk"]
        self._topk_ids, self._topk_logprobs = load("topk_ids"), load("topk_logprobs")

    def check_model(self, model) -> None:
        """A one-line error when the features were built from another trunk than the model being trained."""
        want, have = self.meta["model"], model_identity(model)
        if want != have:
            diff = ", ".join(f"{k} {want[k]} vs {have[k]}" for k in want if want[k] != have.get(k))
            raise ValueError(f"data.features {self.root} was built from another model ({diff}, features vs "
                             "model.path): rebuild the features with this model or train the model they came from")

    def documents(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """One (global row indices, loss mask) per record: packed by PackedData like token ids."""
        off = self.offsets
        return [(np.arange(off[r], off[r + 1], dtype=np.int64), np.asarray(self.loss_mask[off[r] : off[r + 1]]))
                for r in range(len(off) - 1)]

    def gather(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """Global rows [n] -> input_ids [n], hidden [n, H] (bf16 or fp32) and, if stored, the top-k [n, k]."""
        out = {"input_ids": torch.from_numpy(self.input_ids[rows].astype(np.int64))}
        h = self._hidden[rows]
        out["hidden"] = numpy_to_bf16(h) if h.dtype == np.uint16 else torch.from_numpy(h)
        if not torch.isfinite(out["hidden"]).all():  # else training diverges with no hint that the data is bad
            bad = int(rows[int(torch.nonzero(~torch.isfinite(out["hidden"]).all(-1))[0])])
            raise DataError(f"{self.root / 'hidden.npy'} holds NaN or infinite hidden states (row {bad}): the trunk "
                            f"overflowed while they were built (try `mtpkit features --compute float32`) or the file "
                            f"is damaged; {REBUILD}")
        if self.topk:
            out["topk_ids"] = torch.from_numpy(self._topk_ids[rows].astype(np.int64))
            out["topk_logprobs"] = torch.from_numpy(self._topk_logprobs[rows])
        return out

    def top1(self, rows: np.ndarray) -> np.ndarray:
        """The trunk's greedy next token after each of the global rows [n] (needs features built with --topk)."""
        if not self.topk:
            raise DataError(f"{self.root} holds no top-k, which mtp.head_loss = 'greedy' needs: rebuild the features "
                            "with `mtpkit features --topk K`")
        return np.asarray(self._topk_ids[rows, 0], dtype=np.int64)


class FeatureStores:
    """One or more features directories read as one (data.features = [DIR, ...]): e.g. the features kept by
    successive `mtpkit distill --features` runs, so a head grows on all of them without rebuilding a directory.
    Row r of part i is global row bases[i] + r; the parts must come from one trunk and store the same kinds."""

    def __init__(self, roots):
        self.parts = [FeatureStore(r) for r in ([roots] if isinstance(roots, (str, Path)) else roots)]
        if not self.parts:
            raise DataError("data.features is an empty list: name at least one `mtpkit features` directory")
        first = self.parts[0]
        for part in self.parts[1:]:
            for what, key in (("another model", "model"), ("another top-k", "topk"),
                              ("another hidden dtype", "hidden_dtype")):
                if part.meta[key] != first.meta[key]:
                    raise DataError(f"data.features: {part.root} was built with {what} than {first.root} "
                                    f"({part.meta[key]} vs {first.meta[key]}): train on features of one kind")
        self.roots = [part.root for part in self.parts]
        self.topk = first.topk
        self.bases = np.cumsum([0] + [len(p.input_ids) for p in self.parts])
        if len(self.parts) == 1:  # the fingerprint a run over one directory had before lists existed: resumes match
            self.records_sha, self.input_ids = first.meta["records_sha"], first.input_ids
        else:
            self.records_sha = hashlib.sha256("".join(p.meta["records_sha"] for p in self.parts).encode()).hexdigest()
            self.input_ids = np.concatenate([p.input_ids for p in self.parts])

    def check_model(self, model) -> None:
        for part in self.parts:
            part.check_model(model)

    def documents(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(rows + base, mask) for part, base in zip(self.parts, self.bases) for rows, mask in part.documents()]

    def _by_part(self, rows: np.ndarray):
        """Global rows [n] -> (part, positions in `rows` [m], the part's own rows [m]) for each part they touch."""
        which = np.searchsorted(self.bases, rows, side="right") - 1
        for i in np.unique(which):
            at = np.nonzero(which == i)[0]
            yield self.parts[i], at, rows[at] - self.bases[i]

    def gather(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        if len(self.parts) == 1:
            return self.parts[0].gather(rows)
        out = {}
        for part, at, local in self._by_part(rows):
            for key, value in part.gather(local).items():
                if key not in out:
                    out[key] = value.new_empty((len(rows), *value.shape[1:]))
                out[key][torch.from_numpy(at)] = value
        return out

    def top1(self, rows: np.ndarray) -> np.ndarray:
        out = np.empty(len(rows), dtype=np.int64)
        for part, at, local in self._by_part(rows):
            out[at] = part.top1(local)
        return out


class FeaturesData(PackedData):
    """PackedData over a features directory: documents are row ranges of the store, packed exactly like token
    documents (same shuffling, rows, segment ids); `rows` swaps the row indices for the stored tokens, hidden
    states and top-k."""

    def __init__(self, docs, seq_len: int, *, store: FeatureStores, pad_token: int = 0, **kw):
        self.store, self.pad_token = store, pad_token
        super().__init__(docs, seq_len, pad_id=-1, **kw)

    def fingerprint(self) -> str:
        return hashlib.sha256((super().fingerprint() + self.store.records_sha).encode()).hexdigest()[:16]

    def target_ids(self) -> np.ndarray:
        ids = self.store.input_ids
        return np.concatenate([ids[d] if m is None else ids[d][m] for d, m in self.docs])

    def greedy_target_ids(self) -> np.ndarray:
        """What mtp.head_loss = "greedy" trains toward at each target: the trunk's top-1 after the row before it
        (the first token of a record has no row before it and is no target)."""
        before = [d[:-1] if m is None else d[:-1][m[1:]] for d, m in self.docs]
        return self.store.top1(np.concatenate(before))

    def rows(self, start: int, n: int) -> dict[str, torch.Tensor]:
        batch = super().rows(start, n)
        idx = batch.pop("input_ids")  # [n, T] global rows; -1 on padding
        pad = idx < 0
        got = self.store.gather(idx.clamp(min=0).flatten().numpy())
        for k, v in got.items():
            batch[k] = v.reshape(*idx.shape, *v.shape[1:])
        batch["input_ids"] = batch["input_ids"].masked_fill(pad, self.pad_token)
        return batch
