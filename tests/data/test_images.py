"""Image + text training data: placeholders expanded per merged patch with no loss on any vision token, whole-document
packing that keeps every image with its row, micro-batches that take their rows' images, and a short VL run that
trains (the tower included), exports and decodes an image prompt."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import mtpkit
from mtpkit.data.build import build_data
from mtpkit.data.images import batch_rows
from mtpkit.data.reading import DataError
from mtpkit.datasets.shapes import prepare_shapes
from mtpkit.models.multimodal import load_processor
from mtpkit.train.config import MTPSection, config_from_dict
from mtpkit.train.loss import IGNORE, compute_loss, shift_labels
from mtpkit.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL_TEXT = dict(hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, linear_num_key_heads=2,
                  linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = prepare_shapes(tmp_path_factory.mktemp("shapes"), n_train=48, n_val=8, seed=3)
    raw = json.loads((root / "model" / "config.json").read_text())
    raw["text_config"].update(SMALL_TEXT)
    raw["vision_config"].update(depth=1, out_hidden_size=32)
    return root, raw


def _raw(root, model_config, run_dir, **sections) -> dict:
    raw = {
        "model": {"config": model_config, "tokenizer": str(root / "model")},
        "mtp": {"depth": 2, "init": "random", "mtp_lambda": 0.3},
        "data": {"paths": [str(root / "train.jsonl")], "mode": "sft", "images": True, "seq_len": 160,
                 "val_docs": 4},
        "train": {"run_dir": str(run_dir), "steps": 3, "batch_size": 4, "eval_every": 3, "eval_rows": 2},
        "optim": {"lr": 3e-3},
        "log": {"progress": False},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


@pytest.fixture(scope="module")
def data(shapes):
    root, model_config = shapes
    cfg = config_from_dict(_raw(root, model_config, "unused"))
    processor = load_processor(root / "model")
    return build_data(cfg.data, processor.tokenizer, 2, processor), processor


def test_image_tokens_expand_per_patch_and_never_are_targets(data):
    packed, processor = data
    tok = processor.tokenizer
    pad, start, end = tok.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
    ids, mask = packed.docs[0]
    image = np.flatnonzero(ids == pad)
    assert len(image) == 16 and np.all(np.diff(image) == 1)  # 64 x 64 pixels, 8-pixel patches merged 2 x 2
    assert ids[image[0] - 1] == start and ids[image[-1] + 1] == end
    assert not mask[np.isin(ids, [pad, start, end])].any()
    trained = tok.decode(ids[mask])
    assert trained.startswith(tok.decode(ids[mask][:3])) and "describe" not in trained  # the assistant turn only
    batch = packed.rows(0, 4)
    labels = shift_labels(batch["input_ids"], batch["segment_ids"], batch["loss_mask"])
    targets_vision = torch.isin(batch["input_ids"][:, 1:], torch.tensor([pad, start, end]))
    assert (labels[:, :-1][targets_vision] == IGNORE).all()


def test_documents_are_packed_whole_with_their_images(data):
    packed, processor = data
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    batch = packed.rows(0, packed.rows_per_epoch)
    per_row = (batch["input_ids"] == pad).sum(1)
    images_per_row = torch.bincount(batch["image_rows"], minlength=len(per_row))
    assert torch.equal(per_row, images_per_row * 16)  # every row holds whole images and exactly their patches
    assert batch["pixel_values"].shape == (int(images_per_row.sum()) * 64, 384)
    assert int(images_per_row.sum()) == len(packed.docs)  # each training document once per epoch
    # the first document of row 0 carries the first image of the batch: the same patches the processor gives
    p = packed.epoch(0)
    first_doc = p.docs[0][0]
    assert torch.equal(batch["pixel_values"][:64], packed.vision[first_doc][0])


def test_micro_batches_take_their_rows_images(shapes, data):
    """Two micro-batches of 2 rows give the same loss and gradients as one batch of 4 (global normalisation)."""
    packed, _ = data
    root, model_config = shapes
    torch.manual_seed(0)
    model = mtpkit.build_model(json.loads(json.dumps(model_config)), vision=True)
    mtpkit.add_mtp(model, 1)
    batch = packed.rows(0, 4)
    batch["labels"] = shift_labels(batch["input_ids"], batch["segment_ids"], batch.pop("loss_mask"))
    cfg = MTPSection(mtp_lambda=0.3)

    def grads(micros):
        model.zero_grad()
        counts = [int((batch["labels"] != IGNORE).sum()), int((batch["labels"][:, 1:] != IGNORE).sum())]
        loss = sum(compute_loss(model, mb, cfg, token_counts=counts).total for mb in micros)
        loss.backward()
        return float(loss.detach()), model.visual.patch_embed.proj.weight.grad.clone()

    halves = [batch_rows(batch, i, i + 2) for i in (0, 2)]
    assert [h["image_grid_thw"].shape[0] for h in halves] == [int((batch["image_rows"] < 2).sum()),
                                                             int((batch["image_rows"] >= 2).sum())]
    whole = grads([batch_rows(batch, 0, 4)])
    split = grads(halves)
    assert abs(whole[0] - split[0]) <= 1e-5
    assert (whole[1] - split[1]).abs().max() <= 1e-6 and whole[1].abs().sum() > 0


def test_vl_run_trains_exports_and_decodes_an_image_prompt(shapes, tmp_path):
    root, model_config = shapes
    raw = _raw(root, model_config, tmp_path / "run", train={"micro_batch_size": 2})
    trainer = Trainer(config_from_dict(raw))
    tower = trainer.model.visual.patch_embed.proj.weight.detach().clone()
    summary = trainer.fit()
    trainer.close()
    assert summary["step"] == 3 and summary["status"] == "finished"
    assert np.isfinite(summary["last"]["val_main_loss"])
    assert not torch.equal(trainer.model.visual.patch_embed.proj.weight, tower)  # the tower trains

    from mtpkit.train.export import export

    out = export(tmp_path / "run", tmp_path / "hf")
    model = mtpkit.load_model(out, vision=True)
    processor = load_processor(out)
    from PIL import Image

    from mtpkit.models.multimodal import image_inputs

    image = Image.open(root / "images" / "00000.png")
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>describe the image ."}],
        tokenize=False, add_generation_prompt=True)
    inputs = image_inputs(model, processor, prompt, [image])
    plain = mtpkit.generate(model, [inputs], max_new_tokens=8)
    fast = mtpkit.generate(model, [inputs], max_new_tokens=8, draft_tokens=2)
    assert fast.tokens == plain.tokens and len(plain.tokens[0]) >= 1


def test_bad_image_data_is_a_clear_error(shapes, tmp_path):
    root, model_config = shapes
    bad = tmp_path / "bad.jsonl"
    rec = json.loads((root / "train.jsonl").read_text().splitlines()[0])
    rec["messages"][0]["content"][0]["image"] = "missing.png"
    bad.write_text(json.dumps(rec) + "\n")
    processor = load_processor(root / "model")
    cfg = config_from_dict(_raw(root, model_config, "unused", data={"paths": [str(bad)]}))
    with pytest.raises(DataError, match="missing.png does not exist"):
        build_data(cfg.data, processor.tokenizer, 2, processor)
    cfg = config_from_dict(_raw(root, model_config, "unused", data={"images": False}))
    with pytest.raises(DataError, match="set data.images = true"):
        build_data(cfg.data, processor.tokenizer, 2)
    cfg = config_from_dict(_raw(root, model_config, "unused", data={"seq_len": 40}))
    with pytest.raises(DataError, match="longer than data.seq_len = 40 .* raise data.seq_len"):
        build_data(cfg.data, processor.tokenizer, 2, processor)


def test_pretraining_records_with_images(shapes, tmp_path):
    """{"image", "text"} records: the image first, loss on the text (and EOS) only."""
    root, model_config = shapes
    rec = json.loads((root / "train.jsonl").read_text().splitlines()[0])
    image, caption = rec["messages"][0]["content"][0]["image"], rec["messages"][1]["content"]
    (tmp_path / "images").symlink_to(root / "images")
    (tmp_path / "p.jsonl").write_text(json.dumps({"image": image, "text": caption}) + "\n" +
                                      json.dumps({"image": [image, image], "text": caption}) + "\n")
    processor = load_processor(root / "model")
    cfg = config_from_dict(_raw(root, model_config, "unused", data={"paths": [str(tmp_path / "p.jsonl")],
                                                                     "mode": "pretrain", "val_docs": 0},
                                train={"eval_every": 0}))
    packed = build_data(cfg.data, processor.tokenizer, 2, processor)
    tok = processor.tokenizer
    (one, mask), (two, _) = packed.docs
    assert len(two) - len(one) == 18  # a second image: start, 16 placeholders, end
    assert tok.decode(one[mask]) == tok.decode(tok(caption)["input_ids"] + [tok.eos_token_id])
    assert [v[1].tolist() for v in packed.vision] == [[[1, 8, 8]], [[1, 8, 8], [1, 8, 8]]]


def test_mtp_only_on_images_trains_the_head_alone_with_the_same_loss(shapes, data):
    packed, _ = data
    _, model_config = shapes
    torch.manual_seed(0)
    model = mtpkit.add_mtp(mtpkit.build_model(json.loads(json.dumps(model_config)), vision=True), 1)
    batch = packed.rows(0, 2)
    batch["labels"] = shift_labels(batch["input_ids"], batch["segment_ids"], batch.pop("loss_mask"))
    mb = batch_rows(batch, 0, 2)
    full = compute_loss(model, mb, MTPSection(mtp_lambda=0.3))
    only = compute_loss(model, mb, MTPSection(mtp_lambda=0.3, only=True))
    assert abs(full.per_depth[0] - only.per_depth[0]) <= 1e-5
    model.zero_grad()
    only.total.backward()
    assert all((p.grad is not None) == n.startswith("mtp.") for n, p in model.named_parameters())
