"""`mtpkit distill --prompts FILE`: a user's own prompts (text, chat and chat records) are distilled as given."""

from __future__ import annotations

import json

import torch
from train_runs import TINY_LLAMA, make_tokenizer

from mtpkit.checkpoint.hf import build_model, save_model
from mtpkit.cli import main
from mtpkit.tokenizer import encode_prompt


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
