"""The decode router's measurements kept on disk per machine, so that they outlive the process.

Calibrating a new row count times every candidate product over all of the model's weights: ~3 s for
SmolLM2-135M on a 2-core AVX2 EPYC, paid by every process, so the first speculative call of `mtpkit generate` ran
several times slower than the second; and a calibration taken while another job ran kept its routes for the rest
of that process. The store keeps each choice with its timings, keyed by what decides them: the machine (CPU model
and flags, torch version, the thin kernel's sources) names the file, threads / rows / dtype / weight shape the
entry. A whole-layer decision (fused op or modules, `MatmulRouter.layer`) is kept the same way.

Measurements taken while other processes shared this process's CPUs are used by that process only, never
stored (`LoadWatch`): load skews candidates unevenly (one calibration taken beside a training job timed the
one-row thin kernel at 3-5x its real cost and the two-row one at its real cost, and every later process decoded
plainly 27% slower from the stored choice). And a process checks the first row count it finds stored with one timed
pass of the stored routes over the weights (about one step's products): a pass faster than the stored figures by
more than `DRIFT` means they were measured under load, and that row count is calibrated again and rewritten (and
the next one read is checked in turn); otherwise the stored routes are used, that row count's and the others' (a
pass slower than stored means this process runs under load, which is no time to calibrate). The file is a cache: a
damaged one is set aside with a warning and rebuilt. `MTPKIT_ROUTES` names another directory, or `off`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import time
import warnings
from collections import deque
from pathlib import Path

import torch

from ..assets import cache_dir
from ..kernels import thin_matmul

DRIFT = 0.85  # a check pass under this share of the stored time: the stored calibration ran under load
FORMAT = 2  # bumped when what an entry means changes: older files are not read (2: measured on quiet CPUs only)
# other processes' work on this process's CPUs, in cores, above which a measurement is not stored: one core taken
# from a parallel region's thread stalls the region, however many cores the machine has
LOAD_LIMIT = 0.2
LOAD_WINDOW = 1.0  # seconds: load is judged over at least this long where the watch has seen that much


def cpu_description() -> str:
    """The CPU's model name and feature flags (what decides which product streams fastest)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return f"{fields.get('model name', platform.processor())} | {fields.get('flags', fields.get('Features', ''))}"


def _busy_ticks(cpus: set[int]) -> int | None:
    """Clock ticks the CPUs in `cpus` spent running anything (user, nice, system, irq, softirq and a VM's steal:
    /proc/stat), None where that file is not there."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
            total += user + nice + system + irq + softirq + steal
    return total


class LoadWatch:
    """Whether other processes have been sharing this process's CPUs: the CPU time those CPUs spent on anything but
    this process and its children (a VM's steal included) per second, i.e. in cores, over the last LOAD_WINDOW
    seconds or more (from the newest reading that old, else the first). Linux only: elsewhere every measurement
    counts as quiet."""

    def __init__(self):
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.tick = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
        self.readings: deque = deque(maxlen=32)
        self.read()

    def read(self) -> tuple[float, int, float] | None:
        ticks = _busy_ticks(self.cpus)
        if ticks is None:
            return None
        t = os.times()  # this process's CPU time and its finished children's (the kernel build's ninja check)
        reading = (time.perf_counter(), ticks, t.user + t.system + t.children_user + t.children_system)
        self.readings.append(reading)
        return reading

    def other_cores(self) -> float | None:
        """Other processes' work on this process's CPUs since the base reading, in cores; None without /proc/stat."""
        base = next((r for r in reversed(self.readings) if time.perf_counter() - r[0] >= LOAD_WINDOW),
                    self.readings[0] if self.readings else None)
        now = self.read()
        if base is None or now is None or now[0] <= base[0]:
            return None
        # every counter is in whole ticks: each CPU's and this process's can be one off at each end of the window
        others = (now[1] - base[1]) * self.tick - (now[2] - base[2]) - 2 * (len(self.cpus) + 1) * self.tick
        return max(others, 0.0) / (now[0] - base[0])

    def quiet(self) -> bool:
        cores = self.other_cores()
        return cores is None or cores <= LOAD_LIMIT


def machine_key() -> str:
    """A name for this machine and software: CPU model and flags, torch version, the thin kernel's sources."""
    parts = [cpu_description(), torch.__version__, thin_matmul.extension_name(), str(FORMAT)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def entry_key(*parts) -> str:
    """threads, rows, dtype and shapes as one JSON key, e.g. '2|4|float32|576x1536'."""
    def text(p):
        if isinstance(p, torch.dtype):
            return str(p).removeprefix("torch.")
        if isinstance(p, tuple):
            return ",".join(map(text, p)) if p and isinstance(p[0], tuple) else "x".join(map(str, p))
        return str(p)
    return "|".join(map(text, parts))


class RouteStore:
    """{section: {entry key: value}} in one JSON file; `put` merges under a flock, so processes sharing the file
    never lose each other's entries, and replaces the file whole (a kill never leaves half of one)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries = self._read()

    @classmethod
    def default(cls) -> RouteStore | None:
        """This machine's store under $MTPKIT_ROUTES (default: the mtpkit cache's routes/); None when it is `off`."""
        where = os.environ.get("MTPKIT_ROUTES")
        if where == "off":
            return None
        root = Path(where).expanduser() if where else cache_dir() / "routes"
        return cls(root / f"{machine_key()}.json")

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError("not a route store of this format")
            return {k: v for k, v in data.items() if isinstance(v, dict)}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            aside = self.path.with_name(self.path.name + ".bad")
            try:
                os.replace(self.path, aside)
            except FileNotFoundError:  # another process set it aside first
                pass
            warnings.warn(f"mtpkit: the decode route store {self.path} could not be read ({e}); moved to {aside}, "
                          "the routes are measured again")
            return {}

    def get(self, section: str, key: str):
        return self.entries.get(section, {}).get(key)

    def put(self, section: str, values: dict) -> None:
        """Merge `values` into `section`, with what other processes wrote since this one read the file."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                self.entries = self._read()
                self.entries.setdefault(section, {}).update(values)
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"format": FORMAT, **self.entries}, indent=0))
                os.replace(tmp, self.path)
        except OSError as e:  # a read-only or full disk: the routes still hold for this process
            self.entries.setdefault(section, {}).update(values)
            warnings.warn(f"mtpkit: could not write the decode route store {self.path} ({e}); the next process "
                          "measures the routes again")
