"""One writer per output: an exclusive lock (flock) on a lock file that belongs to the output.

Two runs appending to one distillation output or checkpointing into one run directory interleave their files
(duplicate records, a shard with a bad checksum, a checkpoint renamed away under the other run). The second
writer is refused at once, naming the process that holds the output. The kernel releases a flock when its holder
exits, however it exits, so a killed run never leaves a stale lock; the lock file itself stays (it holds only the
last holder's pid).
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from .errors import MtpkitError


class OutputBusy(MtpkitError):
    """Another live process is writing the same output."""


class OutputLock:
    """Hold `path` (a lock file, created if missing) exclusively until `release()` or the end of a `with`."""

    def __init__(self, path, what: str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+b")  # a file object: dropping an unreleased lock closes it (and unlocks)
        fd = self._file.fileno()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            self.release()
            raise OutputBusy(f"{what} is being written by another process ({holder}; lock {self.path}): wait for "
                             "it to finish, or write to another output") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        self._file.close()  # closing the descriptor releases the flock

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
