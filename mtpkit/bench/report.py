"""The benchmark report: a terminal/markdown summary in the spirit of the seed's, and an optional plot."""

from __future__ import annotations

from pathlib import Path

from ..decode.draft_spec import DraftSpec

RULE = "=" * 78


BASELINES = {"hf": "transformers generate()", "pld": "transformers prompt lookup"}


def _short(text: str, n: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= n else flat[: n - 1] + "…"


def _pct(x) -> str:
    """A rate as a percentage; "-" where there was nothing to rate (a prompt that stopped before any draft)."""
    return "-" if x is None else f"{x:.0%}"


def label(run: dict) -> str:
    """A report row's drafting configuration, as `DraftSpec.label` names it."""
    return DraftSpec.of(run).label


def _baseline_lines(report: dict, best: dict) -> list[str]:
    lines = []
    for name, what in BASELINES.items():
        if f"{name}_tokens_per_s" not in report:
            continue
        tps = report[f"{name}_tokens_per_s"]
        if name == "pld":
            what += f" (prompt_lookup_num_tokens={report['prompt_lookup_num_tokens']})"
        same = f"identical to plain greedy on {report[f'{name}_identical_prompts']}/{best['prompts']} prompts"
        lines.append(f"  ▶ vs {what}: {tps:.1f} tok/s → {best['spec_tokens_per_s'] / tps:.2f}× (mtpkit plain: "
                     f"{best['baseline_tokens_per_s'] / tps:.2f}×) · {same}")
    return lines


def _auto_line(runs: list[dict], mark: dict) -> list[str]:
    """draft="auto" against the best fixed row of the same run, where both ran: what auto promises to match."""
    auto = [r for r in runs if r.get("auto")]
    fixed = [r for r in runs if not r.get("auto")]
    if not auto or not fixed:
        return []
    best = max(fixed, key=lambda r: r["spec_tokens_per_s"])
    return [f"  ▶ draft=auto {auto[0]['speedup']:.2f}×: {auto[0]['spec_tokens_per_s'] / best['spec_tokens_per_s']:.2f} "
            f"of the best fixed row's tokens/s ({label(best)}, {best['speedup']:.2f}×) · {mark[auto[0]['identical']]}"]


def _table(runs: list[dict], mark: dict) -> list[str]:
    gated = any(r.get("draft_min_prob") for r in runs)
    trees = any(r.get("draft_widths") for r in runs)
    looked = any(r.get("draft_lookup") for r in runs)
    width = max(len(label(r)) for r in runs)
    head = (f"  {'row':<{width}}" + (f" {'verified':>8}" if trees else "") + (f" {'looked up':>9}" if looked else "")
            + f" {'base t/s':>9} {'spec t/s':>9} {'speedup':>8} "
            f"{'accept':>7} {'mean len':>9} {'break-even':>11} {'realised':>9}"
            + (f" {'drafts/step':>12}" if gated else "")
            + "  per-position acceptance   output")
    lines = [head, "  " + "-" * (len(head) - 2)]
    for r in runs:
        pos = " ".join(f"{a:.2f}" for a in r["accepted_per_position"])
        be = "-" if r.get("break_even") is None else f"{r['break_even']:.2f}"
        real = "-" if r.get("realised_break_even") is None else f"{r['realised_break_even']:.2f}"
        lines.append(f"  {label(r):<{width}}" + (f" {r['verified_tokens_per_step']:>8.2f}" if trees else "")
                     + (f" {r.get('context_drafted_share', 0):>9.0%}" if looked else "")
                     + f" {r['baseline_tokens_per_s']:>9.1f} {r['spec_tokens_per_s']:>9.1f} {r['speedup']:>7.2f}× "
                     f"{r['acceptance_rate']:>6.0%} {r['mean_acceptance_length']:>9.2f} {be:>11} {real:>9}"
                     + (f" {r['drafted_per_step']:>12.2f}" if gated else "") + f"  {pos:<24} "
                     + (f"✗ {r['identical_prompts']}/{r['prompts']} identical" if r["identical"] is False
                        else mark[r["identical"]]))
    return lines


def _difference_lines(report: dict) -> list[str]:
    """Where a greedy output differs from plain decoding: the first differing token and the plain model's top-2
    logit gap there, so a reader can tell a rounding tie from a bug."""
    rows = [(label(r), pp["prompt"], pp["first_difference"]) for r in report["runs"] for pp in r["per_prompt"]
            if pp.get("first_difference")]
    for name in BASELINES:
        for s, d in zip(report["samples"], report.get(f"{name}_first_differences") or []):
            if d:
                rows.append((name, s["prompt"], d))
    if not rows:
        return []
    lines = ["", "  Outputs that differ from plain decoding: first differing token, plain model's top-2 logit gap there",
             f"  {'row':<11} {'prompt':<40} {'token':>6} {'top-2 gap':>10} {'top-1':>8}  other = plain's 2nd?"]
    for row, prompt, d in rows:
        lines.append(f"  {row:<11} {_short(prompt, 40):<40} {d['position']:>6} {d['top2_gap']:>10.4f} "
                     f"{d['top1']:>8.3f}  {'yes' if d['other_is_top2'] else 'no'}")
    return lines


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
        f"  ▶ {best['speedup']:.2f}× faster decoding at {label(best)}  "
        f"({best['baseline_tokens_per_s']:.1f} → {best['spec_tokens_per_s']:.1f} tok/s)  ·  "
        f"{'lossless (identical output)' if best['identical'] else mark[best['identical']]}",
        f"  ▶ draft acceptance {best['acceptance_rate']:.0%}  ·  {best['mean_acceptance_length']:.2f} tokens per "
        f"model forward (vs 1.00 baseline)",
    ]
    lines += _auto_line(runs, mark)
    lines += _baseline_lines(report, best)
    lines += ["", "  Per draft length (break-even: the mean acceptance length at which speculation pays, from timed "
              "step costs;", "  realised: mean len / speedup, what a step cost in plain steps in these runs;",
              "  w: a draft tree's tokens per draft position, verified: tokens per verify forward)",
              *_table(runs, mark)]
    lines += _difference_lines(report)
    lines += ["", f"  Sample generations ({label(best)}; plain and speculative produce the same text)",
              "  " + "-" * 74]
    for i, (s, pp) in enumerate(zip(report["samples"][:samples], best["per_prompt"][:samples]), 1):
        lines += [f"  [{i}] {_short(s['prompt'], 72)}", f"      {_short(decode(s['output_ids']), 300)}",
                  f"      {pp['speedup']:.2f}× · accept {_pct(pp['acceptance_rate'])} · {mark[pp['identical']]}"]
    lines += ["", f"  Per-prompt metrics ({label(best)})",
              f"  {'prompt':<34} {'kind':<6} {'base t/s':>9} {'spec t/s':>9} {'speedup':>8} {'accept':>7}",
              "  " + "-" * 74]
    for pp in best["per_prompt"]:
        lines.append(f"  {_short(pp['prompt'], 34):<34} {pp['kind']:<6} {pp['baseline_tokens_per_s']:>9.1f} "
                     f"{pp['spec_tokens_per_s']:>9.1f} {pp['speedup']:>7.2f}× {_pct(pp['acceptance_rate']):>6}")
    lines.append(f"  {'OVERALL':<41} {best['baseline_tokens_per_s']:>9.1f} {best['spec_tokens_per_s']:>9.1f} "
                 f"{best['speedup']:>7.2f}× {best['acceptance_rate']:>6.0%}")
    lines.append(RULE)
    return "\n".join(lines)


