"""`mtpkit bench`: measure MTP self-speculative decoding against plain decoding (and transformers' generate())."""

from __future__ import annotations

import json
from pathlib import Path


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
    p.add_argument("--draft-tokens", default="1,2,3", help="comma-separated k values")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and configuration (median)")
    p.add_argument("--baseline", choices=["hf"], help="add transformers' generate() on the same model")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", help="also write the report to this file")
    p.add_argument("--json", help="write the figures as JSON")
    p.add_argument("--plot", help="draw acceptance per position and speedup per k to this PNG")


def run(args) -> int:
    import torch

    from ..assets import default_gguf_path
    from ..bench.report import plot, render
    from ..bench.speedup import (DEFAULT_PROMPTS, encode_prompts, load_hf_baseline, read_prompts, resource,
                                  run_bench, shipped_head)
    from ..checkpoint.hf import load_model
    from ..checkpoint.mtp_head import load_mtp_head
    from ..models.multimodal import load_processor
    from ..tokenizer import load_tokenizer

    ks = sorted({int(k) for k in args.draft_tokens.split(",") if k.strip()})
    if not ks or ks[0] < 1:
        raise ValueError(f"--draft-tokens needs k values >= 1, got {args.draft_tokens!r}")
    if args.repeats < 1 or args.num_tokens < 1 or args.limit < 0:
        raise ValueError("--repeats and --num-tokens must be >= 1, --limit >= 0")
    dtype = getattr(torch, args.dtype)
    path = Path(args.model) if args.model else default_gguf_path()
    prompts = read_prompts(args.prompts or resource(DEFAULT_PROMPTS))[: args.limit or None]
    vision = any(p.images for p in prompts)  # image prompts: the vision tower and the processor are loaded too
    if vision and args.baseline == "hf":
        raise ValueError("--baseline hf takes text prompts only")
    model = load_model(path, dtype=dtype, vision=vision)
    head = args.mtp or shipped_head(path)
    if head:
        load_mtp_head(model, head)
    if model.mtp is None:
        raise ValueError(f"{path} has no MTP head: pass one with --mtp (train one with mtpkit train, mtp.only = true)")
    if args.full_vocab:
        model.mtp.draft_vocab = None
    tokenizer = load_tokenizer(path)
    prompts = encode_prompts(prompts, tokenizer, model, load_processor(path) if vision else None)
    hf = load_hf_baseline(path, dtype) if args.baseline == "hf" else None
    report = run_bench(model.eval(), prompts, num_tokens=args.num_tokens, ks=ks, temperature=args.temperature,
                       repeats=args.repeats, eos_token_id=tokenizer.eos_token_id, hf_model=hf)
    report.update(model=path.name, device=str(model.output_weight.device), dtype=args.dtype, threads=torch.get_num_threads(),
                  num_tokens=args.num_tokens, repeats=args.repeats, temperature=args.temperature,
                  mtp_head=str(head) if head else "(checkpoint's own)")
    text = render(report, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, args.plot)
    failed = [r["draft_tokens"] for r in report["runs"] if r["identical"] is False]
    if failed:
        print(f"mtpkit bench: error: speculative output differed from plain decoding at k={failed}")
        return 1
    return 0
