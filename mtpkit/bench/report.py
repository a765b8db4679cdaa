"""The benchmark report: a terminal/markdown summary in the spirit of the seed's, and an optional plot."""

from __future__ import annotations

from pathlib import Path

RULE = "=" * 78


def _short(text: str, n: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= n else flat[: n - 1] + "…"


def render(report: dict, decode, samples: int = 4) -> str:
    """Plain-text report; `decode(ids) -> str` turns sample outputs into text."""
    runs = report["runs"]
    best = max(runs, key=lambda r: r["speedup"])
    mark = {True: "✓ identical", False: "✗ DIFFERENT", None: "(sampling: not compared)"}
    mode = "greedy" if report["temperature"] == 0 else f"temperature {report['temperature']}"
    lines = [
        RULE,
        f"  MTP self-speculative decoding — {report['model']}",
        RULE,
        f"  {mode} · KV cache · "
        f"{report['dtype']} · {report['device']} ({report['threads']} threads) · {report['num_tokens']} tokens/prompt · "
        f"{best['prompts']} prompts · median of {report['repeats']}",
        "",
        f"  ▶ {best['speedup']:.2f}× faster decoding at k={best['draft_tokens']}  "
        f"({best['baseline_tokens_per_s']:.1f} → {best['spec_tokens_per_s']:.1f} tok/s)  ·  "
        f"{'lossless (identical output)' if best['identical'] else mark[best['identical']]}",
        f"  ▶ draft acceptance {best['acceptance_rate']:.0%}  ·  {best['mean_acceptance_length']:.2f} tokens per "
        f"model forward (vs 1.00 baseline)",
    ]
    if "hf_tokens_per_s" in report:
        lines.append(f"  ▶ vs transformers generate(): {report['hf_tokens_per_s']:.1f} tok/s → "
                     f"{best['spec_tokens_per_s'] / report['hf_tokens_per_s']:.2f}× (mtpkit plain: "
                     f"{best['baseline_tokens_per_s'] / report['hf_tokens_per_s']:.2f}×)")
    lines += ["", "  Per draft length", f"  {'k':>3} {'base t/s':>9} {'spec t/s':>9} {'speedup':>8} {'accept':>7} "
              f"{'mean len':>9}  per-position acceptance   output", "  " + "-" * 74]
    for r in runs:
        pos = " ".join(f"{a:.2f}" for a in r["accepted_per_position"])
        lines.append(f"  {r['draft_tokens']:>3} {r['baseline_tokens_per_s']:>9.1f} {r['spec_tokens_per_s']:>9.1f} "
                     f"{r['speedup']:>7.2f}× {r['acceptance_rate']:>6.0%} {r['mean_acceptance_length']:>9.2f}  "
                     f"{pos:<24} {mark[r['identical']]}")
    lines += ["", f"  Sample generations (k={best['draft_tokens']}; plain and speculative produce the same text)",
              "  " + "-" * 74]
    for i, (s, pp) in enumerate(zip(report["samples"][:samples], best["per_prompt"][:samples]), 1):
        lines += [f"  [{i}] {_short(s['prompt'], 72)}", f"      {_short(decode(s['output_ids']), 300)}",
                  f"      {pp['speedup']:.2f}× · accept {pp['acceptance_rate']:.0%} · {mark[pp['identical']]}"]
    lines += ["", f"  Per-prompt metrics (k={best['draft_tokens']})",
              f"  {'prompt':<34} {'kind':<6} {'base t/s':>9} {'spec t/s':>9} {'speedup':>8} {'accept':>7}",
              "  " + "-" * 74]
    for pp in best["per_prompt"]:
        lines.append(f"  {_short(pp['prompt'], 34):<34} {pp['kind']:<6} {pp['baseline_tokens_per_s']:>9.1f} "
                     f"{pp['spec_tokens_per_s']:>9.1f} {pp['speedup']:>7.2f}× {pp['acceptance_rate']:>6.0%}")
    lines.append(f"  {'OVERALL':<41} {best['baseline_tokens_per_s']:>9.1f} {best['spec_tokens_per_s']:>9.1f} "
                 f"{best['speedup']:>7.2f}× {best['acceptance_rate']:>6.0%}")
    lines.append(RULE)
    return "\n".join(lines)


def plot(report: dict, path) -> Path:
    """Acceptance per draft position (one line per k) and speedup per k, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for r in runs:
        a.plot(range(1, r["draft_tokens"] + 1), r["accepted_per_position"], marker="o", label=f"k={r['draft_tokens']}")
    a.set(xlabel="draft position", ylabel="acceptance (per verification step)", ylim=(0, 1), title="Acceptance")
    a.legend()
    ks = [r["draft_tokens"] for r in runs]
    b.bar([str(k) for k in ks], [r["speedup"] for r in runs], color="tab:green")
    b.axhline(1.0, color="gray", lw=1)
    b.set(xlabel="draft tokens k", ylabel="speedup over plain decoding", title="Speedup")
    fig.suptitle(f"{report['model']}, {report['num_tokens']} tokens, {report['dtype']}, {report['device']}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
