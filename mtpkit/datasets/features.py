"""`mtpkit features`: the frozen trunk run once over distilled records, its post-norm hidden states (and top-k
next-token log-probabilities) written into a features directory (the format: mtpkit/data/features.py)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from ..data.features import (HIDDEN_DTYPES, VERSION, FeatureStore, array_shapes, bf16_to_numpy, load_array,
                             model_identity)
from ..data.reading import DataError, read_records
from ..data.tokenizing import token_record_problem, tokenize_documents
from ..locking import OutputLock

_FILLED = ("hidden", "topk_ids", "topk_logprobs")  # the arrays the trunk's forwards fill
_OWN = {"meta.json", "progress.json", "writer.lock", *(f"{name}.npy" for name in ("input_ids", "loss_mask",
                                                                                   "offsets", *_FILLED))}
_SINCE_ROUND_3 = ("compute", "writer")  # not in the meta.json of older directories: not compared there


def writer_lock(out) -> OutputLock:
    """The one-writer lock of the features directory `out`."""
    return OutputLock(Path(out).expanduser() / "writer.lock", f"features directory {out}")


def _records_sha(docs) -> str:
    h = hashlib.sha256()
    for ids, mask in docs:
        h.update(ids.astype(np.int32).tobytes())
        h.update(b"" if mask is None else np.packbits(mask).tobytes())
    return h.hexdigest()[:16]


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


def stored_hidden(hidden: torch.Tensor, hidden_dtype: str) -> np.ndarray:
    """Hidden states [n, H] as a features directory stores them (bf16 bits as uint16, or float32)."""
    if hidden_dtype == "bfloat16":
        return bf16_to_numpy(hidden.to(torch.bfloat16))
    return hidden.float().cpu().numpy()


def topk_logprobs(model, hidden: torch.Tensor, k: int, dtype: torch.dtype,
                  chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
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
    shapes = {name: shape for name, shape in array_shapes(meta).items() if name in _FILLED}
    if not fresh:
        return {name: load_array(out / f"{name}.npy", *shape, mode="r+") for name, shape in shapes.items()}
    lengths = [len(d) for d, _ in docs]
    np.save(out / "input_ids.npy", np.concatenate([d for d, _ in docs]).astype(np.int32))
    np.save(out / "loss_mask.npy", np.concatenate([np.ones(len(d), bool) if m is None else m for d, m in docs]))
    np.save(out / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    return {name: np.lib.format.open_memmap(out / f"{name}.npy", mode="w+", dtype=dt, shape=shape)
            for name, (shape, dt) in shapes.items()}


def read_distilled(records, tokenizer) -> tuple[list[Path], list[dict], list[tuple[np.ndarray, np.ndarray | None]]]:
    """JSONL record files (as `mtpkit distill` writes them, with `tokenizer`) -> the files, their records and (ids,
    loss mask) per record, checked."""
    files = [Path(p).expanduser() for p in ([records] if isinstance(records, (str, Path)) else records)]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"records file {f} does not exist")
    raw = read_records(files, "jsonl", "input_ids", whole=True, check=token_record_problem)
    if not raw:
        raise DataError(f"no records in {', '.join(map(str, files))}")
    return files, raw, tokenize_documents(raw, tokenizer, "tokens")


def check_writer(out, writer: str) -> None:
    """Refuse a features directory `out` that holds other files, or features another writer made (a directory
    from before writers were recorded is anyone's)."""
    out = Path(out).expanduser()
    if not out.is_dir():
        return
    foreign = sorted(p.name for p in out.iterdir() if p.name not in _OWN and not p.name.endswith(".tmp"))
    if foreign:
        raise DataError(f"{out} holds files a features directory does not ({', '.join(foreign[:3])}): give "
                        "another directory")
    made_by = json.loads((out / "meta.json").read_text()).get("writer") if (out / "meta.json").exists() else None
    if made_by not in (None, writer):
        raise DataError(f"{out} holds features written by {made_by}, not by this {writer}: give another "
                        "directory")


def open_features(identity: dict, vocab_size: int, files, docs, out, *, topk: int, hidden_dtype: str, compute: str,
                  writer: str, fresh: bool = False) -> tuple[dict[str, np.ndarray], int]:
    """The features directory `out` for `docs` of a trunk with `identity` (`model_identity`) computing in
    `compute`, written by `writer`: created with its token arrays, or reopened to continue (refused when it
    holds another run's features), or created anew when `fresh` (old files replaced, if the same writer made
    them). A directory holding other files is refused. Returns its arrays (open for writing) and the records
    already done."""
    if hidden_dtype not in HIDDEN_DTYPES:
        raise ValueError(f"hidden dtype must be one of {', '.join(HIDDEN_DTYPES)}, not {hidden_dtype!r}")
    if topk < 0 or topk > vocab_size:
        raise ValueError(f"topk must lie in 0..{vocab_size}, not {topk}")
    if max(int(d.max()) for d, _ in docs) >= vocab_size:
        raise DataError(f"the records hold token ids >= the model's vocab_size {vocab_size}: they come from another "
                        "model")
    meta = {"version": VERSION, "model": identity, "records_sha": _records_sha(docs), "records": len(docs),
            "tokens": int(sum(len(d) for d, _ in docs)), "hidden_dtype": hidden_dtype, "topk": topk,
            "compute": compute, "writer": writer, "sources": [str(f) for f in files]}
    out = Path(out).expanduser()
    check_writer(out, writer)
    out.mkdir(parents=True, exist_ok=True)
    if fresh:
        (out / "meta.json").unlink(missing_ok=True)
    new = not (out / "meta.json").exists()
    if not new:
        old = json.loads((out / "meta.json").read_text())
        keys = ("version", "model", "records_sha", "records", "tokens", "hidden_dtype", "topk") + _SINCE_ROUND_3
        diff = [k for k in keys if old.get(k, meta[k] if k in _SINCE_ROUND_3 else None) != meta[k]]
        if diff:
            raise ValueError(f"{out} holds features of another run (different {', '.join(diff)}): use another "
                             "--out or delete that directory")
    arrays = _open_arrays(out, docs, meta, new)
    if new:
        _write_json(out / "progress.json", {"records_done": 0})
        _write_json(out / "meta.json", meta)  # last: its presence means the arrays exist
    return arrays, json.loads((out / "progress.json").read_text())["records_done"]


def mark_done(out, records_done: int) -> None:
    _write_json(Path(out).expanduser() / "progress.json", {"records_done": records_done})


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
    if compute not in ("float32", "bfloat16", "autocast"):
        raise ValueError(f"compute must be float32, bfloat16 or autocast, not {compute!r}")
    if batch_tokens < 1 or row_tokens < 1:
        raise ValueError("batch_tokens and row_tokens must be >= 1")
    files, _, docs = read_distilled(records, tokenizer)
    longest, context = max(len(d) for d, _ in docs), model.config.max_position_embeddings
    if longest > context:  # positions the trunk was never trained at: features no drafting would see
        raise DataError(f"a record holds {longest} tokens, beyond the model's context of {context}: cut or drop "
                        "such records")
    out = Path(out).expanduser()
    check_writer(out, "mtpkit features")  # before the lock file goes into a directory that is not ours
    with writer_lock(out):
        return _fill(model, docs, out, *open_features(
            model_identity(model), model.config.vocab_size, files, docs, out, topk=topk, hidden_dtype=hidden_dtype,
            compute=compute, writer="mtpkit features"), topk=topk, hidden_dtype=hidden_dtype, compute=compute,
            batch_tokens=batch_tokens, row_tokens=row_tokens, progress=progress)


def select_features(src, out, *, max_record_tokens: int | None = None, first_record: int = 0) -> dict:
    """Copy the records of the finished features directory `src` from index first_record on (those a resumed
    distillation appended) and shorter than max_record_tokens (None: any length) into a new features directory
    `out`, without running the trunk: a source of the new records alone, or a second one that reweights the short
    records, read twice an epoch beside long-input ones (data.features = [src, out]). The copy is the directory
    `mtpkit features` would build from those records alone (same arrays, same records checksum). Rerunning a
    finished copy does nothing. Returns {"records", "tokens"}."""
    store = FeatureStore(src)
    off = store.offsets
    lengths = np.diff(off)
    if not 0 <= first_record < len(lengths):
        raise DataError(f"--first-record {first_record} is outside {store.root}'s {len(lengths)} records: give "
                        f"0 to {len(lengths) - 1}")
    tail = lengths[first_record:]
    keep = first_record + np.nonzero(tail < max_record_tokens if max_record_tokens is not None else tail >= 0)[0]
    if not len(keep):
        raise DataError(f"{store.root} holds no record from {first_record} on shorter than {max_record_tokens} "
                        "tokens: raise --max-record-tokens")
    rows = np.concatenate([np.arange(off[r], off[r + 1]) for r in keep])
    docs = [(store.input_ids[off[r]:off[r + 1]], store.loss_mask[off[r]:off[r + 1]]) for r in keep]
    writer = "mtpkit features --from-features"
    meta = dict(store.meta, records_sha=_records_sha(docs), records=len(keep), tokens=len(rows), writer=writer,
                sources=[str(store.root)])
    out = Path(out).expanduser()
    if out.resolve() == store.root.resolve():
        raise DataError(f"--out {out} is the source directory: give a new one")
    check_writer(out, writer)
    out.mkdir(parents=True, exist_ok=True)
    with writer_lock(out):
        if (out / "meta.json").exists():
            old = json.loads((out / "meta.json").read_text())
            if any(old.get(k) != v for k, v in meta.items() if k != "sources"):
                raise DataError(f"{out} holds another selection: use another --out or delete that directory")
            return {"records": 0, "tokens": 0}
        np.save(out / "offsets.npy", np.concatenate([[0], np.cumsum(lengths[keep])]).astype(np.int64))
        step = 1 << 18  # rows per copied slab: bounded memory for any directory size
        for name, (shape, dtype) in array_shapes(store.meta).items():
            if name == "offsets":
                continue
            source = load_array(store.root / f"{name}.npy", shape, dtype)
            target = np.lib.format.open_memmap(out / f"{name}.npy", mode="w+", dtype=dtype,
                                               shape=(len(rows),) + shape[1:])
            for s in range(0, len(rows), step):
                target[s:s + step] = source[rows[s:s + step]]
            target.flush()
        mark_done(out, len(keep))
        _write_json(out / "meta.json", meta)  # last: its presence means the arrays are complete
    return {"records": len(keep), "tokens": len(rows)}


def _fill(model, docs, out: Path, arrays: dict, done: int, *, topk: int, hidden_dtype: str, compute: str,
          batch_tokens: int, row_tokens: int, progress: bool) -> dict:
    """build_features' trunk passes over the records from `done` on."""
    from tqdm import tqdm

    if compute == "bfloat16":
        model = model.to(torch.bfloat16)
    lengths = [len(d) for d, _ in docs]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    made, start = 0, time.perf_counter()
    with torch.inference_mode(), tqdm(total=int(offsets[-1]), initial=int(offsets[done]), unit="tok",
                                      unit_scale=True, desc="features", disable=not progress) as bar:
        for rows in _row_batches(lengths, done, row_tokens, batch_tokens):
            hidden = _trunk_hidden(model, rows, docs, compute)  # [n, H], records rows[0][0].. in order
            a, b = int(offsets[rows[0][0]]), int(offsets[rows[-1][-1] + 1])
            arrays["hidden"][a:b] = stored_hidden(hidden, hidden_dtype)
            if topk:
                ids, lps = topk_logprobs(model, hidden, topk, torch.float32 if compute == "float32" else torch.bfloat16)
                arrays["topk_ids"][a:b] = ids.cpu().numpy()
                arrays["topk_logprobs"][a:b] = lps.cpu().numpy()
            for arr in arrays.values():
                arr.flush()
            done = rows[-1][-1] + 1
            mark_done(out, done)
            made += b - a
            bar.update(b - a)
    seconds = time.perf_counter() - start
    return {"records": len(docs), "tokens": made, "seconds": seconds,
            "tokens_per_second": made / seconds if seconds > 0 else 0.0}
