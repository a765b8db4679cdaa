"""`mtpkit train CONFIG.toml [--section.key=value ...]`: train (or resume) a run; see mtpkit/train/config.py."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model with the MTP objective (torchrun for several ranks)",
        description="Train with the MTP objective. Overrides: --section.key=value (e.g. --train.steps=100 "
        "--optim.lr=1e-3 --mtp.depth=2). Several ranks: torchrun --nproc_per_node N -m mtpkit train CONFIG.",
    )
    p.add_argument("config", help="TOML config (see configs/)")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="--section.key=value overrides")


def run(args) -> int:
    from ..train.config import load_config
    from ..train.trainer import NonFiniteLoss, train

    cfg = load_config(args.config, list(args.overrides))
    try:
        summary = train(cfg)
    except NonFiniteLoss as e:
        print(f"mtpkit train: {e}", file=sys.stderr)
        return 3
    return 0 if summary["status"] == "finished" else 130
