"""`mtpkit export RUN_OR_CKPT --out DIR`: a training checkpoint -> HF-layout model directory (mtp.* included)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a training checkpoint as an HF model directory (mtp.* + tokenizer)")
    p.add_argument("path", help="run directory (its newest checkpoint) or a checkpoint directory (checkpoints/step-N)")
    p.add_argument("--out", required=True, help="output directory (with --mtp-only: a .safetensors file)")
    p.add_argument("--mtp-only", action="store_true", help="write only the mtp.* tensors, as a head file for --mtp")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="cast the weights (default: as trained)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output (its old shards and index are removed first)")


def run(args) -> int:
    import torch

    from ..train.export import export

    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = export(args.path, args.out, dtype, mtp_only=args.mtp_only, overwrite=args.overwrite)
    print(f"exported to {out}")
    return 0
