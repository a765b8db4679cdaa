"""The benchmark: figures add up, outputs are compared (gated rows, transformers' greedy and prompt-lookup
baselines), break-even from step costs, the context-length sweep's prompts, the report and JSON carry what checks
read."""

import json
import re
import time

import pytest
import torch
from tiny_models import random_mtp_tensors, save_hf, save_word_tokenizer, tiny_mtp_model

import mtpkit
from mtpkit.bench import speedup
from mtpkit.bench.contexts import context_prompts, python_docs
from mtpkit.bench.decode_step import cache_evictor, median_ms
from mtpkit.bench.report import label, plot, render, render_contexts
from mtpkit.bench.speedup import break_even, run_bench
from mtpkit.cli import main
from mtpkit.decode.draft_spec import DraftSpec
from mtpkit.models.presets import tiny_hf_model
from mtpkit.prompts import Prompt, load_prompts

JSON_KEYS = {"draft_tokens", "prompts", "baseline_tokens_per_s", "spec_tokens_per_s", "speedup", "acceptance_rate",
             "mean_acceptance_length", "accepted_per_position", "identical"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_mtp_model("qwen3_5", tmp_path_factory.mktemp("q35"))


def test_run_bench_figures(model, tmp_path):
    prompts = [Prompt("a", False, "prose", [3, 4, 5, 6]), Prompt("b", True, "chat", [7, 8])]
    report = run_bench(model, prompts, num_tokens=12, specs=DraftSpec.grid([1, 3], [0, 0.5]), repeats=2,
                       step_repeats=1, progress=False)
    # k = 1 once: its one draft is always proposed, so a threshold cannot change it
    assert [(r["draft_tokens"], r["draft_min_prob"]) for r in report["runs"]] == [(1, 0), (3, 0), (3, 0.5)]
    costs = {c["k"]: c for c in report["step_costs_ms"]}
    for r in report["runs"]:
        assert JSON_KEYS <= set(r) and r["prompts"] == 2 and r["identical"] is True
        assert len(r["accepted_per_position"]) == r["draft_tokens"]
        assert all(0 <= a <= 1 for a in r["accepted_per_position"])
        # mean acceptance length = 1 + sum of per-position acceptance (vLLM's definitions agree)
        assert r["mean_acceptance_length"] == pytest.approx(1 + sum(r["accepted_per_position"]))
        assert r["speedup"] == pytest.approx(r["spec_tokens_per_s"] / r["baseline_tokens_per_s"])
        assert r["realised_break_even"] == pytest.approx(r["mean_acceptance_length"] / r["speedup"])
        assert sum(r["draft_lengths"]) == pytest.approx(1)
        assert r["drafted_per_step"] == pytest.approx(sum(j * f for j, f in enumerate(r["draft_lengths"], 1)))
    k3, gated = report["runs"][1:]
    assert k3["draft_lengths"] == [0, 0, 1] and gated["drafted_per_step"] < 3  # a random head is never sure
    assert k3["break_even"] == pytest.approx((costs[3]["verify"] + costs[3]["draft"]) / costs[3]["decode"])
    report.update(model="tiny", device="cpu", dtype="float32", threads=1, num_tokens=12, repeats=2, temperature=0.0)
    text = render(report, lambda ids: " ".join(map(str, ids)))
    assert "✓ identical" in text and "OVERALL" in text and "break-even" in text and "realised" in text
    assert "drafts/step" in text
    assert plot(report, tmp_path / "b.png").stat().st_size > 1000


def test_step_timings_leave_out_the_cache_eviction():
    calls = []
    ms = median_ms(lambda: calls.append("fn"), 3, before=lambda: (calls.append("evict"), time.sleep(0.05)))
    assert calls == ["fn"] + ["evict", "fn"] * 3  # a warm-up, then every timed call right after an eviction
    assert ms < 25  # the 50 ms before each call is not in its time
    evict = cache_evictor("cpu")
    assert evict() == 64 << 20  # it reads all of its 256 MB buffer


def test_break_even_weights_step_costs_by_the_stop_distribution():
    costs = {1: {"decode": 10.0, "verify": 10.0, "draft": 2.0}, 2: {"verify": 14.0, "draft": 4.0},
             3: {"verify": 16.0, "draft": 7.0}}
    assert break_even(costs, [0, 0, 1]) == pytest.approx(2.3)  # (16 + 7) / 10: every step drafted 3
    assert break_even(costs, [0.5, 0.25, 0.25]) == pytest.approx((0.5 * 12 + 0.25 * 18 + 0.25 * 23) / 10)
    # a draft tree verifies its alternatives too: widths (2,) at L = 1 verify 3 tokens, the cost of a chain's L = 2
    assert break_even(costs, [1], (2,)) == pytest.approx((14 + 2) / 10)
    assert break_even(costs, [0.5, 0.5], (2,)) == pytest.approx((0.5 * (14 + 2) + 0.5 * (16 + 4)) / 10)


def test_transformers_baselines_greedy_and_prompt_lookup(tmp_path, monkeypatch):
    """Both baseline rows run transformers' generate() (prompt lookup with prompt_lookup_num_tokens) on the same
    model; their outputs are compared with mtpkit's plain greedy decoding, and a changed token is reported."""
    ref = tiny_hf_model("llama")
    save_hf(ref, tmp_path, mtp_tensors=random_mtp_tensors(ref))
    model = mtpkit.load_model(tmp_path)
    calls = []
    generate = ref.generate
    monkeypatch.setattr(ref, "generate", lambda *a, **kw: calls.append(kw.get("prompt_lookup_num_tokens")) or
                        generate(*a, **kw))
    prompts = [Prompt("rep", False, "text", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]), Prompt("b", False, "text", [9, 3])]
    kw = dict(num_tokens=10, specs=[DraftSpec(2)], repeats=1, step_repeats=0, hf_model=ref, progress=False)
    report = run_bench(model, prompts, baselines=["hf", "pld"], prompt_lookup=3, **kw)
    assert set(calls) == {None, 3} and report["prompt_lookup_num_tokens"] == 3
    for name in ("hf", "pld"):
        assert report[f"{name}_tokens_per_s"] > 0
        assert report[f"{name}_identical"] is True and report[f"{name}_identical_prompts"] == 2
    report.update(model="tiny", device="cpu", dtype="float32", threads=1, num_tokens=10, repeats=1, temperature=0.0)
    assert "prompt_lookup_num_tokens=3" in render(report, str)
    hf_generate = speedup.hf_generate  # power: a baseline that changes a token is caught
    monkeypatch.setattr(speedup, "hf_generate", lambda *a: hf_generate(*a)[:-1] + [0] if a[-1] else hf_generate(*a))
    report = run_bench(model, prompts, baselines=["hf", "pld"], prompt_lookup=3, **kw)
    assert report["hf_identical"] is True and report["pld_identical"] is False and report["pld_identical_prompts"] == 0


