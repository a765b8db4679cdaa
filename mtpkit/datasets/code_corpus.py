"""A Python-source domain for fine-tuning experiments: whole files of installed packages, split by file.

The fine-tuning experiment (scripts/finetune_alignment.py) needs a domain whose generations are long, that the
model does not write by default and that its MTP head never saw: the head was distilled from chat, prose and
prompts made from the standard library, so the sources of third-party packages installed next to mtpkit qualify.
Files are documents (no EOS inside a file). Each file goes to the training or the held-out side by a hash of its
path inside the package, so the two sides share no file; a share of the held-out files is cut mid-file into
prompts. `transformers` is left out: its model files are near copies of each other ("Copied from" blocks), which
would put held-out text into training. Generated tables (lexer maps, long literal lines) are skipped.

The corpus is written once (`build_code_corpus`) with a manifest of the packages' versions, and read as JSONL
{"text", "path"} by training (data.text_field = "text").
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import random
from pathlib import Path

from ..checkpoint.safe_write import write_dir

# pip and setuptools are left out: they vendor copies of packages listed here (urllib3, requests, rich, packaging),
# and looking pip up (find_spec) makes setuptools' distutils shim switch to the standard library's distutils, after
# which torch cannot build the CPU kernels in that process
PACKAGES = ("torch", "numpy", "matplotlib", "pyarrow", "hypothesis", "rich", "pygments", "werkzeug", "tensorboard",
            "click", "huggingface_hub", "accelerate", "pydantic", "fontTools", "anyio", "grpc", "urllib3", "requests",
            "markdown", "typer", "dateutil", "tqdm", "gguf", "yaml", "psutil", "packaging")
HELD_OUT_SHARE = 0.1


def package_root(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _version(name: str) -> str:
    for dist in (name, name.replace("_", "-"), {"yaml": "PyYAML", "dateutil": "python-dateutil",
                                                 "fontTools": "fonttools", "grpc": "grpcio"}.get(name, name)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def readable_source(path: Path) -> str | None:
    """The file's text when it reads like hand-written code: 2-200 kB, short lines, not a generated table."""
    if not 2_000 <= path.stat().st_size <= 200_000:
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    if not lines or max(map(len, lines)) > 500 or sum(map(len, lines)) / len(lines) > 60:
        return None
    return text


def held_out(relpath: str, share: float = HELD_OUT_SHARE) -> bool:
    """The file's side, fixed by its path so that every build puts it on the same one."""
    return int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) / 16**8 < share


def build_code_corpus(out, tokenizer, *, train_tokens: int, packages=PACKAGES, seed: int = 0,
                      package_share: float = 0.15) -> dict:
    """Write out/train.jsonl (whole files, shuffled, about `train_tokens` tokens, no package above
    `package_share` of them), out/heldout.jsonl (every held-out file of the same packages) and out/manifest.json.
    Returns the manifest."""
    files = {"train": [], "heldout": []}
    versions = {}
    for name in packages:
        root = package_root(name)
        if root is None:
            continue
        versions[name] = _version(name)
        for path in sorted(root.rglob("*.py")):
            rel = f"{name}/{path.relative_to(root).as_posix()}"
            files["heldout" if held_out(rel) else "train"].append((rel, path))
    if not files["train"]:
        raise ValueError(f"none of the packages {', '.join(packages)} is installed: no code to build a corpus from")
    rng = random.Random(seed)
    rng.shuffle(files["train"])
    cap = package_share * train_tokens
    per_package: dict[str, int] = {}
    chosen = {"train": [], "heldout": []}
    total = 0
    for rel, path in files["train"]:
        text = readable_source(path)
        package = rel.split("/")[0]
        if text is None or per_package.get(package, 0) >= cap:
            continue
        n = len(tokenizer(text)["input_ids"])
        per_package[package] = per_package.get(package, 0) + n
        chosen["train"].append({"text": text, "path": rel})
        total += n
        if total >= train_tokens:
            break
    for rel, path in files["heldout"]:
        text = readable_source(path)
        if text is not None:
            chosen["heldout"].append({"text": text, "path": rel})
    manifest = {"packages": versions, "train_files": len(chosen["train"]), "train_tokens": total,
                "heldout_files": len(chosen["heldout"]), "tokens_per_package": per_package, "seed": seed}

    def fill(tmp: Path) -> None:
        for side, docs in chosen.items():
            (tmp / f"{side}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

    write_dir(Path(out), fill)
    return manifest


def read_corpus(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def cut_prompts(docs: list[dict], tokenizer, n: int, *, context_tokens: int, min_left: int, seed: int = 0,
                per_file: int = 1) -> list[dict]:
    """n prompts cut mid-file at a line start: the `context_tokens` tokens before the cut (at least half that),
    with at least `min_left` tokens of the file after it, so a continuation has room to run. At most `per_file`
    prompts a file (distinct cuts), files drawn in a seeded order. Returns [{"prompt": text, "path", "kind":
    "code"}]."""
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    prompts, seen = [], set()
    for i in order:
        text = docs[i]["text"]
        ids = tokenizer(text)["input_ids"]
        lo, hi = context_tokens // 2, len(ids) - min_left + 1
        if hi <= lo:
            continue
        cuts = [rng.randrange(lo, hi)] if per_file == 1 else rng.sample(range(lo, hi), min(per_file, hi - lo))
        for cut_at in cuts:
            head = tokenizer.decode(ids[:cut_at])
            line_start = head.rfind("\n") + 1  # cut at a line start: a continuation begins a line, as in an editor
            context = tokenizer(head[:line_start])["input_ids"][-context_tokens:]
            prompt = tokenizer.decode(context)
            if len(context) < context_tokens // 2 or prompt in seen:  # two cuts in one line give one prompt
                continue
            seen.add(prompt)
            prompts.append({"prompt": prompt, "path": docs[i]["path"], "kind": "code"})
            if len(prompts) == n:
                return prompts
    raise ValueError(f"only {len(prompts)} of {n} prompts: too few files ({len(docs)}) are long enough for "
                     f"{per_file} prompt(s) each of {context_tokens} tokens with {min_left} after it; build the "
                     "corpus larger or ask for fewer prompts")
