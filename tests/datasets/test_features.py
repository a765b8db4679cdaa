"""Offline trunk features (`mtpkit features`, data.mode = "features"): the stored hidden states and top-k equal a
plain per-record trunk forward, a killed build resumes, a mismatched model is refused in one line, and training
on features takes the same steps as MTP-only training with the trunk (fp32 storage: to rounding)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from train_runs import TINY_LLAMA, make_tokenizer

from mtpkit.checkpoint.hf import build_model, load_model, save_model
from mtpkit.data.features import FeatureStore, FeatureStores, bf16_to_numpy, numpy_to_bf16
from mtpkit.data.reading import DataError
from mtpkit.datasets import features as F
from mtpkit.datasets.features import build_features
from mtpkit.train.config import config_from_dict


def write_records(path: Path, n: int = 24, seed: int = 0, length: int = 0) -> Path:
    """Records as `mtpkit distill` writes them: prompt (loss_mask 0) + completion (loss_mask 1); random lengths
    unless `length` is given."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            n_tok = length or int(rng.integers(8, 70))
            prompt = int(rng.integers(2, n_tok - 4))
            ids = rng.integers(0, 320, n_tok).tolist()
            f.write(json.dumps({"index": i, "input_ids": ids, "loss_mask": [0] * prompt + [1] * (n_tok - prompt)}) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    """A tiny SmolLM2-shaped model (Llama, tied embeddings) saved with its tokenizer, distill-style records and
    the tokenizer."""
    root = tmp_path_factory.mktemp("features")
    torch.manual_seed(0)
    model = build_model(TINY_LLAMA)
    tok = make_tokenizer(root)
    save_model(model, root / "model", tok)
    return root / "model", write_records(root / "records.jsonl"), tok


def _trunk(model_dir):
    return load_model(model_dir, mtp=False).eval()


def test_stored_hidden_and_topk_equal_a_plain_forward(tiny, tmp_path):
    model_dir, records, tok = tiny
    model = _trunk(model_dir)
    build_features(model, tok, records, tmp_path / "f", topk=8, hidden_dtype="float32", compute="float32",
                   batch_tokens=150, row_tokens=90, progress=False)
    store = FeatureStore(tmp_path / "f")
    off = store.offsets
    assert store.meta["records"] == 24 and off[-1] == store.meta["tokens"] == len(store.input_ids)
    docs = [json.loads(line) for line in records.read_text().splitlines()]
    for r, rec in enumerate(docs):
        rows = np.arange(off[r], off[r + 1])
        got = store.gather(rows)
        assert got["input_ids"].tolist() == rec["input_ids"]
        assert store.loss_mask[rows].tolist() == [bool(x) for x in rec["loss_mask"]]
        with torch.no_grad():
            out = model(torch.tensor([rec["input_ids"]]))
        torch.testing.assert_close(got["hidden"], out.hidden[0], rtol=0, atol=1e-5)
        logprobs = out.logits[0].log_softmax(-1)
        # the top-k values, and the stored ids carry them (a random tiny model has near-ties: order may differ)
        torch.testing.assert_close(got["topk_logprobs"], logprobs.topk(8).values, rtol=0, atol=1e-5)
        torch.testing.assert_close(logprobs.gather(1, got["topk_ids"]), got["topk_logprobs"], rtol=0, atol=1e-5)


def test_bf16_storage_is_the_rounded_hidden_bit_for_bit():
    h = torch.randn(5, 7)
    bits = bf16_to_numpy(h.to(torch.bfloat16))
    assert bits.dtype == np.uint16
    assert torch.equal(numpy_to_bf16(bits), h.to(torch.bfloat16))


def test_a_killed_build_resumes_and_a_mismatch_is_refused(tiny, tmp_path, monkeypatch):
    model_dir, records, tok = tiny
    model = _trunk(model_dir)
    kw = dict(topk=4, hidden_dtype="bfloat16", compute="float32", batch_tokens=120, row_tokens=60, progress=False)
    build_features(model, tok, records, tmp_path / "full", **kw)

    real, calls = F._trunk_hidden, []

    def dies_on_third(*a):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(F, "_trunk_hidden", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        build_features(model, tok, records, tmp_path / "killed", **kw)
    done = json.loads((tmp_path / "killed" / "progress.json").read_text())["records_done"]
    assert 0 < done < 24
    with pytest.raises(ValueError, match="incomplete"):
        FeatureStore(tmp_path / "killed")
    monkeypatch.setattr(F, "_trunk_hidden", real)
    info = build_features(model, tok, records, tmp_path / "killed", **kw)
    assert info["tokens"] == FeatureStore(tmp_path / "full").offsets[-1] - FeatureStore(tmp_path / "full").offsets[done]
    full, resumed = FeatureStore(tmp_path / "full"), FeatureStore(tmp_path / "killed")
    rows = np.arange(resumed.meta["tokens"])
    a, b = full.gather(rows), resumed.gather(rows)
    torch.testing.assert_close(a["hidden"].float(), b["hidden"].float(), rtol=1e-2, atol=1e-2)  # bf16: repacked rows
    assert (a["topk_ids"] == b["topk_ids"]).float().mean() > 0.99

    with pytest.raises(ValueError, match="another run .*topk"):
        build_features(model, tok, records, tmp_path / "full", **dict(kw, topk=2))
    torch.manual_seed(1)
    other = build_model(TINY_LLAMA)
    with pytest.raises(ValueError, match="built from another model .*fingerprint"):
        full.check_model(other)
    full.check_model(model)


def test_a_resume_with_another_compute_dtype_another_writer_or_foreign_files_is_refused(tiny, tmp_path):
    """A features build resumed in bf16 after an fp32 start mixed both in one directory (rc 0)."""
    from mtpkit.locking import OutputBusy

    model_dir, records, tok = tiny
    model = _trunk(model_dir)
    kw = dict(compute="float32", batch_tokens=120, row_tokens=60, progress=False)
    build_features(model, tok, records, tmp_path / "f", **kw)
    with pytest.raises(ValueError, match=r"holds features of another run \(different compute\)"):
        build_features(model, tok, records, tmp_path / "f", **dict(kw, compute="bfloat16"))
    with F.writer_lock(tmp_path / "f"), pytest.raises(OutputBusy, match=r"features directory .* is being written"):
        build_features(model, tok, records, tmp_path / "f", **kw)
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match=r"holds files a features directory does not \(notes\.txt\)"):
        build_features(model, tok, records, tmp_path / "g", **kw)
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == ["notes.txt"]
    assert build_features(model, tok, records, tmp_path / "f", **kw)["tokens"] == 0  # power: the same run resumes


# ------------------------------------------------------------------------------------------- training on features
def _raw(model_dir, run_dir, **data):
    return {
        "model": {"path": str(model_dir)},
        "mtp": {"depth": 3, "layers": 1, "weights": [0.51, 0.31, 0.18], "init": "random", "only": True},
        "data": {"seq_len": 64, "val_docs": 4, **data},
        "train": {"run_dir": str(run_dir), "steps": 3, "batch_size": 4, "threads": 1, "eval_every": 3,
                  "eval_rows": 2},
        "optim": {"lr": 3e-3, "weight_decay": 0.0},
        "checkpoint": {"save_final": False},
        "log": {"progress": False},
    }


def _steps(raw) -> tuple[list[dict], dict]:
    from mtpkit.train.trainer import Trainer

    trainer = Trainer(config_from_dict(raw))
    recs = []
    while trainer.step < 3:
        recs.append(trainer.train_step())
    recs[-1].update(trainer.evaluate())
    state = {k: v.detach().clone() for k, v in trainer.model.mtp.state_dict().items()}
    trainer.close()
    return recs, state


def test_training_on_features_takes_the_same_steps_as_with_the_trunk(tiny, tmp_path):
    model_dir, _, tok = tiny
    # records of 16 tokens fill rows of 64 exactly: the online trunk then sees each whole record too (a record cut
    # by a row boundary restarts its context online, while its stored features keep the whole record's)
    records = write_records(tmp_path / "records.jsonl", length=16)
    online, online_state = _steps(_raw(model_dir, tmp_path / "online", paths=[str(records)], mode="tokens"))
    build_features(_trunk(model_dir), tok, records, tmp_path / "f32", hidden_dtype="float32", compute="float32",
                   progress=False)
    offline, offline_state = _steps(_raw(model_dir, tmp_path / "offline", mode="features",
                                         features=str(tmp_path / "f32")))
    for a, b in zip(online, offline):
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], rel=1e-5)
        assert b["mtp_acc"] == a["mtp_acc"] or b["mtp_acc"] == pytest.approx(a["mtp_acc"], abs=0.02)
        assert b["main_loss"] is None  # a constant of the stored data: not computed in training steps
    assert offline[-1]["val_main_loss"] == pytest.approx(online[-1]["val_main_loss"], rel=1e-5)
    assert offline[-1]["val_tau_sim"] == pytest.approx(online[-1]["val_tau_sim"], abs=0.02)
    acc = offline[-1]["val_mtp_acc"]  # tau_sim: 1 + a1 + a1 a2 + a1 a2 a3
    assert offline[-1]["val_tau_sim"] == pytest.approx(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2])
    for k in online_state:
        torch.testing.assert_close(offline_state[k], online_state[k], rtol=1e-4, atol=1e-5)

    # power check: hidden states one position off (h_{t+1} stored at t) take visibly different steps
    shifted = tmp_path / "shifted"
    shutil.copytree(tmp_path / "f32", shifted)
    h = np.load(shifted / "hidden.npy", mmap_mode="r+")
    h[:-1] = h[1:].copy()
    h.flush()
    wrong, _ = _steps(_raw(model_dir, tmp_path / "wrong", mode="features", features=str(shifted)))
    assert abs(wrong[0]["mtp_loss"][0] - online[0]["mtp_loss"][0]) > 1e-3


