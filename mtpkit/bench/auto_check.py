"""`python -m mtpkit.bench.auto_check`: does draft="auto" keep its promises on this machine? Prints, side by side in
one run (tokens/s are medians of interleaved repeats; run it on a quiet machine):

1. fresh processes: plain decoding of one chat prompt in N new processes (the spread of their tokens/s around the
   median: the decode routes are read from the route store, not drawn anew; as a control, one long-lived process
   makes the same call right after each, so a process is judged against the machine's speed of that moment), and
   in each of N more, auto's first
   call against its second (a first call that calibrates runs slower); each call timed whole, from the caller;
   and `mtpkit generate --chat` with --draft off and auto, N processes each, timed from start to exit;
2. prompts where drafting fails (random token ids, a language the model barely knows, sampling at T = 1.2):
   plain, fixed k = 3 and auto;
3. long prompts (chat requests about a pasted document of 1-2k tokens, mtpkit/resources/doc_chat_heldout_prompts.jsonl):
   plain, the fixed rows that lead on short prompts, and auto.

The grid of fixed configurations on the held-out prompts is `mtpkit bench` with `--draft-auto` (its command is
printed at the end). `--quick` runs a few prompts and processes, to check the tool itself.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

import torch

from ..decode.draft_spec import DraftSpec
from ..decode.route_store import cpu_description
from ..decode.generate import generate
from ..loading import load_for_decoding
from ..prompts import load_prompts
from ..resources import resource

CHAT = "Explain in three sentences why the sky is blue."
# a language SmolLM2 barely knows (its corpus is English): a few sentences of Finnish, written for this check
FINNISH = ("Kirjoita lyhyt kertomus pienestä kylästä järven rannalla. Kylässä asui kalastaja, joka lähti joka aamu "
           "veneellään vesille ennen auringonnousua, ja hänen tyttärensä odotti häntä laiturilla illalla.")
SAMPLED_PROMPTS = 4  # held-out prompts sampled at T = 1.2 (one prompt's figure moved by +-2% between runs)
FIXED_LONG = (DraftSpec(1, draft_lookup=4), DraftSpec(3), DraftSpec(3, draft_lookup=4))

_PROCESS = """
import sys, time, mtpkit
from mtpkit.tokenizer import encode_prompt
model, tok, _, _ = mtpkit.load_for_decoding()
ids = encode_prompt(tok, sys.argv[1], True)
draft = None if sys.argv[2] == "off" else "auto"
calls = int(sys.argv[3])
for _ in range(calls) if calls else sys.stdin:  # 0 calls: one call per line read, until stdin closes
    start = time.perf_counter()  # the whole call, set-up included, as its caller waits for it
    out = mtpkit.generate(model, [ids], max_new_tokens=int(sys.argv[4]), draft=draft, eos_token_id=tok.eos_token_id)
    print(len(out.tokens[0]) / (time.perf_counter() - start), flush=True)
"""


def in_fresh_process(draft: str, calls: int, new_tokens: int) -> list[float]:
    """Tokens/s of `calls` generate calls in a new Python process (the default model, one chat prompt)."""
    out = subprocess.run([sys.executable, "-c", _PROCESS, CHAT, draft, str(calls), str(new_tokens)],
                         capture_output=True, text=True, check=True).stdout
    return [float(x) for x in re.findall(r"^[\d.]+$", out, re.M)]


def cli_seconds(draft: str, new_tokens: int) -> float:
    """Wall seconds of `mtpkit generate --prompt CHAT --chat --draft DRAFT` in a new process, start to exit."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mtpkit", "generate", "--prompt", CHAT, "--chat", "--draft", draft,
                    "--max-new-tokens", str(new_tokens)], capture_output=True, text=True, check=True)
    return time.perf_counter() - start


