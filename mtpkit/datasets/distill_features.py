"""Trunk features kept while distilling: the hidden states generation computes anyway, stored instead of recomputed.

`mtpkit distill` runs the trunk over every token it writes; `mtpkit features` would run it over the same tokens
again. With `--features DIR` distillation keeps each forward's post-norm hidden states (`generate(on_hidden=...)`)
and, with a top-k, their next-token log-probabilities, so the head's training data costs one trunk pass, not two.

Per finished batch, a shard `OUT.hidden/NNNNNN.npz` holds the batch's prompt indices, the positions stored per
record (its length - 1: a record's last token is never read by a forward) and those rows; it is written and
fsynced before the batch's records are appended to OUT, so every record has its shard (a shard whose records were
lost to a kill is left over and ignored: the prompts are decoded again into a newer shard). At the end of a run the
shards of the records in OUT are copied into DIR, a features directory in the format `mtpkit features` writes
(mtpkit/data/features.py), rebuilt whole each time, so a resumed or extended run refreshes it. The last position
of each record holds zeros: no token of the record follows it, so no training target reads it.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np
import torch

from ..data.reading import DataError
from .features import mark_done, open_features, read_distilled, stored_hidden, topk_logprobs, writer_lock


def writer_name(records) -> str:
    """Who a features directory assembled from the distillation output `records` was written by."""
    return f"mtpkit distill --out {Path(records).resolve()}"


def _read_shard(path: Path, names) -> dict[str, np.ndarray]:
    """The arrays `names` of a shard (those it holds); a damaged shard (a disk error: writes go through an
    fsynced rename) named in one line."""
    try:
        with np.load(path) as z:
            return {name: z[name] for name in names if name in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"hidden-state shard {path} is damaged ({type(e).__name__}: {e}): distill again into a "
                        "new --out, or build the features with `mtpkit features`") from None


class HiddenCapture:
    """`generate`'s on_hidden for one batch of rows: collects each row's hidden states (stored dtype) and top-k."""

    def __init__(self, model, rows: int, *, hidden_dtype: str, topk: int):
        self.model, self.hidden_dtype, self.topk = model, hidden_dtype, topk
        self.parts: list[list[tuple]] = [[] for _ in range(rows)]

    def __call__(self, rows: list[int], hidden: torch.Tensor) -> None:  # hidden [b, n, H]
        b, n, width = hidden.shape
        flat = hidden.reshape(b * n, width)
        stored = stored_hidden(flat, self.hidden_dtype).reshape(b, n, width)
        if self.topk:
            ids, lps = topk_logprobs(self.model, flat, self.topk, self.model.output_weight.dtype)
            ids, lps = ids.reshape(b, n, -1).cpu().numpy(), lps.reshape(b, n, -1).cpu().numpy()
        for i, row in enumerate(rows):
            self.parts[row].append((stored[i],) + ((ids[i], lps[i]) if self.topk else ()))

    def row(self, i: int) -> list[np.ndarray]:
        """Row i's arrays, positions in order: [hidden [n, H]] (+ [topk ids [n, k], log-probs [n, k]])."""
        return [np.concatenate(a) for a in zip(*self.parts[i])]


class HiddenShards:
    """The shards of one distillation output `out` (in `OUT.hidden/`)."""

    def __init__(self, out):
        out = Path(out)
        self.root = out.with_name(out.name + ".hidden")
        self.root.mkdir(parents=True, exist_ok=True)

    def paths(self) -> list[Path]:
        """The finished shards: NNNNNN.npz only (a temporary file of a killed write is named .NNNNNN.tmp)."""
        return sorted(p for p in self.root.glob("*.npz") if p.stem.isdigit())

    def write(self, indices: list[int], capture: HiddenCapture, lengths: list[int]) -> None:
        """One batch: prompt indices, their record lengths (prompt + completion) and the captured rows."""
        rows = [capture.row(i) for i in range(len(indices))]
        for n, r in zip(lengths, rows):
            if len(r[0]) != n - 1:
                raise RuntimeError(f"captured {len(r[0])} hidden states for a record of {n} tokens (want {n - 1})")
        names = ["hidden", "topk_ids", "topk_logprobs"][: len(rows[0])]
        arrays = {name: np.concatenate([r[j] for r in rows]) for j, name in enumerate(names)}
        last = self.paths()
        path = self.root / f"{int(last[-1].stem) + 1 if last else 0:06d}.npz"
        tmp = path.with_name(f".{path.stem}.tmp")  # never matched by paths(), replaced by the next write
        with open(tmp, "wb") as f:
            np.savez(f, index=np.asarray(indices, np.int64), stored=np.asarray(lengths, np.int64) - 1, **arrays)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)

    def assemble(self, records, tokenizer, identity: dict, vocab_size: int, out, *, topk: int, hidden_dtype: str,
                 compute: str) -> int:
        """Write the features directory `out` for the records file `records` (distilled computing in `compute`)
        from the shards; returns its records. `out` may only hold features assembled for the same records file."""
        with writer_lock(out):
            return self._assemble(records, tokenizer, identity, vocab_size, out, topk=topk,
                                  hidden_dtype=hidden_dtype, compute=compute)

    def _assemble(self, records, tokenizer, identity, vocab_size, out, *, topk, hidden_dtype, compute) -> int:
        files, raw, docs = read_distilled(records, tokenizer)
        where = {}  # prompt index -> (shard, first row, rows); a later shard replaces a left-over one
        for s, path in enumerate(self.paths()):
            z = _read_shard(path, ("index", "stored"))
            starts = np.concatenate([[0], np.cumsum(z["stored"])])
            for j, i in enumerate(z["index"].tolist()):
                where[i] = (s, int(starts[j]), int(z["stored"][j]))
        missing = [r["index"] for r in raw if r["index"] not in where]
        if missing:
            raise ValueError(f"{records}: {len(missing)} records have no hidden-state shard in {self.root} (e.g. "
                             f"prompt {missing[0]}): they were distilled without --features; build the features with "
                             "`mtpkit features` instead")
        arrays, _ = open_features(identity, vocab_size, files, docs, out, topk=topk, hidden_dtype=hidden_dtype,
                                  compute=compute, writer=writer_name(records),
                                  fresh=True)
        offsets = np.concatenate([[0], np.cumsum([len(d) for d, _ in docs])])
        by_shard: dict[int, list[int]] = {}
        for r, rec in enumerate(raw):
            by_shard.setdefault(where[rec["index"]][0], []).append(r)
        names = ["hidden"] + (["topk_ids", "topk_logprobs"] if topk else [])
        paths = self.paths()
        for s, recs in by_shard.items():
            shard = _read_shard(paths[s], names)
            if topk and ("topk_ids" not in shard or shard["topk_ids"].shape[1] < topk):
                raise ValueError(f"{paths[s]} holds fewer than the top-{topk}: use the --topk the run was "
                                 "distilled with")
            for r in recs:
                _, a, n = where[raw[r]["index"]]
                for name in names:
                    arrays[name][offsets[r] : offsets[r] + n] = shard[name][a : a + n][:, : arrays[name].shape[1]]
                    arrays[name][offsets[r] + n] = 0
        for arr in arrays.values():
            arr.flush()
        mark_done(out, len(docs))
        return len(docs)
