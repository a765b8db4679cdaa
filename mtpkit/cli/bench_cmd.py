"""`mtpkit bench`: measure MTP self-speculative decoding against plain decoding (and transformers' generate())."""

from __future__ import annotations

import json
from pathlib import Path

from . import draft_args


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark plain vs MTP self-speculative decoding and print a report")
    p.add_argument("--model", help="HF model directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--mtp", help="MTP head (.safetensors with mtp.* only); default: the model's own, or the "
                                 "shipped SmolLM2 head for the default model")
    p.add_argument("--full-vocab", action="store_true", help="draft over the whole vocabulary even when the head "
                   "carries a draft vocabulary (one trained with mtp.draft_vocab drafts over its ids by default)")
    p.add_argument("--prompts", help="prompts: a .txt file (one per line) or .jsonl ({prompt, chat, image} or chat "
                                     "{messages} records with images); "
                                     "default: 20 prompts of several kinds shipped with mtpkit")
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts of the file (0: all)")
    p.add_argument("--num-tokens", type=int, default=128, help="new tokens per prompt")
    draft_args.add_arguments(p, grid=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and configuration (median)")
    p.add_argument("--baseline", help="comma-separated rows from transformers on the same model: hf (greedy "
                                      "generate()), pld (its prompt-lookup decoding)")
    p.add_argument("--prompt-lookup-tokens", type=int, default=10,
                   help="prompt_lookup_num_tokens of the pld baseline (10, transformers' default draft length)")
    p.add_argument("--step-repeats", type=int, default=5,
                   help="timed repeats of the decode/verify/draft step costs behind the break-even column (0: skip)")
    p.add_argument("--context-lengths",
                   help="comma-separated prompt lengths in tokens (e.g. 128,512,2048): measure acceptance on document "
                        "text cut at the same points, left-padded with earlier text of the same document")
    p.add_argument("--context-docs", help="documents for --context-lengths: a .txt file (one document) or .jsonl "
                                          "({text} records); default: the Python reference topics shipped with Python")
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="weights and activations (default: float32, or bfloat16 with --quantize int8)")
    p.add_argument("--quantize", choices=["int8"], help="int8 weights, one scale per output channel, bfloat16 "
                                                        "activations (the baselines stay unquantised)")
    p.add_argument("--acceptance-only", action="store_true",
                   help="measure acceptance only: each row decodes every prompt once, --batch-size at a time, no "
                        "plain runs and no timing (to compare heads quickly, also across --context-lengths; "
                        "mtpkit/bench/acceptance.py)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts decoded together with --acceptance-only")
    p.add_argument("--out", help="also write the report to this file")
    p.add_argument("--json", help="write the figures as JSON")
    p.add_argument("--plot", help="draw acceptance per position and speedup per k to this PNG")


# what `run_acceptance` takes of the timed benchmark's settings
ACCEPTANCE_KEYS = ("num_tokens", "specs", "temperature", "eos_token_id")