def test_train_on_inputs_makes_every_stored_token_a_target(tiny, tmp_path):
    from mtpkit.data.build import build_data
    from mtpkit.train.config import DataSection

    model_dir, records, tok = tiny
    build_features(_trunk(model_dir), tok, records, tmp_path / "f", progress=False)
    ids = [json.loads(line)["input_ids"] for line in records.read_text().splitlines()]
    for every in (False, True):
        cfg = DataSection(mode="features", features=str(tmp_path / "f"), seq_len=80, whole_documents=True,
                          train_on_inputs=every)
        data = build_data(cfg, tok, mtp_depth=3)
        targets = int(data.rows(0, data.rows_per_epoch)["loss_mask"].sum())  # each record once, whole
        if every:  # the prompts' tokens are targets too
            assert targets == sum(map(len, ids)) and sorted(data.target_ids().tolist()) == sorted(sum(ids, []))
        else:
            assert targets == len(data.target_ids()) < sum(map(len, ids))


def test_greedy_targets_are_the_trunks_top1_before_each_target_and_choose_the_draft_vocabulary(tiny, tmp_path):
    """With mtp.head_loss = "greedy" the head learns the trunk's top-1 at each target, so mtp.draft_vocab counts
    those ids (not the data's tokens): checked against the trunk's own argmax, over two directories, with the
    prompts as targets too, and through a training run's exported vocabulary."""
    from mtpkit.checkpoint.hf import read_draft_vocab
    from mtpkit.data.build import build_data
    from mtpkit.train.config import DataSection
    from mtpkit.train.draft_vocab import draft_vocabulary
    from mtpkit.train.trainer import train

    model_dir, records, tok = tiny
    lines = records.read_text().splitlines(keepends=True)
    (tmp_path / "a.jsonl").write_text("".join(lines[:10]))
    (tmp_path / "b.jsonl").write_text("".join(lines[10:]))
    trunk = _trunk(model_dir)
    for name in ("a", "b"):
        build_features(trunk, tok, tmp_path / f"{name}.jsonl", tmp_path / name, topk=2, hidden_dtype="float32",
                       compute="float32", progress=False)
    # per target, in record order: the trunk's logits at the row before it (a random tiny model has near-ties, so
    # the stored top-1 is checked to score the maximum, not to equal this forward's argmax)
    logits, tokens = {False: [], True: []}, {False: [], True: []}
    for line in lines:
        rec = json.loads(line)
        ids, target = torch.tensor(rec["input_ids"]), torch.tensor(rec["loss_mask"][1:], dtype=torch.bool)
        with torch.no_grad():
            before = trunk(ids[None]).logits[0, :-1]
        logits[True].append(before)  # every token after the first
        tokens[True].append(ids[1:])
        logits[False].append(before[target])
        tokens[False].append(ids[1:][target])
    parts = [str(tmp_path / "a"), str(tmp_path / "b")]
    for every in (False, True):
        data = build_data(DataSection(mode="features", features=parts, seq_len=80, whole_documents=True,
                                      train_on_inputs=every), tok, mtp_depth=3)
        got, want = torch.from_numpy(data.greedy_target_ids()), torch.cat(logits[every])
        assert len(got) == len(want)
        torch.testing.assert_close(want.gather(1, got[:, None])[:, 0], want.max(-1).values, rtol=0, atol=1e-5)
        # power: the data's own tokens (what the hard loss learns) are mostly not the trunk's choices
        data_tokens = torch.cat(tokens[every])
        assert (want.gather(1, data_tokens[:, None])[:, 0] < want.max(-1).values - 1e-3).float().mean() > 0.5

    raw = _raw(model_dir, tmp_path / "run", mode="features", features=parts, seq_len=80, whole_documents=True)
    raw["mtp"].update(head_loss="greedy", draft_vocab=16)
    raw["train"].update(steps=1, eval_every=0)
    raw["data"]["val_docs"] = 0
    train(config_from_dict(raw))
    greedy = build_data(DataSection(mode="features", features=parts, seq_len=80, whole_documents=True), tok,
                        mtp_depth=3).greedy_target_ids()
    assert read_draft_vocab(tmp_path / "run", 320).tolist() == draft_vocabulary(greedy, 16, 320).tolist()
    assert draft_vocabulary(greedy, 16, 320).tolist() != draft_vocabulary(data.target_ids(), 16, 320).tolist()

    build_features(trunk, tok, tmp_path / "a.jsonl", tmp_path / "plain", progress=False)
    data = build_data(DataSection(mode="features", features=str(tmp_path / "plain"), seq_len=80), tok, mtp_depth=3)
    with pytest.raises(DataError, match="holds no top-k.*--topk K"):
        data.greedy_target_ids()


