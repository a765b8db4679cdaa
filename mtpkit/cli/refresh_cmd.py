"""`mtpkit refresh`: re-align a fine-tuned model's MTP head with its trunk (mtpkit/refresh.py)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("refresh", help="retrain a fine-tuned model's MTP head on the model's own continuations of "
                                       "your prompts; writes OUT/hf with mtp.* and a before/after report")
    p.add_argument("--model", required=True, help="the fine-tuned HF model directory")
    p.add_argument("--head-from", metavar="BASE",
                   help="graft this head first: the model it was fine-tuned from (HF directory) or a head file; "
                        "needed when --model lost mtp.* (a transformers-based fine-tune)")
    p.add_argument("--prompts", required=True, metavar="FILE",
                   help="prompts of your domain: text (one a line) or JSONL ({\"prompt\", \"chat\"} or chat "
                        "{\"messages\"}); every 10th is held out for the report unless --eval-prompts is given")
    p.add_argument("--eval-prompts", metavar="FILE", help="held-out prompts for the before/after report")
    p.add_argument("--out", required=True, help="output directory; a rerun resumes where a killed run stopped")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens the model writes per prompt")
    p.add_argument("--batch-size", type=int, default=64, help="prompts decoded at once")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="compute of distillation, head training (bf16 autocast) and report (auto: measured, as in "
                        "`mtpkit distill`)")
    p.add_argument("--epochs", type=float, default=2.0, help="passes of head training over the distilled tokens")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-batch-size", type=int, default=16, help="packed rows of --seq-len tokens per step")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--as-drafted", action="store_true",
                   help="train the chained depths on what a draft chain reads from the MTP cache ([mtp] as_drafted; "
                        "one-layer heads)")
    p.add_argument("--whole-records", action="store_true",
                   help="pack each distilled record whole into a row (rows of at least the longest record), so "
                        "that the head attends over its whole prompt as it does when drafting ([data] "
                        "whole_documents)")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="train the head's CE over the N most frequent ids of the distilled tokens, which it then "
                        "drafts from (FR-Spec; [mtp] draft_vocab): head training several times faster on a large "
                        "vocabulary; 0: the head's own draft vocabulary, the full one when it has none")


def run(args) -> int:
    from ..refresh import refresh, render

    for name in ("max_new_tokens", "batch_size", "train_batch_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0: the head's own vocabulary), not {args.draft_vocab}")
    if args.epochs <= 0:
        raise ValueError(f"--epochs must be > 0, not {args.epochs}")
    report = refresh(args.model, args.prompts, args.out, head_from=args.head_from, eval_prompts=args.eval_prompts,
                     max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, device=args.device,
                     dtype=args.dtype, epochs=args.epochs, lr=args.lr, train_batch_size=args.train_batch_size,
                     seq_len=args.seq_len, seed=args.seed, as_drafted=args.as_drafted,
                     whole_records=args.whole_records, draft_vocab=args.draft_vocab)
    print(render(report))
    print(f"refreshed model (mtp.* included) -> {args.out}/hf")
    return 0
