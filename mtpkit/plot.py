"""`mtpkit plot RUN_DIR`: the loss curves (main and per MTP depth) and the MTP top-1 accuracy per depth, from
the run's metrics.jsonl, to one PNG (matplotlib, the `plot` extra)."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir) -> list[dict]:
    """metrics.jsonl records, one per step (a step logged twice, e.g. redone after a resume, keeps its last)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} an mtpkit run directory?")
    by_step = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # blank, or half-written by a run that was killed
            continue
        by_step[rec["step"]] = rec
    if not by_step:
        raise ValueError(f"{path} has no records yet")
    return [by_step[s] for s in sorted(by_step)]


def _smooth(ys: list[float | None], k: int) -> list[float | None]:
    out, window = [], []
    for y in ys:
        if y is None:
            out.append(None)
            continue
        window = (window + [y])[-k:]
        out.append(sum(window) / len(window))
    return out


def plot_run(run_dir, out=None, smooth: int | None = None) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("mtpkit plot needs matplotlib: pip install 'mtpkit[plot]'") from None
    recs = read_metrics(run_dir)
    steps = [r["step"] for r in recs]
    k = smooth or max(1, len(recs) // 50)
    depth = max((len(r.get("mtp_loss") or []) for r in recs), default=0)
    fig, axes = plt.subplots(1, 2 if depth else 1, figsize=(12 if depth else 6, 4.2), squeeze=False)
    ax = axes[0][0]
    ax.plot(steps, _smooth([r["main_loss"] for r in recs], k), label="main (next token)", color="black")
    for d in range(depth):
        ys = [(r["mtp_loss"] or [None] * depth)[d] for r in recs]
        ax.plot(steps, _smooth(ys, k), label=f"MTP depth {d + 1} (token t+{d + 2})", color=f"C{d}")
    val = [r for r in recs if "val_main_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_main_loss"] for r in val], "o--", color="black", ms=3,
                label="main, held out")
        for d in range(depth):
            ax.plot([r["step"] for r in val], [r["val_mtp_loss"][d] for r in val], "o--", ms=3, color=f"C{d}",
                    label=f"depth {d + 1}, held out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title("training loss" + (f" (moving average over {k} steps)" if k > 1 else ""))
    ax.grid(alpha=0.3)
    ax.legend()
    if depth:
        ax = axes[0][1]
        for d in range(depth):
            ys = [(r["mtp_acc"] or [None] * depth)[d] for r in recs]
            ax.plot(steps, _smooth(ys, k), label=f"depth {d + 1} (token t+{d + 2})", color=f"C{d}")
            if val:
                ax.plot([r["step"] for r in val], [r["val_mtp_acc"][d] for r in val], "o--", ms=3, color=f"C{d}",
                        label=f"depth {d + 1}, held out")
        ax.set_xlabel("step")
        ax.set_ylabel("teacher-forced top-1 accuracy")
        ax.set_title("MTP teacher-forced top-1 accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    name = Path(run_dir).resolve().name
    tps = sorted(r.get("tokens_per_s", 0) for r in recs)
    fig.suptitle(f"{name}: {len(recs)} steps, {sum(r.get('tokens', 0) for r in recs) / 1e6:.2f}M tokens, "
                 f"median {tps[len(tps) // 2] / 1e3:.1f}k tokens/s")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
