"""Distillation prompts that carry long inputs, from the training side of the local corpora only.

The head drafts poorly after a long input because it was distilled on records under ~300 positions. Three kinds
bring the long inputs users give a chat model:
- "document": a document of 500-4,000 tokens (`documents`, training side) and a request about it (chat);
- "code_file": the 500-4,000 tokens of a Python file before a cut at a line start (code corpus, training side),
  to be continued as in an editor;
- "long_multiturn": a request about a document, the model's own answer and a follow-up, a chat that grows
  (completed by `distill.complete_prompts` like "multiturn").
The requests here are worded differently from the held-out set's (`doc_chat_heldout`), so neither the documents
nor the wording of a held-out prompt is seen in training.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .code_corpus import PACKAGES, package_root, readable_source, held_out
from .documents import cut_documents, headings, prose_sources, split_sides

MIN_TOKENS, MAX_TOKENS = 500, 4000
KIND_SHARES = {"document": 0.5, "code_file": 0.25, "long_multiturn": 0.25}  # of the long share

ASKS = (
    "Explain what this text is about to someone new to the subject.", "Give me a short summary of this.",
    "Summarize the main points as a bulleted list.", "Write a beginner's tutorial based on this documentation.",
    "What are the most important things to remember from this?", "List the steps it describes, in order.",
    "Explain the key terms used here.", "Rewrite this in plain English.", "What problem does this solve?",
    "Write three quiz questions, with answers, that test an understanding of this text.",
    "Turn this into a short FAQ.", "What would a new user most likely get wrong, according to this?",
)
SECTION_ASKS = ("Explain the section titled \"{h}\".", "What is said here about {h}?",
                "Summarize the part about {h} in two sentences.")
FOLLOW_UPS = ("Can you give a concrete example?", "Which part is the most important, and why?",
              "Can you make that shorter?", "How would I try this out myself?", "What are the limitations?")
LAYOUTS = ("{doc}\n\n{ask}", "{ask}\n\n{doc}", "Here is a document:\n\n{doc}\n\n{ask}",
           "{ask}\n\n---\n{doc}\n---", "I am reading this:\n\n\"\"\"\n{doc}\n\"\"\"\n\n{ask}")


def ask_about(document: str, rng: random.Random, asks=ASKS, section_asks=SECTION_ASKS) -> str:
    """A chat request about a pasted document: a general request, or one about a section when it has titles."""
    titles = headings(document)
    ask = rng.choice(section_asks).format(h=rng.choice(titles)) if titles and rng.random() < 0.3 else rng.choice(asks)
    return rng.choice(LAYOUTS).format(doc=document, ask=ask)


@dataclass
class LongSources:
    """Training-side material for the long kinds: documents {"text", "path", "tokens"} and code contexts
    {"prompt", "path", "tokens"}."""

    documents: list[dict]
    code: list[dict]

    def __post_init__(self):
        if not self.documents or not self.code:
            raise ValueError(f"long prompts need training-side documents and code files; found {len(self.documents)} "
                             f"documents and {len(self.code)} code contexts in the installed packages")


def code_contexts(tokenizer, n_files: int, *, seed: int = 0, per_file: int = 4, min_tokens: int = MIN_TOKENS,
                  max_tokens: int = MAX_TOKENS, min_left: int = 64) -> list[dict]:
    """Up to `per_file` contexts a file (cut at different points) from up to n_files training-side files of the code
    corpus's packages (a seeded draw): min_tokens..max_tokens tokens of whole lines, with at least min_left tokens
    of the file after them."""
    rng = random.Random(seed)
    files = []
    for name in PACKAGES:
        root = package_root(name)
        if root is not None:
            files += [(f"{name}/{p.relative_to(root).as_posix()}", p) for p in sorted(root.rglob("*.py"))]
    files = [(rel, path) for rel, path in files if not held_out(rel)]
    rng.shuffle(files)
    out = []
    for rel, path in files[:n_files]:
        text = readable_source(path)
        ids = tokenizer(text)["input_ids"] if text else []
        if len(ids) < min_tokens + min_left:
            continue
        for _ in range(per_file):
            length = rng.randint(min_tokens, min(max_tokens, len(ids) - min_left))
            cut = rng.randint(length, len(ids) - min_left)
            piece = tokenizer.decode(ids[cut - length : cut])
            piece = piece[piece.find("\n") + 1 : piece.rfind("\n") + 1]  # whole lines: a continuation starts a line
            tokens = len(tokenizer(piece)["input_ids"])
            if min_tokens <= tokens <= max_tokens and piece not in {c["prompt"] for c in out[-per_file:]}:
                out.append({"prompt": piece, "path": rel, "tokens": tokens})
    return out


def long_sources(tokenizer, *, seed: int = 0, code_files: int = 1500) -> LongSources:
    """The training side's documents and code contexts (reads every installed package's docs: minutes). With this
    machine's packages: ~4,800 documents (7.5M tokens from 3,350 sources) and, from 400 files, 271 files long
    enough to cut; a large distillation draws each context a few times at most with the defaults."""
    train, _ = split_sides(prose_sources())
    return LongSources(cut_documents(train, tokenizer, MIN_TOKENS, MAX_TOKENS, seed=seed),
                       code_contexts(tokenizer, code_files, seed=seed))


def long_prompt(kind: str, rng: random.Random, sources: LongSources) -> dict:
    """One prompt of a long kind; "long_multiturn" holds the request (`ask`) the model answers first."""
    if kind == "code_file":
        return {"prompt": rng.choice(sources.code)["prompt"], "chat": False, "kind": kind}
    request = ask_about(rng.choice(sources.documents)["text"], rng)
    if kind == "document":
        return {"prompt": request, "chat": True, "kind": kind}
    return {"ask": request, "follow_up": rng.choice(FOLLOW_UPS), "chat": True, "kind": kind}
