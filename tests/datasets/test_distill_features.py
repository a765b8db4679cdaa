"""Features kept while distilling (`mtpkit distill --features`): generate's on_hidden sees the trunk output of every
token a forward reads, the assembled directory equals what `mtpkit features` builds from the same records (bf16
rounding apart; the never-read last position of a record is zero), a kill between a shard and its records loses
nothing, and training does not read the last positions."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from train_runs import TINY_LLAMA, make_tokenizer

import mtpkit
from mtpkit.checkpoint.hf import build_model, load_model, save_model
from mtpkit.data.features import FeatureStore, model_identity
from mtpkit.datasets.distill import distill
from mtpkit.datasets.distill_features import HiddenShards
from mtpkit.datasets.distill_prompts import build_prompts
from mtpkit.datasets.features import build_features
from mtpkit.tokenizer import encode_prompt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    """A tiny Llama saved with a ChatML tokenizer, and eight finished prompts of several kinds."""
    root = tmp_path_factory.mktemp("distill_features")
    torch.manual_seed(0)
    tok = make_tokenizer(root)
    save_model(build_model(TINY_LLAMA), root / "model", tok)
    prompts = [p for p in build_prompts(80, seed=3) if "prompt" in p][:8]
    return root / "model", tok, prompts


def _model(model_dir):
    return load_model(model_dir, mtp=False).eval()


def test_on_hidden_sees_every_position_a_forward_reads(tiny):
    model_dir, tok, prompts = tiny
    model = _model(model_dir)
    rows = [encode_prompt(tok, p["prompt"], p["chat"]) for p in prompts[:4]]
    assert len(set(map(len, rows))) > 1  # ragged prompts: several prefill runs
    sample = dict(max_new_tokens=6, temperature=1.0, seed=0)  # a random tiny model repeats one token greedily
    plain = mtpkit.generate(model, rows, **sample).tokens
    # an EOS that some row first emits after a few tokens: it stops there, mid-batch (others may stop too)
    r, at, eos = next((r, toks.index(t), t) for r, toks in enumerate(plain) for t in toks if toks.index(t) >= 1)
    seen = [[] for _ in rows]

    def on_hidden(idx, hidden):
        for i, r in enumerate(idx):
            seen[r].append(hidden[i].clone())

    out = mtpkit.generate(model, rows, eos_token_id=eos, on_hidden=on_hidden, **sample).tokens
    assert len(out[r]) == at + 1 < 6 and out[r][-1] == eos
    for r, (prompt, new) in enumerate(zip(rows, out)):
        got = torch.cat(seen[r])
        with torch.no_grad():
            want = model(torch.tensor([prompt + new[:-1]]), return_logits=False).hidden[0]
        assert got.shape == want.shape  # the prompt and every new token but the last
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="plain decoding"):
        mtpkit.generate(model, rows, max_new_tokens=2, draft_lookup=2, on_hidden=on_hidden)


def _distill(model_dir, tok, prompts, out, **kw):
    model = _model(model_dir)
    shards = HiddenShards(out)
    info = distill(model, tok, prompts, out, max_new_tokens=12, batch_size=3, shards=shards, topk=4, **kw)
    return model, shards, info


def _assemble(model, tok, shards, records, out):
    return shards.assemble(records, tok, model_identity(model), model.config.vocab_size, out, topk=4,
                           hidden_dtype="bfloat16", compute="float32")


def test_distilled_features_equal_a_features_pass_over_the_same_records(tiny, tmp_path):
    model_dir, tok, prompts = tiny
    model, shards, info = _distill(model_dir, tok, prompts, tmp_path / "d.jsonl")
    assert info["done"] == 8 and len(shards.paths()) == 3
    assert _assemble(model, tok, shards, tmp_path / "d.jsonl", tmp_path / "fused") == 8
    build_features(model, tok, tmp_path / "d.jsonl", tmp_path / "pass", topk=4, compute="float32", progress=False)
    fused, ref = FeatureStore(tmp_path / "fused"), FeatureStore(tmp_path / "pass")
    writer = {"writer": None}  # who wrote each apart: same records, trunk, dtypes, so interchangeable for training
    assert dict(fused.meta, **writer) == dict(ref.meta, **writer)
    for name in ("input_ids", "loss_mask", "offsets"):
        assert np.array_equal(getattr(fused, name), getattr(ref, name))
    last = fused.offsets[1:] - 1
    body = np.setdiff1d(np.arange(fused.meta["tokens"]), last)
    a, b = fused.gather(body), ref.gather(body)
    torch.testing.assert_close(a["hidden"].float(), b["hidden"].float(), rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(a["topk_logprobs"], b["topk_logprobs"], rtol=0, atol=1e-4)
    assert (a["topk_ids"] == b["topk_ids"]).float().mean() > 0.95  # near-ties of a random tiny model may swap
    assert not fused.gather(last)["hidden"].float().any()


def test_a_kill_between_a_shard_and_its_records_loses_nothing(tiny, tmp_path):
    model_dir, tok, prompts = tiny
    model, shards, _ = _distill(model_dir, tok, prompts, tmp_path / "clean.jsonl")
    _assemble(model, tok, shards, tmp_path / "clean.jsonl", tmp_path / "clean")
    out = tmp_path / "d.jsonl"
    shutil.copytree(shards.root, tmp_path / "d.jsonl.hidden")
    lines = (tmp_path / "clean.jsonl").read_text().splitlines()
    out.write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])  # the later batches' records lost, a torn line
    model, shards, info = _distill(model_dir, tok, prompts, out)
    assert info["done"] == 8 and len(shards.paths()) == 5  # two batches decoded again into new shards
    _assemble(model, tok, shards, out, tmp_path / "resumed")
    clean, resumed = FeatureStore(tmp_path / "clean"), FeatureStore(tmp_path / "resumed")
    by_index = {json.loads(line)["index"]: r for r, line in enumerate(out.read_text().splitlines())}
    for r, line in enumerate(lines):
        s = by_index[json.loads(line)["index"]]
        x = clean.gather(np.arange(clean.offsets[r], clean.offsets[r + 1]))
        y = resumed.gather(np.arange(resumed.offsets[s], resumed.offsets[s + 1]))
        assert torch.equal(x["input_ids"], y["input_ids"])
        torch.testing.assert_close(x["hidden"].float(), y["hidden"].float(), rtol=2**-7, atol=1e-5)


def test_records_without_shards_and_a_short_topk_are_refused(tiny, tmp_path):
    model_dir, tok, prompts = tiny
    model = _model(model_dir)
    distill(model, tok, prompts[:2], tmp_path / "d.jsonl", max_new_tokens=4, batch_size=2)
    with pytest.raises(ValueError, match="distilled without --features"):
        _assemble(model, tok, HiddenShards(tmp_path / "d.jsonl"), tmp_path / "d.jsonl", tmp_path / "f")
    shards = HiddenShards(tmp_path / "e.jsonl")
    distill(model, tok, prompts[:2], tmp_path / "e.jsonl", max_new_tokens=4, batch_size=2, shards=shards, topk=2)
    with pytest.raises(ValueError, match="fewer than the top-4"):
        _assemble(model, tok, shards, tmp_path / "e.jsonl", tmp_path / "f")


def test_a_damaged_shard_is_named_in_one_line(tiny, tmp_path):
    """Two runs on one --out once left a shard with a bad checksum: every later run, a BadZipFile traceback."""
    from mtpkit.data.reading import DataError

    model_dir, tok, prompts = tiny
    model, shards, _ = _distill(model_dir, tok, prompts[:3], tmp_path / "d.jsonl")
    shards.paths()[0].write_bytes(b"PK\x03\x04 a torn zip")
    with pytest.raises(DataError, match=r"hidden-state shard .*000000\.npz is damaged \(BadZipFile") as e:
        _assemble(model, tok, shards, tmp_path / "d.jsonl", tmp_path / "f")
    assert "\n" not in str(e.value)


def test_training_never_reads_a_records_last_position(tiny, tmp_path):
    from test_features import _raw, _steps

    model_dir, tok, prompts = tiny
    model, _, _ = _distill(model_dir, tok, prompts, tmp_path / "d.jsonl")
    build_features(model, tok, tmp_path / "d.jsonl", tmp_path / "f", compute="float32", progress=False)
    runs = []
    for zero_last in (False, True):
        if zero_last:
            store = FeatureStore(tmp_path / "f")
            hidden = np.load(tmp_path / "f" / "hidden.npy", mmap_mode="r+")
            hidden[store.offsets[1:] - 1] = 0
            hidden.flush()
        raw = _raw(model_dir, tmp_path / f"run{zero_last}", mode="features", features=str(tmp_path / "f"))
        raw["data"].update(seq_len=48, val_docs=2)
        raw["train"].update(batch_size=2)
        runs.append(_steps(raw))
    (a, sa), (b, sb) = runs
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and a[-1]["val_tau_sim"] == b[-1]["val_tau_sim"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_distill_command_writes_features_and_stops_on_time(tiny, tmp_path, capsys):
    from mtpkit.cli import main

    model_dir, _, _ = tiny
    args = ["distill", "--model", str(model_dir), "--out", str(tmp_path / "d.jsonl"), "--num-prompts", "12",
            "--max-new-tokens", "4", "--batch-size", "4", "--no-literature", "--features", str(tmp_path / "f")]
    assert main([*args, "--max-minutes", "0"]) == 0  # no batch starts: nothing to assemble yet
    assert "0 of" in capsys.readouterr().out and not (tmp_path / "f" / "meta.json").exists()
    assert main(args) == 0
    out = capsys.readouterr().out
    done = len((tmp_path / "d.jsonl").read_text().splitlines())
    assert f"features of {done} records" in out and FeatureStore(tmp_path / "f").meta["records"] == done
    assert ", cpu) ->" in out or torch.cuda.is_available()  # auto: CUDA when one is visible
    assert main([*args[:-2], "--topk", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "give --features DIR as well" in err and len(err.splitlines()) == 1
    if not torch.cuda.is_available():
        assert main([*args, "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip()
        assert "no CUDA device" in err and "--device cpu" in err and len(err.splitlines()) == 1
