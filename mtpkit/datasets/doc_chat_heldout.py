"""The held-out document-chat prompt set: chat requests about a pasted document of 1,000-2,000 tokens.

Users paste a document and ask about it; the shipped head drafts such requests far worse than short ones. This set
measures that, on documents no training source holds: held-out side of `documents` (by source path), less every
document that shares a run of words with the training side's prose, with requests worded unlike the training
kinds' (`long_prompts.ASKS`). It is built once, before any head trains on long kinds, and committed:

    python -m mtpkit.datasets.doc_chat_heldout mtpkit/resources/doc_chat_heldout_prompts.jsonl

(SmolLM2's tokenizer counts the tokens; 2-5 minutes, most of it parsing every installed package's docstrings.)
Benchmark with `mtpkit bench --prompts mtpkit/resources/doc_chat_heldout_prompts.jsonl`; each record also names
its "source" and its document's "doc_tokens".
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

from .documents import cut_documents, overlapping, prose_sources, split_sides
from .long_prompts import ask_about

MIN_TOKENS, MAX_TOKENS = 1000, 2000
# explain, summarise, tutorial, a question about it, the steps: each asked as no training prompt asks it
ASKS = (
    "Can you explain this documentation to me?", "Please summarise this.", "Write a tutorial that teaches this.",
    "Write a step-by-step guide based on the text above.", "What are the main ideas here?",
    "I don't understand this. What does it mean?", "Give me a TL;DR of this.",
    "List the steps a user has to follow, based on this.", "Who is this written for, and what will they learn?",
    "Write an example that uses what this describes.",
)
SECTION_ASKS = ("What does the document say about {h}?", "Explain \"{h}\" from this document.")


def _package(path: str) -> str:
    return path.split("/")[0].removesuffix(".dist-info")


def build(tokenizer, n: int = 40, *, seed: int = 0, per_package: int = 4) -> list[dict]:
    """n prompts {"prompt", "chat": True, "kind": "document", "source", "doc_tokens"}: one document a source (from
    its top), no more than `per_package` from one package, so that the set spans many projects' docs."""
    train, held = split_sides(prose_sources())
    documents = cut_documents(held, tokenizer, MIN_TOKENS, MAX_TOKENS, seed=seed, per_source=1)
    copied = overlapping(documents, (s["text"] for s in train))
    print(f"{len(documents)} held-out documents of {MIN_TOKENS}-{MAX_TOKENS} tokens, {len(copied)} left out for "
          "sharing text with the training side")
    documents = [d for i, d in enumerate(documents) if i not in copied]
    rng = random.Random(seed)
    rng.shuffle(documents)
    uses = Counter()
    chosen = []
    for d in documents:
        if len(chosen) < n and uses[_package(d["path"])] < per_package:
            chosen.append(d)
            uses[_package(d["path"])] += 1
    if len(chosen) < n:
        raise ValueError(f"only {len(chosen)} held-out documents of {MIN_TOKENS}-{MAX_TOKENS} tokens: ask for fewer")
    return [{"prompt": ask_about(d["text"], rng, ASKS, SECTION_ASKS), "chat": True, "kind": "document",
             "source": d["path"], "doc_tokens": d["tokens"]} for d in chosen]


def main(argv=None) -> None:
    from ..assets import default_gguf_path
    from ..tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    prompts = build(load_tokenizer(default_gguf_path()), args.num_prompts, seed=args.seed)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in prompts), encoding="utf-8")
    print(f"{len(prompts)} prompts from {len({r['source'] for r in prompts})} sources -> {args.out}")


if __name__ == "__main__":
    main()