def test_records_packed_whole_train_on_features_as_with_the_trunk(tiny, tmp_path):
    """data.whole_documents: records of 8-69 tokens never straddle a row, so the stored features (computed over
    whole records) are what the online trunk computes in training, and the two take the same steps."""
    model_dir, records, tok = tiny
    build_features(_trunk(model_dir), tok, records, tmp_path / "f32", hidden_dtype="float32", compute="float32",
                   progress=False)
    kw = dict(seq_len=80, whole_documents=True)
    online, online_state = _steps(_raw(model_dir, tmp_path / "online", paths=[str(records)], mode="tokens", **kw))
    offline, offline_state = _steps(_raw(model_dir, tmp_path / "offline", mode="features",
                                         features=str(tmp_path / "f32"), **kw))
    for a, b in zip(online, offline):
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], rel=1e-5)
    for k in online_state:
        torch.testing.assert_close(offline_state[k], online_state[k], rtol=1e-4, atol=1e-5)
    # power check: packed as a stream, records are cut and the online trunk restarts their context at a row start
    cut, _ = _steps(_raw(model_dir, tmp_path / "cut", paths=[str(records)], mode="tokens", seq_len=80))
    cut_offline, _ = _steps(_raw(model_dir, tmp_path / "cut_off", mode="features", features=str(tmp_path / "f32"),
                                 seq_len=80))
    assert cut[0]["mtp_loss"] != pytest.approx(cut_offline[0]["mtp_loss"], rel=1e-4)