class CharTokenizer:
    """Characters as token ids; decodes back to the text."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_context_prompts_left_pad_the_same_continuation_point():
    doc = " ".join(f"w{i}" for i in range(200))  # "w0 w1 ... w199"
    by_length = context_prompts([("doc", doc), ("short", "too short")], CharTokenizer(), [16, 64])
    short, long = by_length[16][0], by_length[64][0]
    assert [len(short.ids), len(long.ids)] == [16, 64] and len(by_length[16]) == 1
    assert long.ids[-16:] == short.ids  # the same text before the cut, with 48 more tokens of it in front
    text = CharTokenizer().decode(long.ids)
    assert doc.startswith(doc[: doc.index(text)] + text) and doc[doc.index(text) + 64] == " "  # cut at a word start
    with pytest.raises(ValueError, match="no document is longer than 999 tokens"):
        context_prompts([("doc", doc)], CharTokenizer(), [999])


def test_python_reference_topics_are_long_documents():
    docs = python_docs()
    assert len([d for d in docs if len(d[1]) > 9000]) >= 10 and len(docs[0][1]) > len(docs[-1][1])


def test_load_prompts(tmp_path):
    class Tok:
        chat_template = "x"

        def __call__(self, text):
            return {"input_ids": [ord(c) for c in text]}

        def apply_chat_template(self, messages, **kw):
            return [1] + [ord(c) for c in messages[0]["content"]] + [2]

    (tmp_path / "p.txt").write_text("ab\n\ncd\\nef\n")
    assert [p.ids for p in load_prompts(tmp_path / "p.txt", Tok())] == [[97, 98], [99, 100, 10, 101, 102]]
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi", "chat": true}\n')
    assert load_prompts(tmp_path / "p.jsonl", Tok())[0].ids == [1, 104, 105, 2]
    (tmp_path / "bad.jsonl").write_text('{"text": "hi"}\n')
    with pytest.raises(ValueError, match='bad.jsonl:1 needs a "prompt" string'):
        load_prompts(tmp_path / "bad.jsonl", Tok())


@pytest.mark.slow
def test_bench_cli_on_smollm2_with_a_random_head(smollm2_gguf, tmp_path, capsys):
    from mtpkit.checkpoint.mtp_head import save_mtp_head

    model = mtpkit.load_model(smollm2_gguf)
    mtpkit.add_mtp(model, 1, init="last_layer")
    save_mtp_head(model, tmp_path / "head.safetensors")
    (tmp_path / "p.jsonl").write_text('{"prompt": "The capital of France is", "chat": false}\n'
                                      '{"prompt": "Name a colour.", "chat": true}\n')
    rc = main(["bench", "--model", str(smollm2_gguf), "--mtp", str(tmp_path / "head.safetensors"), "--prompts",
               str(tmp_path / "p.jsonl"), "--num-tokens", "8", "--draft-tokens", "1,2", "--repeats", "1",
               "--step-repeats", "0",
               "--baseline", "hf", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert {"model", "device", "dtype", "hf_tokens_per_s", "runs"} <= set(report)
    assert report["hf_identical"] is True  # mtpkit's plain greedy == transformers' generate()
    assert all(JSON_KEYS <= set(r) and r["identical"] for r in report["runs"])
    assert "MTP self-speculative decoding" in capsys.readouterr().out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama with a random MTP head and a tokenizer whose words are t0 .. t255 (eos t255)."""
    path = tmp_path_factory.mktemp("tiny_llama")
    ref = tiny_hf_model("llama")
    save_hf(ref, path, mtp_tensors=random_mtp_tensors(ref))
    save_word_tokenizer(path)
    return path


