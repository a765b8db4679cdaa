"""Writes that never leave a half-written or mixed checkpoint: build in a temporary sibling, fsync, rename.

A target that already holds files is refused unless `overwrite=True`; then the old weights (every
`*.safetensors` and the index) are removed, so a smaller new checkpoint can never be read together with a
stale shard or index of the old one. Files that are not weights (a README, say) are left alone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointError

_WEIGHT_GLOBS = ("*.safetensors", "model.safetensors.index.json")


def fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _default_file_mode() -> int:
    """What open() would give a new file: 0666 less the process umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def check_target(out: Path, overwrite: bool, *, is_file: bool) -> None:
    """Refuse, before any work is done, to write over existing files without `overwrite`."""
    if is_file and out.is_dir():
        raise CheckpointError(f"{out} is a directory: give a file name ending in .safetensors")
    if not is_file and out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file: give a directory to write the checkpoint into")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else [out.name] if out.exists() else []
    if held and not overwrite:
        shown = ", ".join(held[:4]) + (f" (+{len(held) - 4} more)" if len(held) > 4 else "")
        raise CheckpointError(f"{out} already holds {shown}: pass overwrite=True (CLI: --overwrite) to replace "
                          "its weights, or write to a new path")


def write_file(path, fill: Callable[[Path], None], *, overwrite: bool = False) -> Path:
    """`fill(tmp)` writes the file at a temporary sibling path, which is then fsynced and renamed onto `path`."""
    path = Path(path)
    check_target(path, overwrite, is_file=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        fill(tmp)
        os.chmod(tmp, _default_file_mode())  # mkstemp makes 0600; the result should read like any new file
        fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync(path.parent)
    return path


def write_dir(out, fill: Callable[[Path], None], *, overwrite: bool = False) -> Path:
    """`fill(tmp)` writes the checkpoint into a temporary sibling directory; its files are fsynced and moved
    into `out` (created if missing), after the old weights there are removed."""
    out = Path(out)
    check_target(out, overwrite, is_file=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        fill(tmp)
        new = sorted(p for p in tmp.rglob("*") if p.is_file())
        for p in new:
            fsync(p)
        out.mkdir(exist_ok=True)
        for pattern in _WEIGHT_GLOBS:
            for old in out.glob(pattern):
                old.unlink()
        for p in new:
            dest = out / p.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(p, dest)
        fsync(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