def run(args) -> int:
    import torch

    from ..bench.acceptance import render_acceptance, run_acceptance
    from ..bench.contexts import context_prompts, python_docs, read_documents
    from ..bench.hf_baseline import load_hf_baseline
    from ..bench.report import label, plot, render, render_contexts
    from ..bench.speedup import run_bench
    from ..decode.draft_spec import DraftSpec
    from ..decode.int8 import model_dtype
    from ..loading import load_for_decoding
    from ..models.multimodal import load_processor
    from ..prompts import check_fits, encode_prompts, read_prompts
    from ..resources import DEFAULT_PROMPTS, resource

    specs = draft_args.grid_from_args(args)
    baselines = [b.strip() for b in (args.baseline or "").split(",") if b.strip()]
    if set(baselines) - {"hf", "pld"}:
        raise ValueError(f"--baseline takes hf and/or pld (comma-separated), got {args.baseline!r}")
    lengths = sorted(set(draft_args.numbers(args.context_lengths or "", int, "--context-lengths")))
    if lengths and lengths[0] < 16:
        raise ValueError(f"--context-lengths must be >= 16 tokens each, got {args.context_lengths!r}")
    if lengths and args.prompts:
        raise ValueError("--context-lengths measures on documents (--context-docs), not on --prompts: give one")
    if args.repeats < 1 or args.num_tokens < 1 or args.limit < 0 or args.step_repeats < 0:
        raise ValueError("--repeats and --num-tokens must be >= 1, --limit and --step-repeats >= 0")
    if args.prompt_lookup_tokens < 1:
        raise ValueError(f"--prompt-lookup-tokens must be >= 1, not {args.prompt_lookup_tokens}")
    if args.acceptance_only and (baselines or args.plot):
        raise ValueError("--acceptance-only measures no speed: drop --baseline and --plot")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, not {args.batch_size}")
    dtype = model_dtype(args.dtype, args.quantize)
    prompts = [] if lengths else read_prompts(args.prompts or resource(DEFAULT_PROMPTS))[: args.limit or None]
    vision = any(p.images for p in prompts)  # image prompts: the vision tower and the processor are loaded too
    if vision and baselines:
        raise ValueError("--baseline takes text prompts only")
    model, tokenizer, path, head = load_for_decoding(args.model, head=args.mtp, dtype=dtype, quantize=args.quantize,
                                                     draft_vocab="full" if args.full_vocab else None, vision=vision)
    if model.drafter is None and any(s.draft_tokens for s in specs):
        raise ValueError(f"{path} has no MTP head: pass one with --mtp (train one with mtpkit train, mtp.only = true)")
    if args.draft_auto:
        specs.append(DraftSpec.automatic(model))
    hf = load_hf_baseline(path, dtype) if baselines else None
    bench = dict(num_tokens=args.num_tokens, specs=specs, temperature=args.temperature,
                 repeats=args.repeats, eos_token_id=tokenizer.eos_token_id, hf_model=hf, baselines=baselines,
                 prompt_lookup=args.prompt_lookup_tokens, step_repeats=args.step_repeats)
    if not lengths:
        prompts = encode_prompts(prompts, tokenizer, model, load_processor(path) if vision else None)
        check_fits([p.ids for p in prompts], args.num_tokens, model.config,
                   fix="shorten or drop them, or lower --num-tokens")
    def measure(prompts):  # the timed benchmark, or the acceptance alone (each row decodes each prompt once)
        if args.acceptance_only:
            return run_acceptance(model.eval(), prompts, batch_size=args.batch_size,
                                  **{k: v for k, v in bench.items() if k in ACCEPTANCE_KEYS})
        return run_bench(model.eval(), prompts, **bench)

    if lengths:
        docs = read_documents(args.context_docs) if args.context_docs else python_docs()
        by_length = context_prompts(docs, tokenizer, lengths, args.limit)
        report = {"contexts": [dict(context_tokens=n, **measure(by_length[n])) for n in lengths],
                  "source": f"{Path(args.context_docs).name if args.context_docs else 'Python reference topics'}, "
                            f"{len(by_length[lengths[-1]])} documents"}
    else:
        report = measure(prompts)
    dtype_name = str(dtype).removeprefix("torch.") + (f", {args.quantize} weights" if args.quantize else "")
    report.update(model=path.name, device=str(model.output_weight.device), dtype=dtype_name, quantize=args.quantize,
                  threads=torch.get_num_threads(),
                  num_tokens=args.num_tokens, repeats=args.repeats, temperature=args.temperature,
                  mtp_head=Path(head).name if head else "(checkpoint's own)")  # names only: no local paths
    if lengths:
        text = render_contexts(report)
    elif args.acceptance_only:
        text = render_acceptance(report)
    else:
        text = render(report, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, args.plot)
    runs = [r for c in report.get("contexts", [report]) for r in c["runs"]]
    failed = sorted({label(r) for r in runs if r.get("identical") is False})
    if failed:
        print(f"mtpkit bench: error: speculative output differed from plain decoding at {', '.join(failed)}")
        return 1
    return 0
