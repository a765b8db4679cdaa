"""Writes that never leave a half-written or mixed checkpoint: build in a temporary sibling, fsync, rename.

A target that already holds files is refused unless `overwrite=True`; then the old weights (every
`*.safetensors` and the index) are dropped, so a smaller new checkpoint can never be read together with a
stale shard or index of the old one. Files that are not weights (a README, say) are kept.

A directory is replaced as one unit: the complete new directory is built beside it (`.NAME.PID.tmp`, with the
old directory's other files copied in), then the old one is renamed aside (`.NAME.PID.old`) and the new one into
its place. Per-file renames could be cut by a kill between two files (new weights beside an old tokenizer, which
loads without complaint). A kill between the two directory renames leaves no NAME; the next write there (or
`recover`) puts the old directory back and removes the copies of writers that are gone.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointError

# what belongs to the weights: not carried over from the directory a save replaces (draft_vocab.json: an old head's
# draft vocabulary, checkpoint/hf.py)
_WEIGHT_GLOBS = ("*.safetensors", "model.safetensors.index.json", "draft_vocab.json")


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def recover(out) -> None:
    """Undo what a killed `write_dir` left beside `out`: the old directory renamed back when the swap was cut
    between its two renames, and the copies of writers no longer running removed."""
    out = Path(out)
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(\d+)\.(tmp|old)")
    for p in sorted(out.parent.glob(f".{glob.escape(out.name)}.*"), key=lambda p: p.name.endswith(".tmp")):
        m = pattern.fullmatch(p.name)
        if m is None or (int(m[1]) != os.getpid() and _alive(int(m[1]))):  # another live writer's
            continue
        if m[2] == "old" and not out.exists():
            os.replace(p, out)
        else:
            shutil.rmtree(p, ignore_errors=True)


def _keep_others(old: Path, new: Path) -> None:
    """Copy into `new` the files of `old` that are neither weights nor written anew (a README, say)."""
    weights = {p for pattern in _WEIGHT_GLOBS for p in old.glob(pattern)}
    for p in old.rglob("*"):
        dest = new / p.relative_to(old)
        if p.is_file() and p not in weights and not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dest)


def write_dir(out, fill: Callable[[Path], None], *, overwrite: bool = False) -> Path:
    """`fill(tmp)` writes the checkpoint into a temporary sibling directory, which (with the old directory's files
    that are not weights) is fsynced and swapped in for `out` as a whole."""
    out = Path(out)
    recover(out)
    check_target(out, overwrite, is_file=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, aside = (out.with_name(f".{out.name}.{os.getpid()}.{kind}") for kind in ("tmp", "old"))
    tmp.mkdir()
    try:
        fill(tmp)
        if out.is_dir():
            _keep_others(out, tmp)
        for p in tmp.rglob("*"):
            if p.is_file():
                os.chmod(p, _default_file_mode())  # safetensors writes 0600; the result should read like any file
                fsync(p)
        fsync(tmp)
        if out.exists():
            os.replace(out, aside)
        try:
            os.replace(tmp, out)
        except BaseException:
            if aside.exists():
                os.replace(aside, out)
            raise
        fsync(out.parent)
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