def test_bench_cli_context_lengths(llama_dir, tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(f"t{(i * n) % 250 + 1}" for i in range(90))}) + "\n"
                            for n in (3, 7)))
    rc = main(["bench", "--model", str(llama_dir), "--context-lengths", "16,64", "--context-docs", str(docs),
               "--num-tokens", "6", "--draft-tokens", "1,2", "--draft-min-prob", "0,0.5", "--repeats", "1",
               "--step-repeats", "1", "--baseline", "hf,pld", "--json", str(tmp_path / "r.json"),
               "--plot", str(tmp_path / "c.png")])
    assert rc == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert [c["context_tokens"] for c in report["contexts"]] == [16, 64]
    for c in report["contexts"]:
        assert [(r["draft_tokens"], r["draft_min_prob"]) for r in c["runs"]] == [(1, 0), (2, 0), (2, 0.5)]
        assert all(r["prompts"] == 2 and r["identical"] and r["break_even"] > 0 for r in c["runs"])
        assert c["hf_identical"] is True and c["pld_identical"] is True
    out = capsys.readouterr().out
    assert "acceptance across context lengths" in out and "docs.jsonl, 2 documents" in out
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert render_contexts(report) in out


def test_render_contexts_first_draft_shares():
    """The sweep's table ends with each row's first-draft acceptance as a share of the shortest context's."""
    def run(k, first):
        return {"draft_tokens": k, "prompts": 7, "acceptance_rate": first, "mean_acceptance_length": 1 + first,
                "accepted_per_position": [first] + [first / 2] * (k - 1)}

    report = {"model": "m", "mtp_head": "h", "source": "docs", "num_tokens": 64, "dtype": "float32",
              "device": "cpu", "threads": 2, "contexts": [
                  {"context_tokens": L, "batch_size": 8, "runs": [run(1, a), run(3, b)]}
                  for L, a, b in ((128, 0.5, 0.4), (2048, 0.45, 0.2), (4096, 0.5, 0.0))]}
    text = render_contexts(report)
    assert "share of the value at 128 context tokens" in text
    assert "k=1         2048: 0.90  4096: 1.00" in text
    assert "k=3         2048: 0.50  4096: 0.00" in text
    one = render_contexts({**report, "contexts": report["contexts"][:1]})
    assert "share of the value" not in one


