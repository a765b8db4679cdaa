"""A draft vocabulary trained with mtp.draft_vocab travels with the head: run directory -> `mtpkit export` (a head
file, or draft_vocab.json beside an HF checkpoint) -> load_mtp_head / load_model / graft -> generate drafts over it by
default ("full" overrides)."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from train_runs import TINY_LLAMA, tiny_raw_config

from mtpkit.checkpoint.graft import graft
from mtpkit.checkpoint.hf import DRAFT_VOCAB_FILE, CheckpointError, build_model, load_model, save_model
from mtpkit.checkpoint.mtp_head import DRAFT_VOCAB, load_mtp_head, save_mtp_head
from mtpkit.models.mtp import add_mtp

gen = importlib.import_module("mtpkit.decode.generate")  # the module (the package exports its function by name)


def _model(seed=0):
    torch.manual_seed(seed)
    return add_mtp(build_model(TINY_LLAMA), 1).eval()


def test_head_file_round_trip_of_the_draft_vocabulary(tmp_path, monkeypatch):
    model = _model()
    vocab = torch.tensor([3, 7, 11, 200, 319])
    model.mtp.draft_vocab = vocab
    path = save_mtp_head(model, tmp_path / "head.safetensors", dtype=None)
    assert torch.equal(load_file(str(path))[DRAFT_VOCAB], vocab)
    other = _model(seed=1)
    load_mtp_head(other, path)
    assert torch.equal(other.mtp.draft_vocab, vocab)
    assert all(torch.equal(a, b) for a, b in zip(model.mtp.state_dict().values(), other.mtp.state_dict().values()))

    seen = []
    real = gen.draft_head.DraftHead

    def spy(model, params, vocab, *a):
        seen.append(vocab)
        return real(model, params, vocab, *a)

    monkeypatch.setattr(gen.draft_head, "DraftHead", spy)
    prompt = [[1, 2, 3, 4]]
    plain = gen.generate(other, prompt, max_new_tokens=8)
    spec = gen.generate(other, prompt, max_new_tokens=8, draft_tokens=2)
    full = gen.generate(other, prompt, max_new_tokens=8, draft_tokens=2, draft_vocab="full")
    assert torch.equal(seen[0], vocab) and seen[1] is None  # the head's own by default; "full" overrides
    assert spec.tokens == plain.tokens == full.tokens  # lossless either way

    save_mtp_head(_model(), tmp_path / "plain.safetensors", dtype=None)
    load_mtp_head(other, tmp_path / "plain.safetensors")  # a head without one: drafting over the full vocabulary
    assert other.mtp.draft_vocab is None

    bad = load_file(str(path))
    bad[DRAFT_VOCAB] = torch.tensor([3, 320])  # past the vocabulary
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CheckpointError, match="token ids in \\[0, 320\\)"):
        load_mtp_head(_model(), tmp_path / "bad.safetensors")


def test_a_run_with_draft_vocab_exports_it_in_the_head(tmp_path):
    from mtpkit.train.export import export
    from mtpkit.train.config import config_from_dict
    from mtpkit.checkpoint.hf import read_draft_vocab
    from mtpkit.train.trainer import train

    raw = tiny_raw_config(tmp_path, mtp={"depth": 2, "only": True, "draft_vocab": 64},
                          train={"steps": 1, "batch_size": 2, "micro_batch_size": 2})
    train(config_from_dict(raw))
    vocab = read_draft_vocab(tmp_path / "run", 320)
    assert vocab is not None and len(vocab) == 64 and torch.equal(vocab, vocab.sort().values)
    head = export(tmp_path / "run", tmp_path / "head.safetensors", mtp_only=True)
    assert torch.equal(load_file(str(head))[DRAFT_VOCAB], vocab)
    full = export(tmp_path / "run", tmp_path / "hf")  # an HF checkpoint keeps it beside the weights
    assert torch.equal(load_model(full).drafter.draft_vocab, vocab)

    # training on from that checkpoint: draft_vocab = 0 keeps the head's ids, N > 0 draws new ones
    for n, run in ((0, "again"), (32, "fewer")):
        raw = tiny_raw_config(tmp_path, model={"path": str(full), "config": None},
                              mtp={"depth": 2, "only": True, "init": "checkpoint", "draft_vocab": n},
                              train={"run_dir": str(tmp_path / run), "steps": 1, "batch_size": 2,
                                     "micro_batch_size": 2})
        train(config_from_dict(raw))
    assert torch.equal(read_draft_vocab(tmp_path / "again", 320), vocab)
    fewer = read_draft_vocab(tmp_path / "fewer", 320)
    assert len(fewer) == 32 and set(fewer.tolist()) <= set(vocab.tolist())


def test_an_hf_checkpoint_keeps_its_heads_draft_vocabulary(tmp_path):
    model = _model()
    model.mtp.draft_vocab = torch.tensor([3, 7, 11, 200, 319])
    save_model(model, tmp_path / "with")
    assert json.loads((tmp_path / "with" / DRAFT_VOCAB_FILE).read_text()) == [3, 7, 11, 200, 319]
    loaded = load_model(tmp_path / "with")
    assert torch.equal(loaded.mtp.draft_vocab, model.mtp.draft_vocab)
    assert load_model(tmp_path / "with", mtp=False).drafter is None
    model.mtp.draft_vocab = None
    save_model(model, tmp_path / "without")
    assert not (tmp_path / "without" / DRAFT_VOCAB_FILE).exists()
    assert load_model(tmp_path / "without").mtp.draft_vocab is None
    save_model(model, tmp_path / "with", overwrite=True)  # the old head's vocabulary goes with its weights
    assert load_model(tmp_path / "with").mtp.draft_vocab is None


@pytest.mark.parametrize("text", ["[3, 320]", "[]", "[3, 3]", "[1.5]", "{\"ids\": [3]}", "[3,", "[true]"])
def test_a_bad_draft_vocabulary_file_is_refused_in_one_line(tmp_path, text):
    save_model(_model(), tmp_path / "m")
    (tmp_path / "m" / DRAFT_VOCAB_FILE).write_text(text)
    with pytest.raises(CheckpointError, match=r"draft_vocab.json is not a list of distinct token ids in \[0, 320\)"):
        load_model(tmp_path / "m")


def test_graft_carries_a_head_files_draft_vocabulary_and_drops_the_fine_tunes_old_one(tmp_path):
    base = _model()
    base.mtp.draft_vocab = torch.tensor([5, 6, 7])
    save_mtp_head(base, tmp_path / "head.safetensors", dtype=None)
    finetuned = _model(seed=1)
    finetuned.mtp.draft_vocab = torch.tensor([1, 2])  # its own stale head's
    save_model(finetuned, tmp_path / "finetuned")
    graft(tmp_path / "head.safetensors", tmp_path / "finetuned", tmp_path / "out")
    out = load_model(tmp_path / "out")
    assert out.mtp.draft_vocab.tolist() == [5, 6, 7]
    assert all(torch.equal(a, b) for a, b in zip(out.mtp.state_dict().values(), base.mtp.state_dict().values()))
    base.mtp.draft_vocab = None  # a head without one: the fine-tune's old vocabulary must not come along
    save_mtp_head(base, tmp_path / "full.safetensors", dtype=None)
    graft(tmp_path / "full.safetensors", tmp_path / "finetuned", tmp_path / "out2")
    assert load_model(tmp_path / "out2").mtp.draft_vocab is None
    assert not (tmp_path / "out2" / DRAFT_VOCAB_FILE).exists()
    bad = load_file(str(tmp_path / "head.safetensors"))
    for ids in ([3, 320], [5, 5]):  # past the fine-tune's vocabulary, an id twice: refused before anything is written
        bad[DRAFT_VOCAB] = torch.tensor(ids)
        save_file(bad, str(tmp_path / "bad.safetensors"))
        with pytest.raises(CheckpointError, match="distinct token ids in \\[0, 320\\)"):
            graft(tmp_path / "bad.safetensors", tmp_path / "finetuned", tmp_path / "out3")
        assert not (tmp_path / "out3").exists()
