"""Distillation prompts with long inputs: their share, their lengths, their sources (training side only), and the
default prompt list unchanged."""

import hashlib
import json
import platform
from collections import Counter

import pytest
from train_runs import make_tokenizer

from mtpkit.datasets.code_corpus import held_out
from mtpkit.datasets.distill_prompts import build_prompts
from mtpkit.datasets.long_prompts import ASKS, LongSources, code_contexts, long_prompt


def _sources() -> LongSources:
    docs = [{"text": f"# Guide {i}\n\n" + f"Paragraph {i} of a long guide. " * 300, "path": f"p{i}.md", "tokens": 900}
            for i in range(5)]
    code = [{"prompt": f"def f{i}(x):\n    return x\n" * 80, "path": f"pkg/m{i}.py", "tokens": 800} for i in range(3)]
    return LongSources(docs, code)


@pytest.mark.skipif(platform.python_version() != "3.11.7", reason="recorded on CPython 3.11.7: stdlib docstrings "
                                                                   "feed the prompts")
def test_default_prompts_are_unchanged():
    # digests of the prompt lists before the long kinds existed (commit c62d60a)
    for (n, seed), digest in {(2000, 0): "f9ff2889cca653ba6f642f0400c0701993385bb95d24f4522330b13a50985252",
                              (500, 7): "1a000c84a82e939e35263e1de8bbe8d185fc044b8239813d414fa954539d74ba"}.items():
        assert hashlib.sha256(json.dumps(build_prompts(n, seed)).encode()).hexdigest() == digest


def test_long_kinds_take_their_share():
    n = 2000
    prompts = build_prompts(n, seed=2, long=_sources(), long_share=0.3)
    assert prompts == build_prompts(n, seed=2, long=_sources(), long_share=0.3)
    counts = Counter(p["kind"] for p in prompts)
    assert len(prompts) == n
    assert abs((counts["document"] + counts["code_file"] + counts["long_multiturn"]) / n - 0.3) < 0.01
    assert counts["document"] == round(n * 0.15) and counts["code_file"] == counts["long_multiturn"] == round(n * 0.075)
    assert counts["list"] == round(n * 0.11 * 0.7)  # the other kinds scaled down, not dropped
    docs, code = _sources().documents, _sources().code
    for p in prompts:
        if p["kind"] == "document":
            assert p["chat"] and any(d["text"] in p["prompt"] for d in docs)
        elif p["kind"] == "code_file":
            assert not p["chat"] and p["prompt"] in {c["prompt"] for c in code}
        elif p["kind"] == "long_multiturn":
            assert p["chat"] and p["follow_up"] and any(d["text"] in p["ask"] for d in docs)


def test_a_request_about_a_document_uses_a_training_wording():
    import random

    from mtpkit.datasets.doc_chat_heldout import ASKS as HELD_OUT_ASKS

    assert not set(ASKS) & set(HELD_OUT_ASKS)
    prompt = long_prompt("document", random.Random(0), _sources())["prompt"]
    assert "Paragraph" in prompt and not any(a in prompt for a in HELD_OUT_ASKS)


def test_code_contexts_are_training_side_whole_lines_in_range(tmp_path):
    tok = make_tokenizer(tmp_path)
    contexts = code_contexts(tok, 12, seed=0, per_file=3, min_tokens=300, max_tokens=900)
    assert contexts
    for c in contexts:
        assert not held_out(c["path"])
        assert 300 <= len(tok(c["prompt"])["input_ids"]) == c["tokens"] <= 900
        assert c["prompt"].endswith("\n")


def test_no_long_sources_is_an_error():
    with pytest.raises(ValueError, match="documents and code"):
        LongSources([], [])


def test_a_file_gives_several_different_contexts(tmp_path):
    tok = make_tokenizer(tmp_path)
    contexts = code_contexts(tok, 6, seed=1, per_file=3, min_tokens=300, max_tokens=900)
    by_file = Counter(c["path"] for c in contexts)
    assert max(by_file.values()) > 1 and len({c["prompt"] for c in contexts}) == len(contexts)
