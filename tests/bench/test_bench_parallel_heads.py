"""`mtpkit bench` on a model with parallel heads (mtpkit's `mtp_heads.*` layout): blockwise drafting, outputs
identical to plain decoding, and the break-even column from the heads' own drafting cost."""

import json

import pytest
from drafting import parallel_drafting_model
from tiny_models import save_word_tokenizer

import mtpkit
from mtpkit.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_cli_with_parallel_heads(tmp_path, capsys):
    mtpkit.save_model(parallel_drafting_model("llama", heads=2), tmp_path / "m")
    save_word_tokenizer(tmp_path / "m", words=32)
    (tmp_path / "p.txt").write_text("t1 t2 t3 t4 t5\nt9 t8 t7\n")
    rc = main(["bench", "--model", str(tmp_path / "m"), "--prompts", str(tmp_path / "p.txt"), "--num-tokens", "12",
               "--draft-tokens", "1,2", "--repeats", "1", "--step-repeats", "1", "--json", str(tmp_path / "r.json")])
    assert rc == 0, capsys.readouterr()
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert [r["draft_tokens"] for r in runs] == [1, 2]
    assert all(r["identical"] and r["prompts"] == 2 and r["break_even"] > 0 for r in runs)
    assert runs[1]["mean_acceptance_length"] > 1
    assert main(["bench", "--model", str(tmp_path / "m"), "--prompts", str(tmp_path / "p.txt"),
                 "--draft-tokens", "3"]) != 0
    assert "use draft_tokens <= 2" in capsys.readouterr().err
