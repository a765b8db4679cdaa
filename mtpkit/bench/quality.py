"""What the decoding precisions do to a model's output: fp32, bf16, and int8 weights with bf16 activations.

`python -m mtpkit.bench.quality [--model PATH] [--modes float32,bfloat16,int8] [--limit N]` prints, per mode:
- greedy agreement on the bench prompts (mtpkit/resources/bench_prompts.jsonl, `--num-tokens` new tokens each,
  batched): the share of prompts whose continuation is identical to bf16's (and to fp32's), and the mean length of
  the common prefix, in tokens;
- perplexity on held-out text: the module docstrings of the standard library's packages (files under package
  directories: json/, email/, asyncio/, ...; tests left out), joined in path order. Nothing in mtpkit trains the
  trunk, and neither the bench's context-length documents (pydoc's reference topics) nor the distillation
  prompts (docstrings of top-level modules only) draw on these files. The first `--ppl-tokens` tokens are scored
  in windows of `--window` tokens, each from its second token.
Every mode starts from the same checkpoint (for the default model, its Q4_1 weights dequantised to the dtype).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

MODES = {"float32": (torch.float32, None), "bfloat16": (torch.bfloat16, None), "int8": (torch.bfloat16, "int8")}
REFERENCES = ("bfloat16", "float32")


def heldout_text() -> str:
    """Module docstrings (20 words or more) of the standard library's package modules, in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for f in sorted(root.glob("*/**/*.py")):
        parts = f.relative_to(root).parts
        if parts[0] in ("site-packages", "idlelib", "turtledemo") or any("test" in p for p in parts):
            continue
        try:
            doc = ast.get_docstring(ast.parse(f.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc and len(doc.split()) >= 20:
            docs.append(doc)
    return "\n\n".join(docs)


@torch.inference_mode()
def perplexity(model, ids: list[int], window: int) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of `window` tokens of ids."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start : start + window]])
        if chunk.shape[1] < 2:
            break
        logits = model(chunk[:, :-1]).logits[0].float()  # [T-1, V]
        nll += F.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return math.exp(nll / count)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Share of rows identical to the reference, and the mean common-prefix length in tokens."""
    return {"identical": sum(a == b for a, b in zip(outputs, reference)) / len(reference),
            "prefix": sum(common_prefix(a, b) for a, b in zip(outputs, reference)) / len(reference)}


def measure(path: Path, modes: list[str], limit: int, num_tokens: int, ppl_tokens: int, window: int) -> dict:
    from ..decode.generate import generate
    from ..loading import load_for_decoding
    from ..prompts import load_prompts
    from ..resources import DEFAULT_PROMPTS, resource
    from ..tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)
    prompts = load_prompts(resource(DEFAULT_PROMPTS), tokenizer)[: limit or None]
    text_ids = tokenizer(heldout_text(), add_special_tokens=False)["input_ids"][:ppl_tokens]
    outputs, rows = {}, {}
    for mode in sorted(modes, key=lambda m: m not in REFERENCES):  # references first
        dtype, quantize = MODES[mode]
        model = load_for_decoding(path, dtype=dtype, quantize=quantize).model
        result = generate(model, [p.ids for p in prompts], max_new_tokens=num_tokens,
                          eos_token_id=tokenizer.eos_token_id)
        outputs[mode] = result.tokens
        rows[mode] = {"perplexity": perplexity(model, text_ids, window)}
        del model
    for mode in modes:
        for ref in REFERENCES:
            if ref in outputs and ref != mode:
                rows[mode][f"vs_{ref}"] = agreement(outputs[mode], outputs[ref])
    return {"model": path.name, "prompts": len(prompts), "num_tokens": num_tokens, "ppl_tokens": len(text_ids),
            "window": window, "python": sys.version.split()[0], "threads": torch.get_num_threads(), "modes": rows}


def render(report: dict) -> str:
    refs = [r for r in REFERENCES if r in report["modes"]]
    head = ["mode"] + [f"identical to {r}" for r in refs] + [f"common prefix with {r}" for r in refs] + ["perplexity"]
    lines = [f"{report['model']} · {report['prompts']} bench prompts x {report['num_tokens']} new tokens (greedy) · "
             f"perplexity on {report['ppl_tokens']} tokens of stdlib package docstrings (Python {report['python']}), "
             f"windows of {report['window']} · {report['threads']} threads",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, row in report["modes"].items():
        name = "int8 weights, bf16 activations" if mode == "int8" else mode
        same = [f"{row[f'vs_{r}']['identical']:.0%}" if f"vs_{r}" in row else "(reference)" for r in refs]
        prefix = [f"{row[f'vs_{r}']['prefix']:.1f}" if f"vs_{r}" in row else "-" for r in refs]
        lines.append("| " + " | ".join([name, *same, *prefix, f"{row['perplexity']:.3f}"]) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mtpkit.bench.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF model directory or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--modes", default="float32,bfloat16,int8", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N bench prompts (0: all)")
    ap.add_argument("--num-tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="tokens of held-out text to score")
    ap.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes takes {', '.join(MODES)}, got {args.modes!r}")
    if args.num_tokens < 1 or args.ppl_tokens < 2 or args.window < 2 or args.limit < 0:
        ap.error("--num-tokens must be >= 1, --ppl-tokens and --window >= 2, --limit >= 0")
    torch.set_num_threads(args.threads)
    from ..assets import default_gguf_path

    path = Path(args.model) if args.model else default_gguf_path()
    report = measure(path, modes, args.limit, args.num_tokens, args.ppl_tokens, args.window)
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
