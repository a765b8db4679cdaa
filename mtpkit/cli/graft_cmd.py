"""`mtpkit graft --head-from BASE --into FINETUNED --out DIR`: a fine-tuned checkpoint with BASE's MTP head."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("graft", help="put an MTP head (mtp.* + config keys) into a fine-tuned checkpoint that lost it")
    p.add_argument("--head-from", required=True, dest="base",
                   help="HF model directory with mtp.* tensors (the released model) or an mtpkit head file")
    p.add_argument("--into", required=True, dest="finetuned",
                   help="fine-tuned HF model directory (e.g. saved by transformers' save_pretrained, without mtp.*)")
    p.add_argument("--out", required=True, help="output directory (FINETUNED's files with the head added)")
    p.add_argument("--overwrite", action="store_true", help="replace the weights of a non-empty --out")


def run(args) -> int:
    from ..checkpoint.graft import graft

    head = graft(args.base, args.finetuned, args.out, overwrite=args.overwrite)
    size = sum(t.numel() * t.element_size() for t in head.tensors.values())
    keys = ", ".join(f"{k} = {v}" for k, v in head.config.items())
    print(f"grafted {len(head.tensors)} mtp.* tensors ({size / 2**20:.1f} MiB; {keys}) from {args.base} into "
          f"{args.out}")
    return 0