def test_features_of_several_directories_train_as_one_directory(tiny, tmp_path):
    """data.features = [A, B] (e.g. the features of two distillations) takes the same steps as one directory built
    over A's and B's records together; directories of another kind are refused in one line."""
    model_dir, records, tok = tiny
    lines = records.read_text().splitlines(keepends=True)
    (tmp_path / "a.jsonl").write_text("".join(lines[:10]))
    (tmp_path / "b.jsonl").write_text("".join(lines[10:]))
    trunk, kw = _trunk(model_dir), dict(hidden_dtype="float32", compute="float32", progress=False)
    for name, recs in (("all", records), ("a", tmp_path / "a.jsonl"), ("b", tmp_path / "b.jsonl")):
        build_features(trunk, tok, recs, tmp_path / name, **kw)
    one, one_state = _steps(_raw(model_dir, tmp_path / "one", mode="features", features=str(tmp_path / "all")))
    parts = [str(tmp_path / "a"), str(tmp_path / "b")]
    two, two_state = _steps(_raw(model_dir, tmp_path / "two", mode="features", features=parts))
    for x, y in zip(one, two):
        assert y["mtp_loss"] == pytest.approx(x["mtp_loss"], rel=1e-6) and y["mtp_acc"] == x["mtp_acc"]
    assert two[-1]["val_tau_sim"] == pytest.approx(one[-1]["val_tau_sim"], rel=1e-6)
    for k in one_state:
        torch.testing.assert_close(two_state[k], one_state[k], rtol=1e-4, atol=1e-6)  # trunk batches differ
    # power check: the same records with the parts swapped are packed in another order and take other steps
    swapped, _ = _steps(_raw(model_dir, tmp_path / "swapped", mode="features", features=parts[::-1]))
    assert swapped[0]["mtp_loss"] != pytest.approx(one[0]["mtp_loss"], rel=1e-6)
    # a directory named twice is read twice an epoch: its records again, the same stored rows
    twice = FeatureStores([tmp_path / "a", tmp_path / "b", tmp_path / "b"])
    b_alone = FeatureStores(tmp_path / "b")
    n_a, b_docs = len(FeatureStores(tmp_path / "a").documents()), b_alone.documents()
    docs = twice.documents()
    assert len(docs) == n_a + 2 * len(b_docs)
    first, second = docs[n_a : n_a + len(b_docs)], docs[n_a + len(b_docs) :]
    for (rows, _), (again, _), (own, _) in zip(first, second, b_docs, strict=True):
        assert not np.array_equal(rows, again)
        for got in (twice.gather(rows), twice.gather(again)):
            for key, want in b_alone.gather(own).items():
                assert torch.equal(got[key], want)

    build_features(trunk, tok, tmp_path / "b.jsonl", tmp_path / "b_topk", topk=4, **kw)
    with pytest.raises(DataError, match="another top-k .*features of one kind"):
        FeatureStores([tmp_path / "a", tmp_path / "b_topk"])
    with pytest.raises(DataError, match="empty list"):
        FeatureStores([])


