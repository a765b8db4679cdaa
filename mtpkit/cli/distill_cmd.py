"""`mtpkit distill`: self-distillation data (the model's own greedy continuations) for training an MTP head."""

from __future__ import annotations

from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("distill", help="write the model's own greedy continuations of generated prompts")
    p.add_argument("--model", help="HF model directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output JSONL (input_ids + loss_mask per sample)")
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    p.add_argument("--prompts", choices=["mixed", "general", "stdlib"], default="mixed",
                   help="everyday-topic chat, prose and lists (general), stdlib docstrings and code (stdlib), or "
                        "60%% / 40%% of both (mixed)")


def run(args) -> int:
    from ..assets import default_gguf_path
    from ..checkpoint.hf import load_model
    from ..tokenizer import load_tokenizer
    from ..train.distill import distill, general_prompts, mixed_prompts, stdlib_prompts

    path = Path(args.model) if args.model else default_gguf_path()
    model, tokenizer = load_model(path).eval(), load_tokenizer(path)
    make = {"mixed": mixed_prompts, "general": general_prompts, "stdlib": stdlib_prompts}[args.prompts]
    info = distill(model, tokenizer, make(args.num_prompts, args.seed), args.out,
                   max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    print(f"{info['samples']} samples, {info['tokens']} generated tokens in {info['seconds']:.0f} s -> {args.out}")
    return 0
