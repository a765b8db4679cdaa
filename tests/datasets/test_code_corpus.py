"""The code corpus: whole files of installed packages, training and held-out sides disjoint by file, sized as asked;
prompts cut mid-file at a line start with room after them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from train_runs import make_tokenizer

from mtpkit.datasets.code_corpus import build_code_corpus, cut_prompts, held_out, read_corpus
from mtpkit.kernels import thin_matmul


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("code")
    tok = make_tokenizer(root)
    manifest = build_code_corpus(root / "corpus", tok, train_tokens=60_000, packages=("click", "tqdm", "packaging"))
    return root / "corpus", tok, manifest


def test_sides_are_disjoint_whole_files(corpus):
    path, tok, manifest = corpus
    train, held = read_corpus(path / "train.jsonl"), read_corpus(path / "heldout.jsonl")
    assert manifest["train_tokens"] >= 60_000 and set(manifest["packages"]) == {"click", "tqdm", "packaging"}
    assert not {d["path"] for d in train} & {d["path"] for d in held}
    assert all(held_out(d["path"]) for d in held) and not any(held_out(d["path"]) for d in train)
    assert json.loads((path / "manifest.json").read_text())["train_files"] == len(train)


def test_prompts_cut_at_line_starts(corpus):
    path, tok, _ = corpus
    docs = read_corpus(path / "train.jsonl")
    prompts = cut_prompts(docs, tok, 5, context_tokens=64, min_left=32)
    assert len({p["path"] for p in prompts}) == 5
    several = cut_prompts(docs[:2], tok, 6, context_tokens=64, min_left=32, per_file=3)  # distinct cuts per file
    assert len({p["prompt"] for p in several}) == 6 and len({p["path"] for p in several}) == 2
    for p in prompts + several:
        text = next(d["text"] for d in docs if d["path"] == p["path"])
        at = text.find(p["prompt"])
        assert at >= 0 and text[at + len(p["prompt"]) - 1] == "\n"  # the prompt ends a line of the file
        assert len(tok(text[at + len(p["prompt"]):])["input_ids"]) >= 16
    with pytest.raises(ValueError, match="long enough"):
        cut_prompts(docs[:2], tok, 5, context_tokens=64, min_left=32)


@pytest.mark.skipif(not thin_matmul.supported(), reason="the CPU kernels need an x86-64 CPU with AVX2")
def test_looking_up_the_packages_leaves_the_kernels_buildable():
    # looking pip up switched setuptools' distutils shim to the standard library's, and torch's extension build
    # then failed in that process: a run that built a corpus decoded without its kernels
    code = ("from mtpkit.datasets.code_corpus import PACKAGES, package_root\n"
            "[package_root(p) for p in PACKAGES]\n"
            "from mtpkit.kernels import thin_matmul\n"
            "assert thin_matmul.available()\n")
    subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], check=True, timeout=600)
