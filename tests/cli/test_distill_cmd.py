"""`mtpkit distill`: a user's own prompts (--prompts FILE) distilled as given; and an output it did not start,
or started differently (another model, other arguments, a foreign file, a features directory of `mtpkit
features`, a second writer, a shard temp file left by a kill): each one refusal line that leaves the files as
they were, while the same command continues the run."""

from __future__ import annotations

import json

import pytest
import torch
from train_runs import TINY_LLAMA, make_tokenizer

from mtpkit.checkpoint.hf import build_model, save_model
from mtpkit.cli import main
from mtpkit.locking import OutputLock
from mtpkit.tokenizer import encode_prompt


@pytest.fixture(scope="module")
def models(tmp_path_factory, one_thread):
    """Two tiny Llamas (different weights, one tokenizer)."""
    root = tmp_path_factory.mktemp("distill_cmd")
    tok = make_tokenizer(root)
    for seed, name in ((0, "a"), (1, "b")):
        torch.manual_seed(seed)
        save_model(build_model(TINY_LLAMA), root / name, tok)
    return root / "a", root / "b"


def _args(model, out, *extra):
    return ["distill", "--model", str(model), "--out", str(out), "--num-prompts", "4", "--max-new-tokens", "3",
            "--batch-size", "2", "--no-literature", "--dtype", "float32", *extra]


