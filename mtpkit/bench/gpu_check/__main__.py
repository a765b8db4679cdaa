"""python -m mtpkit.bench.gpu_check --out DIR [--device cuda|cpu] [--tiny] [--budget SECONDS] [--sections ...]

Runs the three sections in turn, each guarded (a failure is recorded and the rest still runs) and each within its
share of one time budget; prints a report and writes DIR/gpu_check.json after every section. Exits 1 when a
correctness check failed or errored, else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from ...decode.step_engine import ENGINES
from . import correctness, decoding, report, training
from .common import Budget, environment

SECTIONS = ("correctness", "decoding", "training")
# each section may start work until this fraction of the budget has passed (an early finish leaves time to the next)
UNTIL = {"correctness": 0.3, "decoding": 0.55, "training": 0.95}


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mtpkit.bench.gpu_check", description=__doc__.split("\n\n")[1])
    p.add_argument("--out", required=True, help="directory for gpu_check.json")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny shapes and few tokens: a smoke test in seconds (CI)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole check (default 450 on a GPU, 300 with --tiny)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ", ".join(SECTIONS))
    p.add_argument("--peak-bandwidth", type=float, default=0.0, help="peak memory bandwidth in TB/s (default: "
                   "the datasheet figure of a known GPU)")
    p.add_argument("--engines", default="", help="comma-separated decode step engines of the decoding section "
                   "(default: eager,cuda-graph on a GPU, eager,static on CPU; see mtpkit.decode.step_engine)")
    args = p.parse_args(argv)
    args.engines = tuple(e for e in args.engines.split(",") if e)
    bad = set(args.engines) - set(ENGINES)
    if bad:
        raise ValueError(f"--engines: unknown {', '.join(sorted(bad))}; choose from {', '.join(ENGINES)}")
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        raise ValueError(f"--sections: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible; on a CPU run `--device cpu --tiny`")
    return args


def _section(name: str, args, device, budget) -> dict:
    t0 = time.perf_counter()
    try:
        if name == "correctness":
            out = correctness.run(device, args.tiny, budget, UNTIL[name])
        elif name == "decoding":
            out = decoding.run(device, args.tiny, budget, UNTIL[name], args.peak_bandwidth, args.engines)
        else:
            out = training.run(device, args.tiny, budget, UNTIL[name])
    except Exception as e:  # noqa: BLE001 - a section that breaks is recorded; the others still run
        out = {"error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc()[-3000:]}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv=None) -> int:
    try:
        args = parse(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    budget = Budget(args.budget or (300.0 if args.tiny else 450.0))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join(["python -m mtpkit.bench.gpu_check", *(argv if argv is not None else sys.argv[1:])]),
              "tiny": args.tiny, "budget_s": budget.total, "environment": environment(device), "sections": {}}
    print(f"GPU check on {result['environment'].get('gpu', args.device)} (budget {budget.total:.0f} s)", flush=True)
    lines = {"correctness": report.correctness_lines, "decoding": report.decoding_lines,
             "training": report.training_lines}
    summaries, passed = {}, True
    for name in args.sections.split(","):
        section = _section(name, args, device, budget)
        if name == "correctness":
            summaries[name], passed = correctness.summary(section)
        else:
            summaries[name] = (decoding if name == "decoding" else training).summary(section)
        if "error" in section:
            summaries[name] += f" [section error: {section['error']}]"
        section["summary"] = summaries[name]
        result["sections"][name] = section
        result["elapsed_s"] = round(budget.elapsed(), 1)
        (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=1))
        print(f"\n{name} ({section['seconds']} s)", *lines[name](section), sep="\n", flush=True)
    print("\nsummary", *(f"  {s}" for s in summaries.values()), f"  total {budget.elapsed():.0f} s; "
          f"results in {out_dir / 'gpu_check.json'}", sep="\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
