"""`mtpkit features --compute auto` on a directory it started: the recorded compute dtype, not a new measurement
that could choose the other one and be refused (or, before the manifest, mix fp32 and bf16 rows)."""

import json

import torch
from train_runs import TINY_LLAMA, make_tokenizer

from mtpkit.checkpoint.hf import build_model, save_model
from mtpkit.cli import main


def test_auto_resumes_with_the_recorded_compute(tmp_path, capsys, one_thread):
    torch.manual_seed(0)
    save_model(build_model(TINY_LLAMA), tmp_path / "m", make_tokenizer(tmp_path))
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"input_ids": [i, i + 1, i + 2, 7]}) + "\n" for i in range(5)))
    args = ["features", "--model", str(tmp_path / "m"), "--records", str(tmp_path / "r.jsonl"), "--out",
            str(tmp_path / "f")]
    assert main([*args, "--compute", "float32"]) == 0
    capsys.readouterr()
    assert main([*args, "--compute", "auto"]) == 0
    assert "measured" not in capsys.readouterr().out
    assert main([*args, "--compute", "bfloat16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds features of another run (different compute)" in err
