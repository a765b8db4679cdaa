"""Self-distillation data: generated prompts (everyday topics and the standard library) that never touch the
benchmark's, and records that replay the model's own greedy output."""

import json

import torch
from tiny_models import hf_model, save_hf

import mtpkit
from mtpkit.bench.speedup import DEFAULT_PROMPTS, read_prompts, resource
from mtpkit.train.distill import _TOPICS, distill, mixed_prompts, stdlib_prompts


class _CharTokenizer:
    """Enough of a tokenizer for distill(): plain prompts only."""

    eos_token_id = 0
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [1 + ord(c) % 200 for c in text]}


def test_stdlib_prompts_are_deterministic_and_mixed():
    a, b = stdlib_prompts(300, seed=3), stdlib_prompts(300, seed=3)
    assert a == b and a != stdlib_prompts(300, seed=4)
    kinds = {p["kind"] for p in a}
    assert kinds == {"prose", "chat", "code"}
    assert all(p["chat"] == (p["kind"] == "chat") and p["prompt"].strip() for p in a)


def test_mixed_prompts_cover_the_benchmarks_kinds_but_not_its_prompts():
    prompts = mixed_prompts(2000, seed=0)
    assert prompts == mixed_prompts(2000, seed=0)
    counts = {k: sum(p["kind"] == k for p in prompts) for k in ("chat", "prose", "list", "code")}
    assert all(n >= 100 for n in counts.values()), counts
    bench = read_prompts(resource(DEFAULT_PROMPTS))
    assert not {p.text for p in bench} & {p["prompt"] for p in prompts}
    # no topic of the distillation set is named in a benchmark prompt
    assert not [t for t in _TOPICS for b in bench if t.lower() in b.text.lower()]


def test_distill_records_are_the_models_greedy_output(tmp_path):
    save_hf(hf_model("qwen3"), tmp_path / "m")
    model = mtpkit.load_model(tmp_path / "m")
    prompts = [p for p in stdlib_prompts(40, seed=0) if not p["chat"]][:5]
    info = distill(model, _CharTokenizer(), prompts, tmp_path / "d.jsonl", max_new_tokens=6, batch_size=2)
    records = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert info["samples"] == len(records) == 5
    assert sorted(r["prompt"] for r in records) == sorted(p["prompt"] for p in prompts)
    for r in records:
        n_prompt = r["loss_mask"].count(0)
        assert r["loss_mask"] == [0] * n_prompt + [1] * (len(r["input_ids"]) - n_prompt)
        ids = list(r["input_ids"][:n_prompt])
        with torch.no_grad():  # replay: each completion token is the trunk's argmax (or EOS ended it)
            for t in r["input_ids"][n_prompt:]:
                assert model(torch.tensor([ids])).logits[0, -1].argmax().item() == t
                ids.append(t)
