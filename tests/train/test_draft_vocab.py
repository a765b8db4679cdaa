"""A draft vocabulary trained with mtp.draft_vocab travels with the head: run directory -> `mtpkit export
--mtp-only` -> head file -> load_mtp_head -> generate drafts over it by default ("full" overrides)."""

from __future__ import annotations

import importlib

import pytest
import torch
from safetensors.torch import load_file, save_file
from train_runs import TINY_LLAMA, tiny_raw_config

from mtpkit.checkpoint.hf import CheckpointError, build_model
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
    from mtpkit.train.draft_vocab import read_run_draft_vocab
    from mtpkit.train.trainer import train

    raw = tiny_raw_config(tmp_path, mtp={"depth": 2, "only": True, "draft_vocab": 64},
                          train={"steps": 1, "batch_size": 2, "micro_batch_size": 2})
    train(config_from_dict(raw))
    vocab = read_run_draft_vocab(tmp_path / "run")
    assert vocab is not None and len(vocab) == 64 and torch.equal(vocab, vocab.sort().values)
    head = export(tmp_path / "run", tmp_path / "head.safetensors", mtp_only=True)
    assert torch.equal(load_file(str(head))[DRAFT_VOCAB], vocab)