def test_features_mode_needs_mtp_only_and_the_trunk_it_came_from(tiny, tmp_path):
    from mtpkit.train.config import ConfigKeyError
    from mtpkit.train.trainer import Trainer

    model_dir, records, tok = tiny
    raw = _raw(model_dir, tmp_path / "run", mode="features", features=str(tmp_path / "f"))
    raw["mtp"]["only"] = False
    with pytest.raises(ConfigKeyError, match="mtp.only = true"):
        config_from_dict(raw)
    with pytest.raises(ConfigKeyError, match="go together"):
        config_from_dict(_raw(model_dir, tmp_path / "run", mode="features"))
    for loss in ("soft", "greedy"):  # the trunk's top-k comes from features only
        raw = _raw(model_dir, tmp_path / "run", mode="tokens")
        raw["mtp"]["head_loss"] = loss
        with pytest.raises(ConfigKeyError, match=f"'{loss}' needs the trunk's stored top-k"):
            config_from_dict(raw)
    torch.manual_seed(1)
    build_features(build_model(TINY_LLAMA), tok, records, tmp_path / "f", progress=False)
    with pytest.raises(ValueError, match="built from another model"):
        Trainer(config_from_dict(_raw(model_dir, tmp_path / "run", mode="features", features=str(tmp_path / "f"))))


