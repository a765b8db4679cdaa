"""One writer per output across processes: a second writer is refused naming the holder's pid, and a holder
killed with -9 leaves no stale lock (the kernel drops a flock with its process)."""

import signal
import subprocess
import sys

import pytest

from mtpkit.locking import OutputBusy, OutputLock


def test_a_live_holder_is_named_and_a_killed_one_frees_the_output(tmp_path):
    lock = tmp_path / "out.lock"
    code = ("import sys, time\nfrom mtpkit.locking import OutputLock\n"
            f"held = OutputLock({str(lock)!r}, 'x')\nprint('held', flush=True)\ntime.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputBusy, match=rf"out is being written by another process \(pid {holder.pid} on "):
            OutputLock(lock, "out")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    with OutputLock(lock, "out"):  # no stale lock after a kill -9
        pass