def render_contexts(report: dict) -> str:
    """Plain-text table of the context-length sweep: acceptance (and speed, unless it was measured with
    --acceptance-only: "-") per context length and row."""
    mark = {True: "✓", False: "✗ DIFFERENT", None: "-"}
    timed = "batch_size" not in report["contexts"][0]
    how = (f"median of {report['repeats']}" if timed
           else f"acceptance only, batches of {report['contexts'][0]['batch_size']}")
    lines = [RULE, f"  MTP acceptance across context lengths — {report['model']}, head {report['mtp_head']}", RULE,
             f"  {report['source']} · {report['num_tokens']} new tokens/prompt · {report['dtype']} · "
             f"{report['device']} ({report['threads']} threads) · {how}",
             "  each prompt: the same continuation point, left-padded with earlier text of its document", "",
             f"  {'context':>7} {'prompts':>7} {'row':<11} {'accept':>7} {'mean len':>9} {'break-even':>11} "
             f"{'speedup':>8}  per-position acceptance   identical", "  " + "-" * 96]
    for c in report["contexts"]:
        for r in c["runs"]:
            pos = " ".join(f"{a:.2f}" for a in r["accepted_per_position"])
            be = "-" if r.get("break_even") is None else f"{r['break_even']:.2f}"
            speedup = f"{r['speedup']:>7.2f}×" if timed else f"{'-':>8}"
            lines.append(f"  {c['context_tokens']:>7} {r['prompts']:>7} {label(r):<11} {r['acceptance_rate']:>6.0%} "
                         f"{r['mean_acceptance_length']:>9.2f} {be:>11} {speedup}  {pos:<24}  "
                         f"{mark[r.get('identical')]}")
    lines += _first_draft_shares(report["contexts"])
    lines.append(RULE)
    return "\n".join(lines)


