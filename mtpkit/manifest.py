"""Who wrote an output: a JSON manifest beside it (model fingerprint, arguments, compute dtype) that a resumed run
must match.

A run that continues an output made by another model, another dtype or other arguments would append records or
hidden states that do not belong with the ones there and report success; the manifest turns that into a refusal
naming what differs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import MtpkitError


def read_manifest(path) -> dict | None:
    """The manifest at `path`, or None when there is none."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MtpkitError(f"{path} is unreadable ({e}): delete the output it describes and start again") from None
    if not isinstance(obj, dict):
        raise MtpkitError(f"{path} does not hold a JSON object: delete the output it describes and start again")
    return obj


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_or_write_manifest(path, record: dict, output: str, fix: str) -> None:
    """Write `record` as the manifest at `path` of a new output, or, when there is one, refuse (one line naming
    each difference, then `fix`) unless it records the same."""
    path = Path(path)
    old = read_manifest(path)
    if old is None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(path)
        return
    then, now = _flat(old), _flat(json.loads(json.dumps(record)))  # as it would read back
    # a key only one side has was added or dropped by another mtpkit version: not a difference of the run
    diff = [f"{k} {then[k]!r}, now {now[k]!r}" for k in sorted(then.keys() & now.keys()) if then[k] != now[k]]
    if diff:
        raise MtpkitError(f"{output} was started with other settings ({'; '.join(diff)}; see {path}): {fix}")
