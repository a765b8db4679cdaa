"""`mtpkit plot RUN_DIR [--out PNG]`: loss and MTP accuracy curves of a run (needs matplotlib)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="draw a run's loss and MTP accuracy curves to a PNG")
    p.add_argument("run_dir", help="run directory (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/curves.png)")
    p.add_argument("--smooth", type=int, default=0, help="moving-average window in steps (default: auto)")


def run(args) -> int:
    from ..plot import plot_run

    out = plot_run(args.run_dir, args.out, smooth=args.smooth or None)
    print(f"wrote {out}")
    return 0
