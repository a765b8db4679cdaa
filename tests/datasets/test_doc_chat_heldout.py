"""The committed held-out document-chat set: readable by the benchmark, drawn from the held-out side only, and
sharing no text with the training side (checked by content against this machine's installed packages)."""

import json

import pytest

from mtpkit.prompts import read_prompts
from mtpkit.resources import resource
from mtpkit.datasets.doc_chat_heldout import ASKS, MAX_TOKENS, MIN_TOKENS, SECTION_ASKS
from mtpkit.datasets.documents import overlapping, prose_sources, split_sides
from mtpkit.datasets.long_prompts import ASKS as TRAINING_ASKS

HELD_OUT = resource("doc_chat_heldout_prompts.jsonl")


def _records() -> list[dict]:
    return [json.loads(line) for line in HELD_OUT.read_text(encoding="utf-8").splitlines()]


def test_the_set_is_chat_about_held_out_documents():
    records = _records()
    prompts = read_prompts(HELD_OUT)
    assert len(prompts) == len(records) >= 40 and HELD_OUT.stat().st_size < 1_000_000
    assert all(p.chat and p.kind == "document" for p in prompts)
    assert all(MIN_TOKENS <= r["doc_tokens"] <= MAX_TOKENS for r in records)
    sources = [{"path": r["source"], "text": ""} for r in records]
    assert split_sides(sources)[1] == sources  # every source on the held-out side
    asks = [a.split("{")[0] for a in ASKS + SECTION_ASKS]
    assert all(any(a in r["prompt"] for a in asks) for r in records)
    assert not any(a in r["prompt"] for a in TRAINING_ASKS for r in records)


def test_the_set_shares_no_document_with_the_benchmark_prompts():
    bench = [p.text for f in ("bench_prompts.jsonl", "heldout_prompts.jsonl", "heldout2_prompts.jsonl")
             for p in read_prompts(resource(f))]
    docs = [{"text": r["prompt"]} for r in _records()]
    assert overlapping(docs, bench) == set()


@pytest.mark.slow
def test_no_held_out_document_shares_text_with_the_training_side():
    """Reads every installed package's docs (minutes): the held-out prompts against all training-side prose."""
    train, _ = split_sides(prose_sources())
    assert overlapping([{"text": r["prompt"]} for r in _records()], (s["text"] for s in train)) == set()