def _first_draft_shares(contexts: list[dict]) -> list[str]:
    """Per row, each context's first-draft acceptance as a share of the shortest context's: the fall with context
    length that long-context training is meant to flatten, read off directly."""
    if len(contexts) < 2:
        return []
    lines = ["", f"  first drafts kept, as a share of the value at {contexts[0]['context_tokens']} context tokens:"]
    for j, r0 in enumerate(contexts[0]["runs"]):
        base = r0["accepted_per_position"][0]
        shares = "  ".join(f"{c['context_tokens']}: "
                           + (f"{c['runs'][j]['accepted_per_position'][0] / base:.2f}" if base else "-")
                           for c in contexts[1:])
        lines.append(f"  {label(r0):<11} {shares}")
    return lines


def _save(fig, path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(report: dict, path) -> Path:
    """Acceptance per draft position (one line per row) and speedup per row, side by side; for a context-length
    sweep, mean acceptance length and speedup against context length instead."""
    if "contexts" in report:
        return plot_contexts(report, path)
    runs = report["runs"]
    fig, (a, b) = _pyplot().subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        a.plot(range(1, len(r["accepted_per_position"]) + 1), r["accepted_per_position"], marker="o", label=label(r))
    a.set(xlabel="draft position", ylabel="acceptance (per verification step)", ylim=(0, 1), title="Acceptance",
          xticks=range(1, max(len(r["accepted_per_position"]) for r in runs) + 1))
    a.legend(fontsize="small")
    # horizontal bars: row labels such as "k=3 w=3 lookup=4" stay readable however many rows there are
    labels, speedups = [label(r) for r in runs][::-1], [r["speedup"] for r in runs][::-1]
    b.barh(labels, speedups, color="tab:green")
    for y, v in enumerate(speedups):
        b.text(v, y, f" {v:.2f}x", va="center", fontsize="small")
    b.axvline(1.0, color="gray", lw=1)
    b.set(xlabel="speedup (w: draft tree widths, p: draft_min_prob, lookup: context drafts)",
          xlim=(0, max(speedups) * 1.15), title="Speedup over plain decoding")
    fig.suptitle(f"{report['model']}, {report['num_tokens']} tokens, {report['dtype']}, {report['device']}")
    return _save(fig, path)


def plot_contexts(report: dict, path) -> Path:
    contexts = report["contexts"]
    lengths = [c["context_tokens"] for c in contexts]
    fig, (a, b) = _pyplot().subplots(1, 2, figsize=(10, 4))
    for j, r in enumerate(contexts[0]["runs"]):
        a.plot(lengths, [c["runs"][j]["mean_acceptance_length"] for c in contexts], marker="o", label=label(r))
        b.plot(lengths, [c["runs"][j]["speedup"] for c in contexts], marker="o", label=label(r))
    a.set(xscale="log", xlabel="context tokens", ylabel="mean acceptance length", title="Acceptance")
    b.axhline(1.0, color="gray", lw=1)
    b.set(xscale="log", xlabel="context tokens", ylabel="speedup over plain decoding", title="Speedup")
    for ax in (a, b):
        ax.set_xticks(lengths, [str(n) for n in lengths], minor=False)
        ax.minorticks_off()
        ax.legend()
    fig.suptitle(f"{report['model']}, {report['source']}, {report['num_tokens']} new tokens")
    return _save(fig, path)
