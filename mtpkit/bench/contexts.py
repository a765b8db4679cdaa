"""Prompts for acceptance across context lengths (`mtpkit bench --context-lengths 128,512,2048`).

Acceptance that falls as the context grows is a reported failure of MTP heads trained on short sequences, so the
sweep holds everything else fixed: each document is cut once, after its first max(lengths) tokens (at a word
start), and the prompt for length L is the L tokens before that cut, i.e. the same continuation point left-padded
with more earlier text of the same document.

Bench prompt files hold short standalone prompts with no earlier text, so the documents come from elsewhere: by
default the Python Language Reference topics that CPython ships as pydoc's help text (`pydoc_data.topics`, 79
topics, 14 of them over 9 kB: long, plain English prose with code; the shipped head's training drew on module
docstrings, never on these), or any text the user gives (`--context-docs`: a .txt file is one document, a .jsonl
file holds {"text": ...} records), e.g. held-out documents of a fine-tuning domain.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..prompts import Prompt

CHARS_PER_TOKEN = 10  # generous: English text tokenizes to about 4 characters a token, code to about 3


def python_docs() -> list[tuple[str, str]]:
    """(topic, text) of the Python Language Reference help topics shipped with CPython, longest first."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise ValueError("this Python has no pydoc_data (the reference topics): give documents with --context-docs")
    return sorted(topics.items(), key=lambda item: (-len(item[1]), item[0]))


def read_documents(path) -> list[tuple[str, str]]:
    """(name, text) of each document: a .txt file is one document, a .jsonl file one {"text": ...} per line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"context documents file {path} does not exist")
    if path.suffix != ".jsonl":
        return [(path.stem, path.read_text(encoding="utf-8"))]
    docs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise ValueError(f'{path}:{n} needs a "text" string')
            docs.append((str(rec.get("name", f"{path.stem}:{n}")), rec["text"]))
    return docs


def _starts_word(tokenizer, ids: list[int], i: int) -> bool:
    """Whether token i begins with whitespace in context (decoded alone, SentencePiece drops a leading space)."""
    before, pair = tokenizer.decode(ids[i - 1 : i]), tokenizer.decode(ids[i - 1 : i + 1])
    return pair.startswith(before) and pair[len(before) : len(before) + 1].isspace()


def context_prompts(docs, tokenizer, lengths: list[int], limit: int = 0) -> dict[int, list[Prompt]]:
    """Per context length L, one prompt of exactly L tokens per document long enough (the first `limit` such
    documents; 0: all): the tokenizer's own leading special tokens (BOS where it adds one), then the text just
    before the document's cut point."""
    longest = max(lengths)
    specials = list(tokenizer("")["input_ids"])
    out = {L: [] for L in lengths}
    for name, text in docs:
        ids = tokenizer(text[: CHARS_PER_TOKEN * longest], add_special_tokens=False)["input_ids"]
        cut = next((i for i in range(longest, len(ids)) if _starts_word(tokenizer, ids, i)), None)
        if cut is None:
            continue
        tail = tokenizer.decode(ids[cut - 12 : cut])
        for L in lengths:
            prompt = specials + ids[cut - L + len(specials) : cut]
            out[L].append(Prompt(f"[{name}] …{tail}", False, "doc", prompt))
        if len(out[longest]) == limit:
            break
    if not out[longest]:
        raise ValueError(f"no document is longer than {longest} tokens: give longer ones (--context-docs) or "
                         "shorter --context-lengths")
    return out
