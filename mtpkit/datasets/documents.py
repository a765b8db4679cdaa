"""Technical prose shipped inside installed packages, split into a training and a held-out side by source path.

Chat requests about a pasted document need documents the model's head has never seen in training. Every
distribution installed next to mtpkit brings prose: its long description (the README in dist-info METADATA), the
.md/.rst/.txt files it ships, and the docstrings of its Python files (`api_reference`: the module's page of an API
reference). The Python standard library is left out (the current head's distillation used its docstrings), and so
is mtpkit itself.

Each source goes to one side by a hash of its path (`code_corpus.held_out`), so the two sides never share a file:
Python files with the code corpus's share, so that a file is on the same side here as there, and the prose files
nothing else reads with a larger share (PROSE_HELD_OUT_SHARE), as the held-out set needs many long documents.
Sources are cut at section titles into documents of a token range; `overlapping` finds held-out documents that
share a run of words with training text (a README copied into a docstring, a license header, a shared example),
which the held-out set leaves out.

`python -m mtpkit.datasets.documents OUT --tokens N` writes training-side documents as token records (whole, no
loss mask) for `mtpkit features --topk`: the trunk's own next-token distributions at every position of long real
text, a head's training data for long contexts without generating it (generation is what a CPU does slowest).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import json
import random
import re
from pathlib import Path

from .code_corpus import held_out

SKIP_DISTRIBUTIONS = ("mtpkit",)
_NOT_PROSE = re.compile(r"licen[cs]e|copying|authors|notice|copyright|record|top_level|entry_points|requires",
                        re.IGNORECASE)
SHINGLE_WORDS = 12
PROSE_HELD_OUT_SHARE = 0.35


def api_reference(source: str) -> str | None:
    """A Python file's documentation as a reference page would show it: the module docstring, then each public
    function, class and method with a docstring as "## name(arguments)" and that docstring."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    parts = [ast.get_docstring(tree) or ""]

    def document(node, prefix=""):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc:
                args = "" if isinstance(node, ast.ClassDef) else f"({ast.unparse(node.args)})"
                parts.append(f"## {prefix}{node.name}{args}\n\n{doc}")
            if isinstance(node, ast.ClassDef):
                for child in node.body:
                    document(child, f"{node.name}.")

    for node in tree.body:
        document(node)
    return "\n\n".join(p for p in parts if p) or None


