"""Offline trunk features: the frozen trunk run once over the training records, so an MTP head trains without it.

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
incrementally or resumed after a kill.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from .packing import DataError, PackedData, read_records, tokenize_documents

logger = logging.getLogger("mtpkit")

FEATURE_KEYS = ("hidden", "topk_ids", "topk_logprobs")  # batch keys a features row carries besides the tokens
VERSION = 1
_STORE = {"bfloat16": np.uint16, "float32": np.float32}  # hidden storage dtype -> numpy dtype of the file


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


def _records_sha(docs) -> str:
    h = hashlib.sha256()
    for ids, mask in docs:
        h.update(ids.astype(np.int32).tobytes())
        h.update(b"" if mask is None else np.packbits(mask).tobytes())
    return h.hexdigest()[:16]


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

        def load(name):
            return np.load(self.root / f"{name}.npy", mmap_mode="r")

        self.input_ids, self.loss_mask, self.offsets = load("input_ids"), load("loss_mask"), load("offsets")
        self._hidden = load("hidden")
        self.topk = self.meta["topk"]
        self._topk_ids = load("topk_ids") if self.topk else None
        self._topk_logprobs = load("topk_logprobs") if self.topk else None

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
        if self.topk:
            out["topk_ids"] = torch.from_numpy(self._topk_ids[rows].astype(np.int64))
            out["topk_logprobs"] = torch.from_numpy(self._topk_logprobs[rows])
        return out


class FeaturesData(PackedData):
    """PackedData over a features directory: documents are row ranges of the store, packed exactly like token
    documents (same shuffling, rows, segment ids); `rows` swaps the row indices for the stored tokens, hidden
    states and top-k."""

    def __init__(self, docs, seq_len: int, *, store: FeatureStore, pad_token: int = 0, **kw):
        self.store, self.pad_token = store, pad_token
        super().__init__(docs, seq_len, pad_id=-1, **kw)

    def fingerprint(self) -> str:
        return hashlib.sha256((super().fingerprint() + self.store.meta["records_sha"]).encode()).hexdigest()[:16]

    def target_ids(self) -> np.ndarray:
        ids = self.store.input_ids
        return np.concatenate([ids[d][m] for d, m in self.docs])

    def rows(self, start: int, n: int) -> dict[str, torch.Tensor]:
        batch = super().rows(start, n)
        idx = batch.pop("input_ids")  # [n, T] global rows; -1 on padding
        pad = idx < 0
        got = self.store.gather(idx.clamp(min=0).flatten().numpy())
        for k, v in got.items():
            batch[k] = v.reshape(*idx.shape, *v.shape[1:])
        batch["input_ids"] = batch["input_ids"].masked_fill(pad, self.pad_token)
        return batch


# ------------------------------------------------------------------------------------------------------ build
def _row_batches(lengths: list[int], start: int, row_tokens: int, batch_tokens: int):
    """Consecutive records from `start`, whole, packed into rows of <= row_tokens (a longer record gets a row of
    its own), and rows into batches of about batch_tokens padded tokens. Yields lists of rows (lists of records)."""
    batch, row, row_len, width = [], [], 0, 0
    for r in range(start, len(lengths)):
        if row and row_len + lengths[r] > row_tokens:
            batch.append(row)
            if (len(batch) + 1) * width > batch_tokens:
                yield batch
                batch, width = [], 0
            row, row_len = [], 0
        row.append(r)
        row_len += lengths[r]
        width = max(width, row_len)
    if row:
        yield batch + [row]


def _trunk_hidden(model, rows: list[list[int]], docs, compute: str) -> torch.Tensor:
    """Packed rows of records -> post-norm hidden [n_tokens, H] in record order (padding dropped)."""
    width = max(sum(len(docs[r][0]) for r in row) for row in rows)
    dev = model.output_weight.device
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    seg = torch.full((len(rows), width), -1, dtype=torch.long)  # -1: padding, its own segment
    real = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        at = 0
        for s, r in enumerate(row):
            d = docs[r][0]
            ids[i, at : at + len(d)] = torch.from_numpy(d)
            seg[i, at : at + len(d)] = s
            at += len(d)
        real[i, :at] = True
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=compute == "autocast"):
        hidden = model(ids.to(dev), segment_ids=seg.to(dev), return_logits=False).hidden
    return hidden[real.to(dev)]


def _topk(model, hidden: torch.Tensor, k: int, dtype: torch.dtype, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [n, H] -> the top-k ids [n, k] and their log-probabilities (logits in `dtype`, softmax in fp32)."""
    ids, lps = [], []
    w = model.output_weight.to(dtype)
    for s in range(0, hidden.shape[0], chunk):
        logits = (hidden[s : s + chunk].to(dtype) @ w.T).float()
        top = logits.topk(k, dim=-1)
        ids.append(top.indices.int())
        lps.append(top.values - logits.logsumexp(-1, keepdim=True))
    return torch.cat(ids), torch.cat(lps)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def _open_arrays(out: Path, docs, meta: dict, fresh: bool) -> dict[str, np.ndarray]:
    """The preallocated arrays (created and the token arrays written when fresh, else reopened for writing)."""
    N, H, k = meta["tokens"], meta["model"]["hidden_size"], meta["topk"]
    shapes = {"hidden": ((N, H), _STORE[meta["hidden_dtype"]])}
    if k:
        shapes.update(topk_ids=((N, k), np.int32), topk_logprobs=((N, k), np.float32))
    if not fresh:
        return {name: np.load(out / f"{name}.npy", mmap_mode="r+") for name in shapes}
    lengths = [len(d) for d, _ in docs]
    np.save(out / "input_ids.npy", np.concatenate([d for d, _ in docs]).astype(np.int32))
    np.save(out / "loss_mask.npy", np.concatenate([np.ones(len(d), bool) if m is None else m for d, m in docs]))
    np.save(out / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    return {name: np.lib.format.open_memmap(out / f"{name}.npy", mode="w+", dtype=dt, shape=shape)
            for name, (shape, dt) in shapes.items()}


def build_features(model, tokenizer, records, out, *, topk: int = 0, hidden_dtype: str = "bfloat16",
                   compute: str = "bfloat16", batch_tokens: int = 8192, row_tokens: int = 256,
                   progress: bool = True) -> dict:
    """Run the frozen trunk once over every record of `records` (JSONL files of {"input_ids", "loss_mask"}, as
    `mtpkit distill` writes, with the model's `tokenizer`) and store its post-norm hidden states (and top-k
    next-token log-probabilities) in the directory `out`. compute: "float32", "bfloat16" (weights cast) or
    "autocast" (fp32 weights, bf16 matmuls). Records shorter than row_tokens share a row (segment ids keep them
    apart); short rows are cheaper (SmolLM2, 1 thread: 8 records of ~230 tokens ran at 380-500 tokens/s one per
    row and 180-200 in one packed row, where the masked attention is quadratic). Resumable: a second call with
    the same model and records continues where a killed one stopped. Returns {"records", "tokens", "seconds",
    "tokens_per_second"} of this call."""
    from tqdm import tqdm

    if hidden_dtype not in _STORE:
        raise ValueError(f"hidden dtype must be one of {', '.join(_STORE)}, not {hidden_dtype!r}")
    if compute not in ("float32", "bfloat16", "autocast"):
        raise ValueError(f"compute must be float32, bfloat16 or autocast, not {compute!r}")
    if topk < 0 or topk > model.config.vocab_size:
        raise ValueError(f"topk must lie in 0..{model.config.vocab_size}, not {topk}")
    if batch_tokens < 1 or row_tokens < 1:
        raise ValueError("batch_tokens and row_tokens must be >= 1")
    files = [Path(p).expanduser() for p in ([records] if isinstance(records, (str, Path)) else records)]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"records file {f} does not exist")
    docs = tokenize_documents(read_records(files, "jsonl", "input_ids", whole=True), tokenizer, "tokens")
    if not docs:
        raise DataError(f"no records in {', '.join(map(str, files))}")
    vocab = model.config.vocab_size
    if max(int(d.max()) for d, _ in docs) >= vocab:
        raise DataError(f"the records hold token ids >= the model's vocab_size {vocab}: they come from another model")
    meta = {"version": VERSION, "model": model_identity(model), "records_sha": _records_sha(docs),
            "records": len(docs), "tokens": int(sum(len(d) for d, _ in docs)), "hidden_dtype": hidden_dtype,
            "topk": topk, "sources": [str(f) for f in files]}
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    fresh = not (out / "meta.json").exists()
    if not fresh:
        old = json.loads((out / "meta.json").read_text())
        keys = ("version", "model", "records_sha", "records", "tokens", "hidden_dtype", "topk")
        diff = [k for k in keys if old.get(k) != meta[k]]
        if diff:
            raise ValueError(f"{out} holds features of another run (different {', '.join(diff)}): use another "
                             "--out or delete that directory")
    arrays = _open_arrays(out, docs, meta, fresh)
    if fresh:
        _write_json(out / "progress.json", {"records_done": 0})
        _write_json(out / "meta.json", meta)  # last: its presence means the arrays exist
    done = json.loads((out / "progress.json").read_text())["records_done"]

    if compute == "bfloat16":
        model = model.to(torch.bfloat16)
    lengths = [len(d) for d, _ in docs]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    made, start = 0, time.perf_counter()
    with torch.inference_mode(), tqdm(total=meta["tokens"], initial=int(offsets[done]), unit="tok",
                                      unit_scale=True, desc="features", disable=not progress) as bar:
        for rows in _row_batches(lengths, done, row_tokens, batch_tokens):
            hidden = _trunk_hidden(model, rows, docs, compute)  # [n, H], records rows[0][0].. in order
            a, b = int(offsets[rows[0][0]]), int(offsets[rows[-1][-1] + 1])
            h = hidden.to(torch.bfloat16 if hidden_dtype == "bfloat16" else torch.float32)
            arrays["hidden"][a:b] = bf16_to_numpy(h) if hidden_dtype == "bfloat16" else h.cpu().numpy()
            if topk:
                ids, lps = _topk(model, hidden, topk, torch.float32 if compute == "float32" else torch.bfloat16)
                arrays["topk_ids"][a:b] = ids.cpu().numpy()
                arrays["topk_logprobs"][a:b] = lps.cpu().numpy()
            for arr in arrays.values():
                arr.flush()
            done = rows[-1][-1] + 1
            _write_json(out / "progress.json", {"records_done": done})
            made += b - a
            bar.update(b - a)
    seconds = time.perf_counter() - start
    return {"records": len(docs), "tokens": made, "seconds": seconds,
            "tokens_per_second": made / seconds if seconds > 0 else 0.0}
