"""Batches as TRL's collators build them: padded, and padding-free (position_ids restarts, cu_seq_lens, seq_idx)."""

import pytest
import torch
from tiny_models import random_mtp_tensors, save_hf

import mtpkit
from mtpkit.hf import with_mtp
from mtpkit.hf.batch import segment_ids
from mtpkit.models.presets import tiny_hf_model
from mtpkit.train.config import MTPSection
from mtpkit.train.loss import compute_loss, shift_labels

trl = pytest.importorskip("trl")
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: E402

DOCS = [list(range(10, 22)), list(range(50, 59)), list(range(100, 107))]  # 12, 9 and 7 tokens


def test_segment_ids():
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    assert segment_ids(mask, None).tolist() == [[1, 1, 1, 0], [0, 1, 1, 1]]
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert segment_ids(None, pos).tolist() == [[1, 1, 1, 2, 2, 3]]
    assert segment_ids(torch.ones(1, 3, dtype=torch.long), torch.arange(3)[None]) is None  # one document per row


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    ref = tiny_hf_model("llama")
    path = tmp_path_factory.mktemp("llama")
    save_hf(ref, path, mtp_tensors=random_mtp_tensors(ref, depth=2))
    return with_mtp(ref, head=path, mtp_lambda=0.3), mtpkit.load_model(path)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding_free"])
def test_trl_collator_batch_matches_mtpkit(pair, padding_free):
    """The wrapper takes TRL's collated batch as it is (the trunk gets cu_seq_lens / seq_idx) and scores it as
    mtpkit scores the same documents: padding and packed boundaries masked alike."""
    wrapped, own = pair
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=padding_free)(
        [{"input_ids": d} for d in DOCS])
    assert ("position_ids" in batch) == padding_free
    with torch.no_grad():
        out = wrapped(**batch)
        seg = segment_ids(batch.get("attention_mask"), batch.get("position_ids"))
        mine = {"input_ids": batch["input_ids"], "labels": shift_labels(batch["labels"], seg), "segment_ids": seg}
        theirs = compute_loss(own, mine, MTPSection(depth=2, mtp_lambda=0.3))
    assert out.head_count.tolist() == theirs.counts == [25, 22, 19]  # no target crosses into padding or a document
    assert abs(out.loss.item() - theirs.total.item()) <= 1e-5