def test_bench_cli_context_lengths_acceptance_only(llama_dir, tmp_path, capsys):
    """The sweep without timing (heads compared across context lengths quickly) gives the timed sweep's acceptance."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(f"t{(i * n) % 250 + 1}" for i in range(90))}) + "\n"
                            for n in (3, 7, 11)))
    common = ["bench", "--model", str(llama_dir), "--context-lengths", "16,64", "--context-docs", str(docs),
              "--num-tokens", "6", "--draft-tokens", "1,2"]
    assert main([*common, "--repeats", "1", "--step-repeats", "0", "--json", str(tmp_path / "timed.json")]) == 0
    capsys.readouterr()
    assert main([*common, "--acceptance-only", "--batch-size", "1", "--json", str(tmp_path / "a.json")]) == 0
    timed, quick = (json.loads((tmp_path / f).read_text())["contexts"] for f in ("timed.json", "a.json"))
    assert [c["context_tokens"] for c in quick] == [16, 64]
    for t, q in zip(timed, quick):
        for rt, rq in zip(t["runs"], q["runs"], strict=True):
            assert rq["prompts"] == 3 and "speedup" not in rq
            assert rq["mean_acceptance_length"] == rt["mean_acceptance_length"]
            assert rq["accepted_per_position"] == rt["accepted_per_position"]
    out = capsys.readouterr().out
    assert "acceptance only, batches of 1" in out and "docs.jsonl, 3 documents" in out


def test_bench_cli_draft_trees(llama_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("t5 t9 t3 t7\nt1 t2\n")
    rc = main(["bench", "--model", str(llama_dir), "--prompts", str(prompts), "--num-tokens", "8", "--draft-tokens",
               "1,2", "--draft-widths", "3", "3,2", "--repeats", "1", "--step-repeats", "1",
               "--json", str(tmp_path / "r.json")])
    assert rc == 0
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    # (3, 2) cut to k = 1 is (3,): measured once
    assert [(r["draft_tokens"], r["draft_widths"]) for r in runs] == [(1, []), (1, [3]), (2, []), (2, [3]), (2, [3, 2])]
    assert [r["verified_tokens_per_step"] for r in runs] == [2, 4, 3, 5, 6]
    assert all(r["identical"] and r["break_even"] > 0 for r in runs)
    assert "k=2 w=3,2" in capsys.readouterr().out


def test_bench_cli_context_drafts(llama_dir, tmp_path, capsys):
    """--draft-lookup runs each k with and without context drafts, and k = 0 (no head) once per length; a row's
    per-position acceptance runs to its longest draft; break-even is left out where drafts were looked up (their
    drafting cost is not the head's)."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("t5 t9 t3 t7 t158 t172 t250 t241 t102 t209 t255 t5 t9 t3 t7\n")  # the model's own output inside
    rc = main(["bench", "--model", str(llama_dir), "--prompts", str(prompts), "--num-tokens", "24", "--draft-tokens",
               "0,1", "--draft-widths", "3", "--draft-lookup", "0,3", "--draft-lookup-ngram", "1,2", "--repeats", "1",
               "--step-repeats", "1", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert [(r["draft_tokens"], r["draft_widths"], r["draft_lookup"]) for r in runs] == [
        (0, [], 3), (1, [], 0), (1, [], 3), (1, [3], 0), (1, [3], 3)]
    assert all(r["identical"] for r in runs)
    for r in runs:
        assert len(r["accepted_per_position"]) == max(r["draft_tokens"], r["draft_lookup"])
        assert r["mean_acceptance_length"] == pytest.approx(1 + sum(r["accepted_per_position"]))
        assert (r["break_even"] is None) == (r["draft_lookup"] > 0)
        assert (r["context_drafted_share"] > 0) == (r["draft_lookup"] > 0)
    out = capsys.readouterr().out
    assert "k=1 w=3 lookup=3" in out and "looked up" in out


def test_bench_cli_draft_auto_row(llama_dir, tmp_path, capsys):
    """--draft-auto adds an `auto` row next to the fixed ones, identical to plain decoding."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("t5 t9 t3 t7 t158 t172 t250 t241 t102 t209 t255 t5 t9 t3 t7\nt1 t2\n")
    rc = main(["bench", "--model", str(llama_dir), "--prompts", str(prompts), "--num-tokens", "24", "--draft-tokens",
               "1", "--draft-auto", "--repeats", "1", "--step-repeats", "0", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert [(r["auto"], r["draft_tokens"], r["draft_lookup"]) for r in runs] == [(False, 1, 0), (True, 3, 8)]
    assert all(r["identical"] for r in runs)
    out = capsys.readouterr().out
    assert re.search(r"^  auto ", out, re.M)
    ratio = runs[1]["spec_tokens_per_s"] / runs[0]["spec_tokens_per_s"]
    assert f"▶ draft=auto {runs[1]['speedup']:.2f}×: {ratio:.2f} of the best fixed row's tokens/s (k=1, " in out


def test_bench_cli_context_drafts_without_a_head(tmp_path):
    """A model without a head benchmarks context drafts alone (k = 0)."""
    path = tmp_path / "no_head"
    save_hf(tiny_hf_model("llama"), path)
    save_word_tokenizer(path)
    prompts = tmp_path / "p.txt"
    prompts.write_text("t5 t9 t3 t7 t158 t172 t250 t241 t102 t209 t255 t5 t9 t3 t7\n")
    rc = main(["bench", "--model", str(path), "--prompts", str(prompts), "--num-tokens", "24", "--draft-tokens", "0",
               "--draft-lookup", "3", "--draft-lookup-ngram", "1,2", "--repeats", "1", "--step-repeats", "0",
               "--json", str(tmp_path / "r.json")])
    assert rc == 0
    (run,) = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert run["draft_tokens"] == 0 and run["identical"] and run["context_drafted_share"] == 1


@pytest.mark.parametrize("args, message", [
    (["--draft-tokens", "0"], "0 only with a lookup length > 0"),
    (["--draft-lookup", "-1"], "draft_lookup must be an integer >= 0"),
    (["--draft-lookup", "2", "--draft-lookup-ngram", "3,1"], "1 <= min <= max"),
    (["--draft-min-prob", "1.5"], r"draft_min_prob must be in \[0, 1\]"),
    # bounds: refused before the model loads (they used to allocate GBs or time step costs without end)
    (["--draft-lookup", "2000"], "at most 256"),
    (["--draft-widths", "40000"], "at most 256"),
    (["--draft-lookup", str(10**12)], "at most 256"),
    (["--draft-widths", "2,0"], "draft widths must be >= 1"),
    (["--baseline", "vllm"], "--baseline takes hf and/or pld"),
    (["--context-lengths", "8"], "--context-lengths must be >= 16"),
    (["--context-lengths", "abc"], "--context-lengths takes comma-separated numbers"),
    (["--context-lengths", "64", "--prompts", "p.txt"], "not on --prompts"),
])
def test_bench_cli_bad_options(llama_dir, args, message, capsys):
    assert main(["bench", "--model", str(llama_dir), *args]) != 0
    err = capsys.readouterr().err.strip()
    assert re.search(message, err) and len(err.splitlines()) == 1


def test_a_differing_output_is_reported_with_the_plain_models_top2_gap(model):
    p = Prompt("a", False, "prose", [3, 4, 5, 6])
    plain = mtpkit.generate(model, [p.ids], max_new_tokens=6).tokens[0]
    with torch.no_grad():
        logits = model(torch.tensor([p.ids + plain[:2]])).logits[0, -1]
    second = int(logits.topk(2).indices[1])
    other = plain[:2] + [second] + plain[3:]  # a run that took the plain model's second choice at token 2
    outputs = {(0, 0): (plain, None), ((1, 0.0), 0): (other, None), ((2, 0.0), 0): (plain, None)}
    gaps = speedup.first_differences(model, [p], outputs, [(1, 0.0), (2, 0.0)])
    top = logits.topk(2).values
    assert list(gaps) == [((1, 0.0), 0)]
    d = gaps[(1, 0.0), 0]
    assert d["position"] == 2 and d["other_is_top2"] and d["top2_gap"] == pytest.approx(float(top[0] - top[1]))


def test_bench_acceptance_only_equals_the_timed_rows_figures(llama_dir, tmp_path, capsys):
    """--acceptance-only decodes the prompts in batches, untimed: its acceptance figures equal the timed
    benchmark's (one prompt at a time), with the tokens kept per verification step for each prompt kind."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"t{(i * n) % 9 + 1}" for i in range(n)),
                                           "kind": "even" if n % 2 == 0 else "odd"}) + "\n" for n in (3, 6, 8, 11, 14)))
    common = ["bench", "--model", str(llama_dir), "--prompts", str(prompts), "--num-tokens", "10",
              "--draft-tokens", "0,1,2", "--draft-lookup", "0,3"]
    assert main([*common, "--repeats", "1", "--step-repeats", "0", "--json", str(tmp_path / "timed.json")]) == 0
    assert main([*common, "--acceptance-only", "--batch-size", "2", "--json", str(tmp_path / "acc.json")]) == 0
    timed = json.loads((tmp_path / "timed.json").read_text())["runs"]
    fast = json.loads((tmp_path / "acc.json").read_text())["runs"]
    assert [label(r) for r in fast] == [label(r) for r in timed] == ["k=0 lookup=3", "k=1", "k=1 lookup=3", "k=2",
                                                                     "k=2 lookup=3"]
    for a, b in zip(fast, timed):
        for key in ("acceptance_rate", "mean_acceptance_length", "accepted_per_position", "draft_lengths",
                    "context_drafted_share"):
            assert a[key] == pytest.approx(b[key]), (label(a), key)
        # tokens kept per step: at most the accepted drafts plus one (fewer where max_new_tokens cuts a step)
        # a kind none of whose steps was speculative (no context match, no head) has no entry
        assert set(a["per_kind"]) == ({"even", "odd"} if a["draft_tokens"] else {"even"})
        assert all(1 <= v <= 1 + len(a["draft_lengths"]) for v in a["per_kind"].values())
        assert "speedup" not in a
    assert any(r["mean_acceptance_length"] > 1.2 for r in fast)  # the lookup rows accept: the figures are not all 0
    out = capsys.readouterr().out
    assert "MTP acceptance (no timing)" in out and "decoded 2 at a time" in out
    assert main([*common, "--acceptance-only", "--baseline", "hf"]) == 2
    assert "--acceptance-only measures no speed" in capsys.readouterr().err


@pytest.mark.parametrize("acceptance_only", [False, True])
def test_a_prompt_past_the_context_is_refused_before_any_decoding(llama_dir, tmp_path, capsys, acceptance_only):
    context = json.loads((llama_dir / "config.json").read_text())["max_position_embeddings"]
    prompts = tmp_path / "p.txt"
    prompts.write_text("t1 t2 t3\n" + " ".join(f"t{i % 250 + 1}" for i in range(context - 8)) + "\n")
    args = ["bench", "--model", str(llama_dir), "--prompts", str(prompts), "--num-tokens", "16", "--draft-tokens", "1"]
    assert main(args + (["--acceptance-only"] if acceptance_only else ["--repeats", "1"])) == 2
    err = capsys.readouterr().err.strip()
    assert f"1 prompt(s) leave no room for 16 new tokens in the model's context of {context} (prompt 2 of 2" in err
    assert "lower --num-tokens" in err and len(err.splitlines()) == 1
