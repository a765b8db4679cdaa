"""Render the synthetic shapes image-caption set and write its tiny Qwen3.5 VL model directory (nothing is fetched).

    python scripts/prepare_shapes.py [--train 6000] [--val 200] [--seed 0] [--cache DIR]

Prints the paths the recipe configs/shapes_qwen35_vl_tiny.toml uses (default: ~/.cache/mtpkit/shapes).
"""

import argparse

from mtpkit.datasets.shapes import prepare_shapes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", default=None, help="directory (default: $MTPKIT_CACHE/shapes)")
    p.add_argument("--train", type=int, default=6000, help="training scenes")
    p.add_argument("--val", type=int, default=200, help="validation scenes")
    p.add_argument("--seed", type=int, default=0, help="scene sampling seed")
    args = p.parse_args()
    root = prepare_shapes(args.cache, n_train=args.train, n_val=args.val, seed=args.seed)
    print(f"model: {root / 'model'}\ntrain: {root / 'train.jsonl'}\nval:   {root / 'val.jsonl'}")


if __name__ == "__main__":
    main()