def _reads_as_prose(text: str) -> bool:
    """At least 100 words, mostly letters, lines of several words, not mostly comments: not a word list, table or
    data file."""
    words = text.split()
    lines = [line for line in text.splitlines() if line.strip()]
    letters = sum(c.isalpha() for c in text)
    comments = sum(line.lstrip().startswith("#") for line in lines)
    return len(words) >= 100 and letters >= 0.6 * sum(not c.isspace() for c in text) and \
        len(words) >= 5 * len(lines) and comments < 0.3 * len(lines)


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def prose_sources(min_words: int = 100) -> list[dict]:
    """Every prose source of the installed distributions, {"path", "text"}, sorted by path (parsing every Python
    file takes minutes). Paths are relative to site-packages (as the code corpus names files), the long description
    "<distribution>.dist-info/METADATA"."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if not name or _key(name) in SKIP_DISTRIBUTIONS:
            continue
        description = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if _reads_as_prose(description):
            found[f"{_key(name)}.dist-info/METADATA"] = description
        for f in dist.files or ():
            path = str(f)
            if path.startswith("..") or ".dist-info/" in path or "/_vendor/" in path:
                continue
            if path.endswith(".py"):
                if f.size and f.size > 300_000:  # generated tables, not documentation
                    continue
                try:
                    text = api_reference(f.locate().read_text(encoding="utf-8"))
                except (OSError, UnicodeDecodeError):
                    continue
            elif path.endswith((".md", ".rst", ".txt")) and not _NOT_PROSE.search(path.rsplit("/", 1)[-1]):
                try:
                    text = f.locate().read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                text = text if _reads_as_prose(text) else None
            else:
                continue
            if text and len(text.split()) >= min_words:
                found[path] = text.strip()
    return [{"path": p, "text": found[p]} for p in sorted(found)]


def split_sides(sources: list[dict]) -> tuple[list[dict], list[dict]]:
    """(training, held-out) sources, each source on the side its path hashes to."""
    side = [held_out(s["path"]) if s["path"].endswith(".py") else held_out(s["path"], PROSE_HELD_OUT_SHARE)
            for s in sources]
    return [s for s, h in zip(sources, side) if not h], [s for s, h in zip(sources, side) if h]


GENERIC_TITLES = {"examples", "example", "parameters", "returns", "return", "yields", "raises", "notes", "note",
                  "references", "see also", "attributes", "details", "tips", "usage", "args", "arguments", "warning"}


def _opens_section(paragraph: str) -> bool:
    """A paragraph that starts with a Markdown title or an underlined reStructuredText one, not a docstring's
    "Examples" or "Parameters" (those belong to the entry above them)."""
    titled = re.match(r"#{1,4} \S", paragraph) or re.match(r"[^\n]+\n([=\-~^])\1{2,}", paragraph)
    return bool(titled) and paragraph.splitlines()[0].strip("#*` :").lower() not in GENERIC_TITLES


def cut_documents(sources: list[dict], tokenizer, min_tokens: int, max_tokens: int, *, seed: int = 0,
                  per_source: int | None = None) -> list[dict]:
    """Documents {"text", "path", "tokens"} of min_tokens..max_tokens tokens: whole sections of a source (from its
    start or a section title, to a section end where the length allows), each document's length aimed at a draw
    from the range so that lengths vary; at most `per_source` a source."""
    rng = random.Random(seed)
    out = []
    for source in sources:
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", source["text"]) if p.strip()]
        lengths = [len(ids) for ids in tokenizer(paragraphs)["input_ids"]] if paragraphs else []
        taken, current, total = 0, [], 0
        target = rng.randint(min_tokens, max_tokens)
        for i, (paragraph, n) in enumerate(zip(paragraphs, lengths)):
            if not current and i and not _opens_section(paragraph):
                continue  # a document starts where a reader would: at the top or at a title
            if total + n > max_tokens:
                current, total = [], 0
                if i and not _opens_section(paragraph) or n > max_tokens:
                    continue
            current, total = current + [paragraph], total + n
            full = i + 1 == len(paragraphs) or total + lengths[i + 1] > max_tokens  # nothing more fits
            if total >= min_tokens and (full or total >= target and _opens_section(paragraphs[i + 1])):
                text = "\n\n".join(current)
                tokens = len(tokenizer(text)["input_ids"])
                if min_tokens <= tokens <= max_tokens:
                    out.append({"text": text, "path": source["path"], "tokens": tokens})
                    taken += 1
                current, total, target = [], 0, rng.randint(min_tokens, max_tokens)
                if per_source is not None and taken == per_source:
                    break
    return out


def shingles(text: str, n: int = SHINGLE_WORDS) -> set[bytes]:
    """Hashes of every run of n consecutive words (lowercased, punctuation-blind)."""
    words = re.findall(r"\w+", text.lower())
    return {hashlib.blake2b(" ".join(words[i : i + n]).encode(), digest_size=8).digest()
            for i in range(len(words) - n + 1)}


def overlapping(documents: list[dict], texts) -> set[int]:
    """Indices of the documents that share a run of SHINGLE_WORDS words with any of `texts` (one text at a time:
    the training side holds millions of runs)."""
    marks = [shingles(d["text"]) for d in documents]
    every = set().union(*marks)
    shared = set()
    for text in texts:
        shared |= shingles(text) & every
    return {i for i, m in enumerate(marks) if m & shared}


def headings(text: str) -> list[str]:
    """Section titles of a Markdown ("# Title") or reStructuredText (a line underlined with =, - or ~) document,
    less the generic ones of docstrings ("Examples", "Parameters"); an API entry's title is its name only."""
    lines = text.splitlines()
    found = [m.group(1) for m in (re.match(r"#{1,4}\s+(\w.{2,})$", line.strip()) for line in lines) if m]
    found += [a.strip() for a, b in zip(lines, lines[1:])
              if 3 <= len(a.strip()) <= 60 and re.fullmatch(r"([=\-~^])\1{2,}", b.strip()) and a.strip()[0].isalpha()]
    titles = [re.sub(r"\(.*", "", h).strip("*` :") for h in found]
    return [t for t in titles if 3 <= len(t) <= 60 and t.lower() not in GENERIC_TITLES]


def training_records(sources: list[dict], tokenizer, tokens: int, min_tokens: int, max_tokens: int, *,
                     seed: int = 0) -> list[dict]:
    """{"input_ids", "path"} of training-side documents of min_tokens..max_tokens tokens (two a source at most, in a
    seeded order) until `tokens` tokens in all; held-out sources are never read."""
    train, _ = split_sides(sources)
    docs = cut_documents(train, tokenizer, min_tokens, max_tokens, seed=seed, per_source=2)
    random.Random(seed).shuffle(docs)
    out, total = [], 0
    for doc in docs:
        if total >= tokens:
            break
        ids = tokenizer(doc["text"])["input_ids"]
        out.append({"input_ids": ids, "path": doc["path"]})
        total += len(ids)
    return out


def main(argv=None) -> None:
    from ..assets import default_gguf_path
    from ..checkpoint.safe_write import write_file
    from ..tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description="training-side documents of the installed packages as token records")
    p.add_argument("out", type=Path, help="JSONL records file to write")
    p.add_argument("--tokens", type=int, default=300_000, help="tokens in all (the last document may pass it)")
    p.add_argument("--min-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=4000, help="<= the trunk's context and the head's seq_len")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tokens < 1 or not 1 <= args.min_tokens <= args.max_tokens:
        p.error("give --tokens >= 1 and 1 <= --min-tokens <= --max-tokens")
    records = training_records(prose_sources(), load_tokenizer(default_gguf_path()), args.tokens, args.min_tokens,
                               args.max_tokens, seed=args.seed)
    if not records:
        p.error(f"no training-side document of {args.min_tokens}-{args.max_tokens} tokens in the installed packages: "
                "lower --min-tokens")
    text = "".join(json.dumps(r) + "\n" for r in records)
    write_file(args.out, lambda tmp: tmp.write_text(text), overwrite=True)  # a killed write leaves no half file
    print(f"{len(records)} documents, {sum(len(r['input_ids']) for r in records)} tokens -> {args.out}")


if __name__ == "__main__":
    main()