def test_features_command_builds_resumes_and_reports_bad_input_in_one_line(tiny, tmp_path, capsys):
    from mtpkit.cli import main

    model_dir, records, _ = tiny
    args = ["features", "--model", str(model_dir), "--records", str(records), "--out", str(tmp_path / "f"),
            "--topk", "4"]
    assert main(args) == 0
    assert "24 records" in capsys.readouterr().out and FeatureStore(tmp_path / "f").topk == 4
    assert main(args) == 0  # complete: nothing left to do
    assert "0 tokens stored by this run" in capsys.readouterr().out
    assert main([*args[:4], str(tmp_path / "missing.jsonl"), *args[5:]]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing.jsonl does not exist" in err and len(err.splitlines()) == 1
    long = write_records(tmp_path / "long.jsonl", n=2, length=600)  # the tiny model's context: 512
    assert main([*args[:4], str(long), "--out", str(tmp_path / "f_long")]) == 2
    err = capsys.readouterr().err.strip()
    assert "600 tokens, beyond the model's context of 512" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "f_long").exists()
    if not torch.cuda.is_available():
        assert main([*args, "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip()
        assert "--device cuda: no CUDA device is visible; use --device cpu" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("select", [("--max-record-tokens", "40"), ("--first-record", "9"),
                                    ("--first-record", "9", "--max-record-tokens", "40")])
def test_selected_records_are_the_directory_their_records_alone_build(tiny, tmp_path, capsys, select):
    """`mtpkit features --from-features DIR` with --max-record-tokens N (records shorter than N) and/or
    --first-record M (records from index M on) copies the same arrays, offsets and records checksum as
    `mtpkit features` over those records alone; the pair reads as one source with them twice; a rerun is a no-op;
    bad selections fail in one line."""
    from mtpkit.cli import main

    model_dir, records, tok = tiny
    kw = dict(topk=4, hidden_dtype="float32", compute="float32", progress=False)
    build_features(_trunk(model_dir), tok, records, tmp_path / "all", **kw)
    lines = records.read_text().splitlines(keepends=True)
    opts = dict(zip(select[::2], map(int, select[1::2])))
    first, most = opts.get("--first-record", 0), opts.get("--max-record-tokens", 10**9)
    chosen = [line for line in lines[first:] if len(json.loads(line)["input_ids"]) < most]
    assert 0 < len(chosen) < len(lines)
    (tmp_path / "chosen.jsonl").write_text("".join(chosen))
    build_features(_trunk(model_dir), tok, tmp_path / "chosen.jsonl", tmp_path / "built", **kw)

    args = ["features", "--from-features", str(tmp_path / "all"), *select, "--out"]
    assert main([*args, str(tmp_path / "sel")]) == 0
    assert f"{len(chosen)} records" in capsys.readouterr().out
    sel, built = FeatureStore(tmp_path / "sel"), FeatureStore(tmp_path / "built")
    for key in ("records", "tokens", "records_sha", "model", "topk", "hidden_dtype"):
        assert sel.meta[key] == built.meta[key]
    assert (sel.offsets == built.offsets).all() and (sel.input_ids == built.input_ids).all()
    assert (sel.loss_mask == built.loss_mask).all()
    rows = np.arange(len(sel.input_ids))
    got, want = sel.gather(rows), built.gather(rows)
    torch.testing.assert_close(got["hidden"], want["hidden"], rtol=0, atol=1e-5)  # other row packing: rounding
    torch.testing.assert_close(got["topk_logprobs"], want["topk_logprobs"], rtol=0, atol=1e-5)

    both = FeatureStores([tmp_path / "all", tmp_path / "sel"])
    assert len(both.documents()) == len(lines) + len(chosen)
    assert main([*args, str(tmp_path / "sel")]) == 0  # finished: nothing copied again
    assert "0 records" in capsys.readouterr().out

    for bad, why in ((["--max-record-tokens", "5"], "no record from 0 on shorter than 5 tokens"),
                     (["--max-record-tokens", "0"], "no record from 0 on shorter than 0 tokens"),
                     (["--first-record", str(len(lines))], f"outside {tmp_path / 'all'}'s {len(lines)} records"),
                     (["--first-record", "1", "--max-record-tokens", "60"], "another selection"),
                     ([], "goes with")):
        argv = ["features", "--from-features", str(tmp_path / "all"), *bad, "--out", str(tmp_path / "sel")]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert why in err and len(err.splitlines()) == 1
    assert main(["features", "--out", str(tmp_path / "x")]) == 2
    assert "one of the two" in capsys.readouterr().err
