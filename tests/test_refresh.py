"""`mtpkit refresh`: a stale head grafted into a fine-tune is retrained on the model's own continuations; a killed
run resumes to the same head; bad input gets one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file
from train_runs import TINY_LLAMA, _WORDS, make_tokenizer

import mtpkit
from mtpkit.checkpoint.hf import build_model, save_model
from mtpkit.cli import main
from mtpkit.refresh import refresh

SMALL = dict(max_new_tokens=24, batch_size=16, device="cpu", dtype="float32", train_batch_size=8, seq_len=64,
             ks=(1, 2), eval_tokens=24, progress=False)


@pytest.fixture(scope="module")
def planted(tmp_path_factory, one_thread):
    """A base model with a random head, its fine-tune (trunk moved, head lost, as transformers saves it) and a
    prompts file of 60 lines of verse."""
    root = tmp_path_factory.mktemp("refresh")
    tok = make_tokenizer(root)
    torch.manual_seed(0)
    base = mtpkit.add_mtp(build_model(TINY_LLAMA), depth=1, init="random")
    save_model(base, root / "base", tok)
    finetuned = build_model(TINY_LLAMA)
    finetuned.load_state_dict({k: v for k, v in base.state_dict().items() if not k.startswith("mtp.")})
    with torch.no_grad():
        for p in finetuned.parameters():
            p.add_(0.02 * torch.randn_like(p))
    save_model(finetuned, root / "finetuned", tok)
    g = torch.Generator().manual_seed(1)
    lines = [" ".join(_WORDS[int(j)] for j in torch.randint(0, len(_WORDS), (12,), generator=g)) for _ in range(60)]
    (root / "prompts.txt").write_text("\n".join(lines) + "\n")
    return root


def test_refresh_raises_acceptance_and_keeps_decoding_lossless(planted, tmp_path):
    report = refresh(planted / "finetuned", planted / "prompts.txt", tmp_path / "out", head_from=planted / "base",
                     epochs=40, lr=1e-2, eval_every=5, **SMALL)
    assert report["train_prompts"] == 48 and report["eval_prompts"] == 12
    before, after = report["before"]["1"], report["after"]["1"]
    # the random head rarely agrees with the trunk; trained on the trunk's own words it mostly does
    assert after["mean_acceptance_length"] > before["mean_acceptance_length"] + 0.25, report
    assert json.loads((tmp_path / "out" / "report.json").read_text())["after"]["1"] == after
    model = mtpkit.load_model(tmp_path / "out" / "hf").eval()
    assert model.mtp is not None
    tok_ids = [[5, 17, 33, 8], [9, 2]]
    plain = mtpkit.generate(model, tok_ids, max_new_tokens=16).tokens
    assert mtpkit.generate(model, tok_ids, max_new_tokens=16, draft_tokens=2).tokens == plain


def _cli(planted, out):
    return [sys.executable, "-m", "mtpkit", "refresh", "--model", str(planted / "finetuned"), "--head-from",
            str(planted / "base"), "--prompts", str(planted / "prompts.txt"), "--out", str(out), "--device", "cpu",
            "--dtype", "float32", "--max-new-tokens", "24", "--batch-size", "16", "--train-batch-size", "8",
            "--seq-len", "64", "--epochs", "40", "--lr", "3e-3"]


@pytest.mark.slow
def test_a_killed_refresh_resumes_to_the_same_head(planted, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(_cli(planted, tmp_path / "whole"), check=True, env=env, capture_output=True)
    proc = subprocess.Popen(_cli(planted, tmp_path / "killed"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list((tmp_path / "killed" / "train" / "checkpoints").glob("step-*")) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "hf").exists(), "the run finished before the kill: the test needs more steps"
    subprocess.run(_cli(planted, tmp_path / "killed"), check=True, env=env, capture_output=True)
    whole = load_file(tmp_path / "whole" / "hf" / "model.safetensors")
    resumed = load_file(tmp_path / "killed" / "hf" / "model.safetensors")
    heads = [n for n in whole if n.startswith("mtp.")]
    assert heads and all(torch.equal(whole[n], resumed[n]) for n in heads)


def _one_line_error(argv, capsys, match):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and match in err, err


def test_one_line_errors(planted, tmp_path, capsys):
    args = ["refresh", "--prompts", str(planted / "prompts.txt"), "--out", str(tmp_path / "o"), "--device", "cpu"]
    _one_line_error(["refresh", "--model", str(planted / "finetuned"), *args[1:]], capsys, "--head-from")
    (tmp_path / "empty.txt").write_text("\n")
    _one_line_error(["refresh", "--model", str(planted / "finetuned"), "--head-from", str(planted / "base"),
                     "--prompts", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o2")], capsys, "no prompts")
    other = dict(TINY_LLAMA, hidden_size=48, head_dim=24)
    save_model(mtpkit.add_mtp(build_model(other), depth=1), tmp_path / "other", make_tokenizer(tmp_path))
    _one_line_error(["refresh", "--model", str(planted / "finetuned"), "--head-from", str(tmp_path / "other"),
                     *args[1:]], capsys, "hidden")
    (tmp_path / "long.txt").write_text(" ".join(["the night is cold"] * 200) + "\n")  # past the context of 512
    _one_line_error(["refresh", "--model", str(planted / "finetuned"), "--head-from", str(planted / "base"),
                     "--eval-prompts", str(tmp_path / "long.txt"), *args[1:4], str(tmp_path / "o3"), "--device",
                     "cpu"], capsys, "1 held-out prompt(s) leave no room for 128 new tokens in the model's context")
    assert not (tmp_path / "o3").exists()  # refused before any work


def test_a_rerun_with_other_prompts_is_refused(planted, tmp_path):
    run = dict(head_from=planted / "base", epochs=1, **SMALL)
    refresh(planted / "finetuned", planted / "prompts.txt", tmp_path / "out", **run)
    lines = (planted / "prompts.txt").read_text().splitlines()
    (tmp_path / "other.txt").write_text("\n".join(["the fool doth sing of winter rain", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="other settings"):
        refresh(planted / "finetuned", tmp_path / "other.txt", tmp_path / "out", **run)
    refresh(planted / "finetuned", planted / "prompts.txt", tmp_path / "out", **run)  # the same command resumes


def test_as_drafted_reaches_the_head_training(tmp_path):
    from mtpkit.refresh import train_config
    from mtpkit.train.config import ConfigKeyError, config_from_dict

    def config(layers, as_drafted):
        return config_from_dict(train_config(tmp_path, tmp_path, tmp_path / "run", lengths=[64] * 64, layers=layers,
                                             depth=None, epochs=1, lr=1e-3, batch_size=2, seq_len=64, device="cpu",
                                             seed=0, progress=False, as_drafted=as_drafted))

    assert config(1, True).mtp.as_drafted and not config(1, False).mtp.as_drafted
    with pytest.raises(ConfigKeyError, match="as_drafted"):  # a head of 2 layers drafts depth 2 with its own layer
        config(2, True)


def test_whole_records_rows_hold_the_longest_record_and_steps_count_epochs(tmp_path):
    from mtpkit.refresh import train_config

    lengths = [300, 500, 640, 200, 420, 350] * 4
    kw = dict(layers=1, depth=None, epochs=2, lr=1e-3, batch_size=2, seq_len=512, device="cpu", seed=0,
              progress=False)
    stream = train_config(tmp_path, tmp_path, tmp_path / "run", lengths=lengths, **kw)
    assert stream["data"]["seq_len"] == 512 and not stream["data"]["whole_documents"]
    assert stream["train"]["steps"] == -(-2 * sum(lengths) // (2 * 512))
    whole = train_config(tmp_path, tmp_path, tmp_path / "run", lengths=lengths, whole_records=True, **kw)
    assert whole["data"]["seq_len"] == 640 and whole["data"]["whole_documents"]
    # records of 330 tokens: two never share a row of 512, so 2 epochs of 24 rows take 24 steps of 2 rows (a stream
    # of rows would take ceil(2 * 24 * 330 / 1024) = 16)
    one_a_row = train_config(tmp_path, tmp_path, tmp_path / "run", lengths=[330] * 24, whole_records=True, **kw)
    assert one_a_row["data"]["seq_len"] == 512 and one_a_row["train"]["steps"] == 24


@pytest.mark.parametrize("dtype,autocast", [("float32", "fp32"), ("bfloat16", "bf16")])
def test_the_head_trains_in_the_dtype_distillation_ran_in(planted, tmp_path, dtype, autocast):
    from mtpkit.train.config import load_config

    small = {**SMALL, "dtype": dtype, "max_new_tokens": 8, "ks": (1,), "eval_tokens": 8}
    refresh(planted / "finetuned", planted / "prompts.txt", tmp_path / "out", head_from=planted / "base", epochs=1,
            **small)
    assert load_config(tmp_path / "out" / "train" / "config.toml").train.autocast == autocast


def test_draft_vocab_trains_and_drafts_over_the_most_frequent_distilled_ids(planted, tmp_path):
    small = {**SMALL, "max_new_tokens": 8, "ks": (1,), "eval_tokens": 8}
    out = tmp_path / "out"
    refresh(planted / "finetuned", planted / "prompts.txt", out, head_from=planted / "base", epochs=1,
            draft_vocab=12, **small)
    model = mtpkit.load_model(out / "hf").eval()
    records = [json.loads(line) for line in (out / "distill.jsonl").read_text().splitlines()]
    counts = Counter(t for r in records for t, m in zip(r["input_ids"], r["loss_mask"]) if m)  # the completions
    most = sorted(counts, key=lambda t: (-counts[t], t))[:12]  # ties to the lower id
    assert model.drafter.draft_vocab.tolist() == sorted(most)
    rows = [[5, 17, 33, 8], [9, 2]]
    plain = mtpkit.generate(model, rows, max_new_tokens=16).tokens
    assert mtpkit.generate(model, rows, max_new_tokens=16, draft_tokens=2).tokens == plain
    with pytest.raises(ValueError, match="--draft-vocab 100000 must lie in 0..320"):
        refresh(planted / "finetuned", planted / "prompts.txt", tmp_path / "big", head_from=planted / "base",
                draft_vocab=100_000, **small)
    assert not (tmp_path / "big" / "distill.jsonl").exists()
