"""Section 3, training speed: FSDP2 at the Qwen3.5-0.8B and 2B shapes, sequence 4096, bf16 autocast, compile
on/off x activation checkpointing on/off x MTP on/off: tokens/s, MFU from the FLOPs model, peak memory, and the
MTP on/off ratios. One torchrun process (train_worker.py), then one per GPU where there are several."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .common import Budget
from .models import qwen35_shapes


def variants(shapes, tiny: bool) -> list[dict]:
    """Every (shape, compile, AC, MTP), in the order a cut budget should lose them last to first: without AC
    before with it, then the smaller shape first, eager before compiled, MTP off before on."""
    compiles = (False,) if tiny else (False, True)  # compiling on a CPU takes minutes
    order = list(shapes)
    runs = [dict(shape=s, compile=c, ac=a, mtp=m)
            for s, c, a, m in itertools.product(order, compiles, (False, True), (False, True))]
    return sorted(runs, key=lambda v: (v["ac"], order.index(v["shape"]), v["compile"], v["mtp"]))


def launch(spec: dict, nproc: int, timeout: float, workdir: Path) -> tuple[list[dict], str | None]:
    """Run the workers; returns their records and an error line (a crash, the timeout) or None."""
    spec_path, out = workdir / f"spec{nproc}.json", workdir / f"out{nproc}.jsonl"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "mtpkit.bench.gpu_check.train_worker", str(spec_path), str(out)]
    error = None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1))
        if proc.returncode:
            error = f"torchrun exited {proc.returncode}: {proc.stderr.strip()[-1500:]}"
    except subprocess.TimeoutExpired:
        error = f"killed after {timeout:.0f} s (time budget)"
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return records, error


def ratios(records: list[dict]) -> list[dict]:
    """MTP on / off for each (shape, compile, ac, world) measured both ways."""
    done = {(r["shape"], r["compile"], r["ac"], r["world"], r["mtp"]): r for r in records if "tokens_per_s" in r}
    out = []
    for (shape, c, a, w, mtp), on in done.items():
        off = done.get((shape, c, a, w, False))
        if mtp and off:
            r = {"shape": shape, "compile": c, "ac": a, "world": w,
                 "time_ratio": round(off["tokens_per_s"] / on["tokens_per_s"], 3),
                 "flops_ratio": round(on["flops_per_token"] / off["flops_per_token"], 3)}
            if "peak_memory_gb" in on:  # a CPU's peak RSS is a high-water mark of the whole worker: no ratio
                r["memory_ratio"] = round(on["peak_memory_gb"] / off["peak_memory_gb"], 3)
            out.append(r)
    return out


def run(device: torch.device, tiny: bool, budget: Budget, until: float) -> dict:
    shapes = qwen35_shapes(tiny, mtp_layers=0)
    spec = {"device": device.type, "configs": shapes, "seq": 256 if tiny else 4096,
            "warmup": 1 if tiny else 2, "steps": 1 if tiny else 3}
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    records, errors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        # the multi-GPU run measures the best single-process setting only (compile on, AC off) if time is left
        plans = [(1, variants(shapes, tiny))]
        if gpus > 1:
            plans.append((gpus, [v for v in variants(shapes, tiny) if v["compile"] and not v["ac"]]))
        for nproc, vs in plans:
            left = budget.left(until)
            if left < 30:
                errors.append(f"{nproc} process(es): not run (time budget)")
                continue
            # workers stop starting variants a minute before the deadline; the timeout is the hard stop
            got, error = launch({**spec, "variants": vs, "deadline_s": max(left - 60, left / 2)}, nproc, left,
                                Path(tmp))
            records += got
            if error:
                errors.append(f"{nproc} process(es): {error}")
    return {"runs": records, "mtp_ratios": ratios(records), "errors": errors, "seq": spec["seq"]}


def summary(section: dict) -> str:
    runs = [r for r in section.get("runs", []) if "tokens_per_s" in r]
    if not runs:
        return "training: no run completed" + (f" ({section['errors'][0][:200]})" if section.get("errors") else "")
    best = max(runs, key=lambda r: r["tokens_per_s"])
    line = (f"training: {len(runs)}/{len(section['runs'])} variants ran; best {best['shape']} "
            f"{'compiled' if best['compile'] else 'eager'}{' +AC' if best['ac'] else ''}"
            f"{' +MTP' if best['mtp'] else ''} x{best['world']}: {best['tokens_per_s']:.0f} tok/s")
    if "mfu" in best:
        line += f", MFU {100 * best['mfu']:.1f}%"
    ratios = section.get("mtp_ratios", [])
    if ratios:
        line += "; MTP on/off time x" + "/".join(f"{r['time_ratio']}" for r in ratios)
    failures = len(section["runs"]) - len(runs) + len(section.get("errors", []))
    return line + (f" ({failures} failed or skipped)" if failures else "")
