"""Self-distillation data: generated prompts (everyday topics and the standard library) that never touch the
benchmark's, and records that replay the model's own greedy output."""

import json
from collections import Counter

from drafting import assert_greedy_is_full_forward_argmax
from tiny_models import save_hf

import mtpkit
from mtpkit.datasets.distill import distill
from mtpkit.decode.step_engine import _ENGINES
from mtpkit.datasets.distill_prompts import TOPICS, build_prompts, vocabulary_words
from mtpkit.models.presets import tiny_hf_model
from mtpkit.prompts import read_prompts
from mtpkit.resources import DEFAULT_PROMPTS, resource


class _CharTokenizer:
    """Enough of a tokenizer for distill(): plain prompts only."""

    eos_token_id = 0
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [1 + ord(c) % 200 for c in text]}


def test_prompts_are_deterministic_and_cover_many_kinds():
    a, b = build_prompts(3000, seed=3), build_prompts(3000, seed=3)
    assert a == b and a != build_prompts(3000, seed=4)
    counts = Counter(p["kind"] for p in a)
    assert set(counts) == {"chat", "prose", "list", "code", "dialogue", "self", "multiturn"}, counts
    assert all(n >= 100 for n in counts.values()), counts
    assert all(p["prompt"].strip() for p in a if "prompt" in p)
    assert all(p["chat"] for p in a if p["kind"] in ("self", "multiturn"))


def test_prompts_keep_the_benchmarks_prompts_and_topics_out(tmp_path):
    (tmp_path / "play_gut.txt").write_text("Enter the KING and his lords, talking of the weather and of war. " * 3)
    prompts = build_prompts(4000, seed=0, literature_dir=tmp_path)
    assert any(p["kind"] == "literature" for p in prompts)
    bench = read_prompts(resource(DEFAULT_PROMPTS))
    texts = {p.get("prompt") or p.get("ask") for p in prompts}
    assert not {p.text for p in bench} & texts
    # no topic of the distillation set is named in a benchmark prompt
    assert not [t for t in TOPICS for b in bench if t.lower() in b.text.lower()]


class _VocabTokenizer:
    tokens = ["\u0120function", "\u0120return", "\u0120Module", "\u0120xqzzyv", "\u2581string", "module", "\u0120sum"]

    def __len__(self):
        return len(self.tokens)

    def convert_ids_to_tokens(self, ids):
        return [self.tokens[i] for i in ids]


def test_vocabulary_words_are_whole_lowercase_words_outside_the_benchmark():
    # "xqzzyv" is no word of any text, "Module" not lowercase, "module" has no leading space, "sum" too short
    assert vocabulary_words(_VocabTokenizer()) == ["function", "return", "string"]
    assert vocabulary_words(_VocabTokenizer(), exclude="What does Return do?") == ["function", "string"]


def test_word_prompts_take_their_share_and_name_one_word():
    words = ["lantern", "harvest", "velvet"]
    a = build_prompts(2000, seed=1, words=words, word_share=0.3)
    assert a == build_prompts(2000, seed=1, words=words, word_share=0.3)
    about_words = [p for p in a if any(w in (p.get("prompt") or p["ask"]).lower() for w in words)]
    assert abs(len(about_words) / len(a) - 0.3) < 0.02
    assert {p["kind"] for p in about_words} == {"word", "self"}
    assert {p["chat"] for p in about_words} == {True, False}
    assert Counter(p["kind"] for p in build_prompts(2000, seed=1))["word"] == 0


class _Replier(_CharTokenizer):
    chat_template = "x"

    def apply_chat_template(self, turns, add_generation_prompt, tokenize):
        return self("|".join(t["content"] for t in turns))

    def decode(self, ids, skip_special_tokens=True):
        return "Why do owls hoot?\nsecond line"


def test_a_framed_self_question_keeps_the_question_only():
    from mtpkit.datasets.distill import _quoted

    assert _quoted('A curious person might ask: "Why do owls hoot?') == "Why do owls hoot?"
    assert _quoted('A helpful assistant might ask, "What is rust?"') == "What is rust?"
    assert _quoted('What does "ergo" mean?') == 'What does "ergo" mean?'


def test_self_and_multiturn_prompts_are_completed_with_the_models_words(tmp_path, monkeypatch):
    from mtpkit.datasets import distill as d

    monkeypatch.setattr(d, "_generate", lambda model, rows, n, eos: [[5, 6]] * len(rows))
    raw = [{"ask": "Write one question.", "chat": True, "kind": "self"},
           {"ask": "Explain tides.", "follow_up": "Why is that?", "chat": True, "kind": "multiturn"},
           {"prompt": "Tides are", "chat": False, "kind": "prose"}]
    done = d.load_or_build_prompts(None, _Replier(), tmp_path / "new" / "p.jsonl", lambda: raw)
    assert done[0] == {"prompt": "Why do owls hoot?", "chat": True, "kind": "self"}
    assert [t["content"] for t in done[1]["prompt"]] == ["Explain tides.", "Why do owls hoot?\nsecond line",
                                                        "Why is that?"]
    assert done[2] == raw[2]
    # a resumed run reads the same list back and never calls the model
    monkeypatch.setattr(d, "_generate", None)
    assert d.load_or_build_prompts(None, _Replier(), tmp_path / "new" / "p.jsonl", lambda: raw) == done


