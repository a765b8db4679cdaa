"""Reading training data: text, JSONL and Parquet files -> raw documents (strings, or the records' fields)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

TEXT_EXT = {".txt", ".text", ".md"}
JSONL_EXT = {".jsonl", ".json"}
PARQUET_EXT = {".parquet"}


class DataError(ValueError):
    """Training data that cannot be used (missing, empty, unreadable, too short)."""


def _format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    ext = path.suffix.lower()
    if ext in TEXT_EXT:
        return "text"
    if ext in JSONL_EXT:
        return "jsonl"
    if ext in PARQUET_EXT:
        return "parquet"
    raise DataError(
        f"cannot tell the format of {path} from its extension: use .txt/.md, .jsonl or .parquet, or set data.format"
    )


def list_files(paths: list[str], fmt: str = "auto") -> list[Path]:
    """Files named by `paths` (a directory contributes its data files, recursively, sorted)."""
    if not paths:
        raise DataError("no training data: set data.paths to files or directories (.txt, .jsonl, .parquet)")
    files = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data path {path} does not exist")
        if not path.is_dir() and not path.is_file():  # reading a FIFO blocks until a writer comes, maybe never
            raise DataError(f"data path {path} is not a regular file (a FIFO, socket or device): copy the data into "
                            "a file and name that")
        if path.is_dir():
            known = TEXT_EXT | JSONL_EXT | PARQUET_EXT
            found = sorted(f for f in path.rglob("*") if f.is_file() and (fmt != "auto" or f.suffix.lower() in known))
            if not found:
                raise DataError(f"data directory {path} holds no .txt, .md, .jsonl or .parquet files")
            files += found
        else:
            files.append(path)
    return files


def _split_text(text: str, how: str) -> list[str]:
    if how == "file":
        parts = [text]
    elif how == "paragraph":
        parts = re.split(r"\n\s*\n", text)
    else:
        parts = text.splitlines()
    return [p for p in parts if p.strip()]


def _check(check, rec: dict, where: str) -> None:
    problem = check(rec) if check is not None else None
    if problem:
        raise DataError(f"{where} {problem}")


def read_records(files: list[Path], fmt: str, field: str, text_split: str = "file", whole: bool = False,
                 check: Callable[[dict], str | None] | None = None) -> list:
    """Raw documents: strings (pretraining text) or whatever `field` holds in JSONL/Parquet records (the whole
    record when `whole`, e.g. pre-tokenized input_ids with their loss_mask). `check(record)` says what is wrong
    with a record (or None): reported with its file and line (Parquet: row)."""
    docs = []
    for f in files:
        kind = _format_of(f, fmt)
        if kind == "text":
            docs += _split_text(f.read_text(encoding="utf-8", errors="replace"), text_split)
        elif kind == "jsonl":
            with open(f, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{f}:{n} is not valid JSON ({e})") from None
                    if not isinstance(rec, dict) or field not in rec:
                        keys = ", ".join(rec) if isinstance(rec, dict) else type(rec).__name__
                        raise DataError(f"{f}:{n} has no '{field}' field (it has: {keys}); set data.text_field / "
                                        "data.messages_field")
                    _check(check, rec, f"{f}:{n}")
                    docs.append(rec if whole else rec[field])
        elif kind == "parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise DataError(f"reading {f} needs pyarrow: pip install 'mtpkit[train]'") from None

            schema = pq.read_schema(f)
            if field not in schema.names:
                raise DataError(f"{f} has no '{field}' column (it has: {', '.join(schema.names)})")
            table = pq.read_table(f, columns=None if whole else [field])
            rows = table.to_pylist()
            for n, rec in enumerate(rows, 1):
                _check(check, rec, f"{f} row {n}")
            docs += rows if whole else [rec[field] for rec in rows]
        else:
            raise DataError(f"unknown data format {kind!r}")
    return docs