def fresh_processes(n: int, new_tokens: int) -> dict:
    in_fresh_process("auto", 1, new_tokens)  # the machine's first run: routes and step costs reach the store
    # the control: the same call made by one long-lived process right after each fresh process (its first call
    # left out). A VM's speed drifts over minutes (8 fresh processes in a row at 40 tok/s, a control run after them
    # at 51-58), so each process is judged against the control call beside it, and the control's own spread is
    # what the machine gives within one process
    worker = subprocess.Popen([sys.executable, "-c", _PROCESS, CHAT, "off", "0", str(new_tokens)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def control() -> float:
        worker.stdin.write("\n")
        worker.stdin.flush()
        return float(worker.stdout.readline())

    control()
    plain, one = [], []
    for _ in range(n):
        plain.append(in_fresh_process("off", 1, new_tokens)[0])
        one.append(control())
    worker.stdin.close()
    worker.wait()
    beside = [p / o for p, o in zip(plain, one)]
    pairs = [in_fresh_process("auto", 2, new_tokens) for _ in range(n)]
    cli = {"off": [], "auto": []}
    for i in range(n):  # interleaved, each order in turn
        for draft in ("off", "auto") if i % 2 else ("auto", "off"):
            cli[draft].append(cli_seconds(draft, new_tokens))
    median = statistics.median(plain)
    return {"plain_tokens_per_s": plain, "plain_median": median,
            "plain_worst_deviation": max(abs(p / median - 1) for p in plain),
            "one_process_tokens_per_s": one,
            "one_process_worst_deviation": max(abs(p / statistics.median(one) - 1) for p in one),
            "plain_over_control": beside,
            "plain_over_control_worst_deviation": max(abs(r / statistics.median(beside) - 1) for r in beside),
            "auto_first_over_second": [a / b for a, b in pairs], "auto_first_over_plain_median":
            statistics.median(a for a, _ in pairs) / median,
            "cli_seconds": cli, "cli_auto_over_off": statistics.median(cli["auto"]) / statistics.median(cli["off"])}


def interleaved(model, rows: list[list[int]], drafts: dict, new_tokens: int, repeats: int, eos,
                temperature: float = 0.0) -> dict:
    """Per label: tokens/s over the prompts (each prompt's configurations interleaved, the median of `repeats`
    runs each) and, greedy, whether every output equals plain decoding's (the first label's)."""
    for d in drafts.values():  # warm-up
        generate(model, [rows[0]], max_new_tokens=8, draft=d, eos_token_id=eos, temperature=temperature, seed=0)
    seconds = {k: [[] for _ in rows] for k in drafts}
    outputs = {}
    for r in range(repeats):
        for i, row in enumerate(rows):
            for label, d in (list(drafts.items()) if r % 2 == 0 else list(drafts.items())[::-1]):
                t = time.perf_counter()
                out = generate(model, [row], max_new_tokens=new_tokens, draft=d, eos_token_id=eos,
                               temperature=temperature, seed=r)
                seconds[label][i].append(time.perf_counter() - t)
                outputs[label, i] = out.tokens[0]
    first = next(iter(drafts))
    result = {}
    for label in drafts:
        tokens = sum(len(outputs[label, i]) for i in range(len(rows)))
        result[label] = {"tokens_per_s": tokens / sum(statistics.median(s) for s in seconds[label]),
                         "identical": None if temperature else all(outputs[label, i] == outputs[first, i]
                                                                   for i in range(len(rows)))}
    for label in drafts:
        result[label]["vs_plain"] = result[label]["tokens_per_s"] / result[first]["tokens_per_s"]
    return result


def failing_prompts(model, tok, new_tokens: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    random_ids = torch.randint(0, model.config.vocab_size, (64,), generator=g).tolist()
    finnish = tok(FINNISH, add_special_tokens=False)["input_ids"]
    held = [p.ids for p in load_prompts(resource("heldout_prompts.jsonl"), tok)[:SAMPLED_PROMPTS]]
    drafts = {"plain": None, "k=3": DraftSpec(3), "auto": "auto"}
    eos = tok.eos_token_id
    return {"random token ids": interleaved(model, [random_ids], drafts, new_tokens, repeats, eos),
            "Finnish": interleaved(model, [finnish], drafts, new_tokens, repeats, eos),
            "sampling T=1.2": interleaved(model, held, drafts, new_tokens, repeats, eos, temperature=1.2)}


def long_prompts(model, tok, n: int, new_tokens: int, repeats: int) -> dict:
    rows = [p.ids for p in load_prompts(resource("doc_chat_heldout_prompts.jsonl"), tok)[:n]]
    drafts = {"plain": None, **{s.label: s for s in FIXED_LONG}, "auto": "auto"}
    return interleaved(model, rows, drafts, new_tokens, repeats, tok.eos_token_id)


def render(report: dict) -> str:
    lines = [f"draft=auto check · {report['machine']} · torch {torch.__version__} · {report['threads']} threads",
             *([f"  {report['command']}"] if "command" in report else []), ""]
    f = report.get("fresh")
    if f:
        lines += ["1. fresh processes (one chat prompt)",
                  f"   plain tok/s: {', '.join(f'{x:.1f}' for x in f['plain_tokens_per_s'])}; median "
                  f"{f['plain_median']:.1f}, worst deviation {f['plain_worst_deviation']:.1%}",
                  f"   control, {len(f['one_process_tokens_per_s'])} calls in one process: "
                  f"{', '.join(f'{x:.1f}' for x in f['one_process_tokens_per_s'])}; worst deviation "
                  f"{f['one_process_worst_deviation']:.1%} (the machine's own spread)",
                  f"   each process / the control call after it: "
                  f"{', '.join(f'{x:.2f}' for x in f['plain_over_control'])}; worst deviation "
                  f"{f['plain_over_control_worst_deviation']:.1%} (the processes' spread net of the machine's drift)",
                  f"   auto, first call / second call in each process: "
                  f"{', '.join(f'{x:.2f}' for x in f['auto_first_over_second'])}",
                  f"   auto first call / plain median: {f['auto_first_over_plain_median']:.2f}",
                  f"   mtpkit generate --chat, whole process, median of {len(f['cli_seconds']['off'])} each: "
                  "--draft off "
                  f"{statistics.median(f['cli_seconds']['off']):.2f} s, auto "
                  f"{statistics.median(f['cli_seconds']['auto']):.2f} s ({f['cli_auto_over_off']:.3f}x the time)", ""]
    for title, key in (("2. prompts where drafting fails", "failing"), ("3. long prompts (document chats)", "long")):
        lines.append(title)
        groups = report[key] if key == "failing" else {f"{report['long_prompts']} prompts": report[key]}
        for name, rows in groups.items():
            lines.append(f"   {name}: " + "; ".join(
                f"{label} {r['tokens_per_s']:.1f} tok/s ({r['vs_plain']:.2f}x)"
                + ("" if r["identical"] is None else (" identical" if r["identical"] else " DIFFERS"))
                for label, r in rows.items()))
        lines.append("")
    lines.append("The grid on the held-out prompts: " + report["grid_command"])
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 processes, 1 repeat, 1 long prompt, 32 tokens")
    ap.add_argument("--processes", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long-prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--skip-fresh", action="store_true", help="leave out the fresh-process section")
    ap.add_argument("--out", help="also write the report here (and its figures as OUT.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.processes, args.repeats, args.long_prompts, args.new_tokens = 2, 1, 1, 32
    model, tok, _, _ = load_for_decoding()
    machine = f"{cpu_description().split(' | ')[0]} ({torch.backends.cpu.get_cpu_capability()})"
    command = " ".join(["python -m mtpkit.bench.auto_check", *(sys.argv[1:] if argv is None else argv)])
    report = {"command": command, "machine": machine, "threads": torch.get_num_threads(),
              "long_prompts": args.long_prompts}
    if not args.skip_fresh:
        report["fresh"] = fresh_processes(args.processes, args.new_tokens)
    report["failing"] = failing_prompts(model, tok, args.new_tokens, args.repeats)
    report["long"] = long_prompts(model, tok, args.long_prompts, args.new_tokens, args.repeats)
    report["grid_command"] = ("mtpkit bench --dtype float32 --prompts mtpkit/resources/heldout_prompts.jsonl "
                              "--draft-tokens 1,2,3 --draft-min-prob 0,0.3,0.6 --draft-widths 3 --draft-lookup 0,4 "
                              "--draft-auto --repeats 3 --step-repeats 0")
    text = render(report)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        with open(args.out + ".json", "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
