"""The benchmark: figures add up, outputs are compared, the report and JSON carry what checks read."""

import json

import pytest
from tiny_models import hf_model, random_mtp_tensors, save_hf

import mtpkit
from mtpkit.bench.report import plot, render
from mtpkit.bench.speedup import Prompt, load_prompts, run_bench
from mtpkit.cli import main

JSON_KEYS = {"draft_tokens", "prompts", "baseline_tokens_per_s", "spec_tokens_per_s", "speedup", "acceptance_rate",
             "mean_acceptance_length", "accepted_per_position", "identical"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("q35")
    ref = hf_model("qwen3_5")
    save_hf(ref, path, mtp_tensors=random_mtp_tensors(ref))
    return mtpkit.load_model(path)


def test_run_bench_figures(model, tmp_path):
    prompts = [Prompt("a", False, "prose", [3, 4, 5, 6]), Prompt("b", True, "chat", [7, 8])]
    report = run_bench(model, prompts, num_tokens=12, ks=[1, 3], repeats=2, progress=False)
    assert [r["draft_tokens"] for r in report["runs"]] == [1, 3]
    for r in report["runs"]:
        assert JSON_KEYS <= set(r) and r["prompts"] == 2 and r["identical"] is True
        assert len(r["accepted_per_position"]) == r["draft_tokens"]
        assert all(0 <= a <= 1 for a in r["accepted_per_position"])
        # mean acceptance length = 1 + sum of per-position acceptance (vLLM's definitions agree)
        assert r["mean_acceptance_length"] == pytest.approx(1 + sum(r["accepted_per_position"]))
        assert r["speedup"] == pytest.approx(r["spec_tokens_per_s"] / r["baseline_tokens_per_s"])
    report.update(model="tiny", device="cpu", dtype="float32", threads=1, num_tokens=12, repeats=2, temperature=0.0)
    text = render(report, lambda ids: " ".join(map(str, ids)))
    assert "✓ identical" in text and "OVERALL" in text
    assert plot(report, tmp_path / "b.png").stat().st_size > 1000


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
               "--baseline", "hf", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert {"model", "device", "dtype", "hf_tokens_per_s", "runs"} <= set(report)
    assert report["hf_identical"] is True  # mtpkit's plain greedy == transformers' generate()
    assert all(JSON_KEYS <= set(r) and r["identical"] for r in report["runs"])
    assert "MTP self-speculative decoding" in capsys.readouterr().out