def test_batch_tokens_caps_the_batches_of_prompts_the_model_completes(monkeypatch):
    """A long-input chat's first turn holds its whole document: its batches are capped like distillation's (one
    batch of 512 such turns filled 24 GB and was killed)."""
    from mtpkit.datasets import distill as d

    seen = []
    monkeypatch.setattr(d, "_generate", lambda model, rows, n, eos: seen.append(rows) or [[5, 6]] * len(rows))
    raw = [{"ask": "Explain this: " + "tides " * n, "follow_up": "Why?", "chat": True, "kind": "multiturn"}
           for n in (1, 2, 40, 80, 160, 300)]
    cap = 2 * (len(_Replier()(raw[-1]["ask"])["input_ids"]) + d.REPLY_TOKENS)
    done = d.complete_prompts(None, _Replier(), raw, batch_size=8, batch_tokens=cap)
    assert len(done) == len(raw) and sum(map(len, seen)) == len(raw)
    assert len(seen) > 1 and all(len(rows) * (max(map(len, rows)) + d.REPLY_TOKENS) <= cap for rows in seen)
    seen.clear()
    d.complete_prompts(None, _Replier(), raw, batch_size=8)  # no cap: one batch
    assert len(seen) == 1


def test_distill_records_are_the_models_greedy_output(tmp_path):
    save_hf(tiny_hf_model("qwen3"), tmp_path / "m")
    model = mtpkit.load_model(tmp_path / "m")
    prompts = [p for p in build_prompts(60, seed=0) if not p["chat"]][:5]
    info = distill(model, _CharTokenizer(), prompts, tmp_path / "d.jsonl", max_new_tokens=6, batch_size=2)
    records = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert info["samples"] == len(records) == 5
    assert sorted(r["prompt"] for r in records) == sorted(p["prompt"] for p in prompts)
    for r in records:
        n_prompt = r["loss_mask"].count(0)
        assert r["loss_mask"] == [0] * n_prompt + [1] * (len(r["input_ids"]) - n_prompt)
        # replay: each completion token is the trunk's argmax (or EOS ended it)
        assert_greedy_is_full_forward_argmax(model, [r["input_ids"][:n_prompt]], [r["input_ids"][n_prompt:]])


def test_distill_resumes_after_a_kill_without_repeating_or_losing_a_sample(tmp_path):
    save_hf(tiny_hf_model("qwen3"), tmp_path / "m")
    model = mtpkit.load_model(tmp_path / "m")
    prompts = [p for p in build_prompts(80, seed=1) if not p["chat"]][:6]
    out = tmp_path / "d.jsonl"
    distill(model, _CharTokenizer(), prompts, tmp_path / "full.jsonl", max_new_tokens=4, batch_size=2)
    full = {json.loads(line)["index"]: line for line in (tmp_path / "full.jsonl").read_text().splitlines()}
    first = list(full.values())[:3]
    out.write_text("\n".join(first) + "\n" + first[0][:10])  # three records, then a torn line from a kill
    info = distill(model, _CharTokenizer(), prompts, out, max_new_tokens=4, batch_size=2)
    lines = out.read_text().splitlines()
    assert sorted(json.loads(line)["index"] for line in lines) == list(range(6))
    assert {json.loads(line)["index"]: line for line in lines} == full  # the same records as one clean run
    assert info["tokens"] == sum(sum(json.loads(full[i])["loss_mask"]) for i in full) - sum(
        sum(json.loads(line)["loss_mask"]) for line in first)


def test_a_run_stopped_between_batches_resumes_into_the_same_file(tmp_path):
    save_hf(tiny_hf_model("qwen3"), tmp_path / "m")
    model = mtpkit.load_model(tmp_path / "m")
    prompts = [p for p in build_prompts(200, seed=1) if not p["chat"]][:40]  # more than one block of 16 batches
    distill(model, _CharTokenizer(), prompts, tmp_path / "full.jsonl", max_new_tokens=2, batch_size=1)
    full = (tmp_path / "full.jsonl").read_text()
    out = tmp_path / "d.jsonl"
    out.write_text("".join(full.splitlines(keepends=True)[:5]))  # stopped after five batches
    distill(model, _CharTokenizer(), prompts, out, max_new_tokens=2, batch_size=1)
    assert out.read_text() == full



def test_batch_tokens_caps_the_cache_a_batch_fills(tmp_path, monkeypatch):
    from mtpkit.datasets import distill as distill_module

    save_hf(tiny_hf_model("qwen3"), tmp_path / "m")
    model = mtpkit.load_model(tmp_path / "m")
    prompts = [p for p in build_prompts(80, seed=1) if not p["chat"]][:8]
    distill(model, _CharTokenizer(), prompts, tmp_path / "plain.jsonl", max_new_tokens=3, batch_size=8)
    seen = []
    generate = distill_module._generate
    monkeypatch.setattr(distill_module, "_generate", lambda m, rows, *a: seen.append(rows) or generate(m, rows, *a))
    longest = max(len(p["prompt"]) for p in prompts) + 3
    distill(model, _CharTokenizer(), prompts, tmp_path / "capped.jsonl", max_new_tokens=3, batch_size=8,
            batch_tokens=2 * longest)
    assert len(seen) > 2 and all(len(rows) * (max(map(len, rows)) + 3) <= 2 * longest for rows in seen)
    plain, capped = ({r["index"]: r for r in map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())}
                     for name in ("plain", "capped"))
    assert capped == plain and len(plain) == 8  # smaller batches, the same records


def test_fixed_shape_steps_distill_the_same_records(tmp_path):
    save_hf(tiny_hf_model("qwen3"), tmp_path / "m")
    model = mtpkit.load_model(tmp_path / "m")
    prompts = [p for p in build_prompts(80, seed=2) if not p["chat"]][:5]
    for engine in ("eager", "static"):
        distill(model, _CharTokenizer(), prompts, tmp_path / f"{engine}.jsonl", max_new_tokens=5, batch_size=3,
                engine=engine)
    assert (tmp_path / "static.jsonl").read_text() == (tmp_path / "eager.jsonl").read_text()
    assert any(engine == "static" for engine, _ in _ENGINES[model])  # the fixed-shape steps did run