def _ok(argv, capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def _refused(capsys, *words):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err


def _files(root):
    return {p.name: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.suffix != ".lock"}


def test_a_resume_with_another_model_or_arguments_is_refused(models, tmp_path, capsys):
    a, b = models
    out = tmp_path / "d.jsonl"
    (tmp_path / "p.txt").write_text("the king hath spoken\n")
    _ok(_args(a, out), capsys)
    before = _files(tmp_path)
    for changed in (_args(b, out), _args(a, out, "--seed", "1"), _args(a, out, "--word-share", "0.5"),
                    _args(a, out, "--dtype", "bfloat16"), _args(a, out, "--num-prompts", "7"),  # the last flag counts
                    _args(a, out, "--max-new-tokens", "5"), _args(a, out, "--prompts", str(tmp_path / "p.txt"))):
        assert main(changed) == 2
        _refused(capsys, "was started with other settings", "another --out")
        assert _files(tmp_path) == before
    assert "4 of 4 prompts done" in _ok(_args(a, out), capsys)  # the same command continues: nothing left to do
    assert _files(tmp_path) == before


@pytest.mark.parametrize("content", ["notes\nmore notes\n", '{"text": "a foreign record"}\n{"text": "another"}\n'])
def test_an_out_holding_someone_elses_data_is_left_alone(models, tmp_path, capsys, content):
    out = tmp_path / "notes.jsonl"
    out.write_text(content)
    assert main(_args(models[0], out)) == 2
    _refused(capsys, "mtpkit distill did not write", "new file")
    assert out.read_text() == content and sorted(p.name for p in tmp_path.iterdir()) == ["notes.jsonl"]


def test_features_of_mtpkit_features_are_not_replaced(models, tmp_path, capsys):
    a, _ = models
    first = tmp_path / "first.jsonl"
    _ok(_args(a, first), capsys)
    _ok(["features", "--model", str(a), "--records", str(first), "--out", str(tmp_path / "f")], capsys)
    before = _files(tmp_path / "f")
    assert main(_args(a, tmp_path / "d.jsonl", "--features", str(tmp_path / "f"))) == 2
    _refused(capsys, "written by mtpkit features, not by this mtpkit distill", "another directory")
    assert not (tmp_path / "d.jsonl").exists()  # refused before any work
    assert _files(tmp_path / "f") == before
    _ok(_args(a, tmp_path / "d.jsonl", "--features", str(tmp_path / "g")), capsys)  # power: a new directory
    _ok(_args(a, tmp_path / "d.jsonl", "--features", str(tmp_path / "g")), capsys)  # and its own, rebuilt


def test_a_second_writer_is_refused(models, tmp_path, capsys):
    out = tmp_path / "d.jsonl"
    with OutputLock(tmp_path / "d.jsonl.lock", "held"):  # another run holds the output
        assert main(_args(models[0], out)) == 2
    _refused(capsys, "is being written by another process", "pid ")
    assert not out.exists()


def test_a_shard_temp_file_left_by_a_kill_is_not_read_as_a_shard(models, tmp_path, capsys):
    a, _ = models
    out, features = tmp_path / "d.jsonl", tmp_path / "f"
    _ok(_args(a, out, "--features", str(features), "--num-prompts", "2"), capsys)
    # a kill while the next shard was written: this mtpkit's temp name, and the one older versions read as a shard
    (tmp_path / "d.jsonl.hidden" / ".000001.tmp").write_bytes(b"PK\x03\x04 half")
    (tmp_path / "d.jsonl.hidden" / "000001.tmp.npz").write_bytes(b"PK\x03\x04 half")
    lines = out.read_text().splitlines()
    out.write_text(lines[0] + "\n")  # its records were never appended
    _ok(_args(a, out, "--features", str(features), "--num-prompts", "2"), capsys)
    assert json.loads((features / "meta.json").read_text())["records"] == 2


def test_distill_a_prompts_file(tmp_path, one_thread):
    tok = make_tokenizer(tmp_path)
    torch.manual_seed(0)
    save_model(build_model(TINY_LLAMA), tmp_path / "model", tok)
    prompts = [{"prompt": "the king hath spoken", "kind": "verse"},
               {"prompt": "good morrow sweet lady", "chat": True},
               {"messages": [{"role": "user", "content": "my lord the night is cold"},
                             {"role": "assistant", "content": "and full of stars"}]}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = tmp_path / "d.jsonl"
    argv = ["distill", "--model", str(tmp_path / "model"), "--out", str(out), "--prompts", str(tmp_path / "p.jsonl"),
            "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "4", "--batch-size", "2"]
    assert main(argv) == 0
    records = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["index"])
    assert [r["kind"] for r in records] == ["verse", "chat", "chat"]
    expected = [encode_prompt(tok, "the king hath spoken"), encode_prompt(tok, "good morrow sweet lady", True),
                encode_prompt(tok, "my lord the night is cold", True)]
    for rec, ids in zip(records, expected):
        assert rec["input_ids"][: len(ids)] == ids and rec["loss_mask"] == [0] * len(ids) + [1] * 4


def test_image_prompts_are_refused(tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "what is this?", "image": "x.png"}) + "\n")
    assert main(["distill", "--out", str(tmp_path / "d.jsonl"), "--prompts", str(tmp_path / "p.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert "image prompts" in err and "\n" not in err


def test_long_share_adds_the_long_kinds(tmp_path, monkeypatch, capsys):
    from collections import Counter

    from mtpkit.datasets import distill, long_prompts

    docs = [{"text": "A long guide. " * 400, "path": "g.md", "tokens": 1200}]
    code = [{"prompt": "def f(x):\n    return x\n" * 100, "path": "pkg/m.py", "tokens": 900}]
    monkeypatch.setattr(long_prompts, "long_sources", lambda tok, seed: long_prompts.LongSources(docs, code))
    built = {}
    monkeypatch.setattr(distill, "distill_model", lambda model, out, build, **kw: built.update(prompts=build(None)))
    argv = ["distill", "--out", str(tmp_path / "d.jsonl"), "--num-prompts", "400", "--no-literature"]
    assert main(argv + ["--long-share", "0.5"]) == 0
    kinds = Counter(p["kind"] for p in built["prompts"])
    assert (kinds["document"], kinds["code_file"], kinds["long_multiturn"]) == (100, 50, 50)
    assert main(argv + ["--long-share", "1.5"]) == 2
    assert "--long-share must lie in [0, 1)" in capsys.readouterr().err


def test_batch_tokens_and_engine_reach_the_distillation(tmp_path, monkeypatch, capsys):
    from mtpkit.datasets import distill

    got = {}
    monkeypatch.setattr(distill, "distill_model", lambda model, out, build, **kw: got.update(kw))
    argv = ["distill", "--out", str(tmp_path / "d.jsonl"), "--no-literature"]
    assert main(argv + ["--batch-tokens", "65536", "--engine", "cuda-graph"]) == 0
    assert got["batch_tokens"] == 65536 and got["engine"] == "cuda-graph"
    assert main(argv + ["--batch-tokens", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--batch-tokens must be >= 0" in err and "\n" not in err


def test_a_prompt_too_long_for_the_context_is_refused_before_any_work(models, tmp_path, capsys):
    """Refused before the manifest and the prompt list are written: the corrected file then runs as a new run
    (found after the first batches, the run's saved prompt list would have kept the bad prompt for every resume)."""
    short, long = {"prompt": "the king hath spoken"}, {"prompt": " ".join(["the night is cold"] * 200)}
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in (short, long, short)))
    out = tmp_path / "run" / "d.jsonl"
    argv = ["distill", "--model", str(models[0]), "--out", str(out), "--prompts", str(tmp_path / "p.jsonl"),
            "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "4", "--batch-size", "2"]
    assert main(argv) == 2
    _refused(capsys, "1 prompt(s)", "context of 512", "prompt 2 of 3", "--max-new-tokens")
    assert [p.name for p in out.parent.iterdir() if p.suffix != ".lock"] == []
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in (short, short)))
    assert main(argv) == 0
    assert len(out.read_text().splitlines()) == 2
