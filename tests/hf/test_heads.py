"""Where an MTPModel's head comes from (checkpoint, head file, new) and what its save writes, per family: names
and expert layout as the trunk's checkpoint stores them, loaded back by mtpkit byte for byte."""

import copy
import json

import pytest
import torch
import transformers as tf
from tiny_models import random_mtp_tensors, save_hf

import mtpkit
from mtpkit.checkpoint.hf import CheckpointError
from mtpkit.checkpoint.mtp_head import save_mtp_head
from mtpkit.hf import MTPTrainer, with_mtp
from mtpkit.models.presets import tiny_hf_model


@pytest.mark.parametrize("family,per_expert", [("qwen3_5", False), ("qwen3_5_moe", False), ("qwen3_5_moe", True),
                                               ("qwen3_vl", False), ("qwen3_next", True)])
def test_checkpoint_head_round_trip(tmp_path, family, per_expert):
    """The checkpoint's own mtp.* (fused or one tensor per expert, as released) load exactly; the save writes them
    in the layout transformers writes the trunk's experts in, and mtpkit loads the directory back."""
    ref = tiny_hf_model(family)
    mtp = random_mtp_tensors(ref)
    save_hf(ref, tmp_path / "base", mtp_tensors=mtp, per_expert=per_expert)
    model = with_mtp(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "base") if family != "qwen3_vl" else ref,
                     head=tmp_path / "base")
    own = mtpkit.load_model(tmp_path / "base")
    for name, t in own.mtp.state_dict().items():
        assert torch.equal(model.mtp.state_dict()[name], t), name
    model.save_pretrained(tmp_path / "out")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    per_expert_names = {n.startswith("mtp."): ".experts.0.gate_proj.weight" in n for n in index if ".experts.0." in n}
    assert len(set(per_expert_names.values())) <= 1  # the head's experts stored as the trunk's are: one loader reads both
    back = mtpkit.load_model(tmp_path / "out")
    for name, t in back.mtp.state_dict().items():
        assert torch.equal(t, own.mtp.state_dict()[name]), name


def test_saving_twice_leaves_one_head(tmp_path):
    ref = tiny_hf_model("qwen3_5")
    model = with_mtp(ref, init="random")
    model.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    mtpkit.load_model(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors", "mtp.safetensors"]


def test_head_file_with_draft_vocab(tmp_path):
    """An mtpkit head file (as shipped for SmolLM2): its draft vocabulary restricts the MTP CE, as in mtpkit."""
    save_hf(tiny_hf_model("llama"), tmp_path / "base")
    own = mtpkit.add_mtp(mtpkit.load_model(tmp_path / "base"), init="random")
    own.mtp.draft_vocab = torch.arange(0, 256, 2)
    save_mtp_head(own, tmp_path / "head.safetensors", dtype=None)
    model = with_mtp(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), head=tmp_path / "head.safetensors")
    assert torch.equal(model.head.draft_vocab, own.mtp.draft_vocab)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids=ids, labels=ids).head_ce[1]
        model.head.draft_vocab = None
        assert model(input_ids=ids, labels=ids).head_ce[1] != full
    model.head.draft_vocab = own.mtp.draft_vocab  # saved beside the checkpoint, read back by transformers + mtpkit
    model.save_pretrained(tmp_path / "saved")
    assert torch.equal(mtpkit.load_model(tmp_path / "saved").mtp.draft_vocab, own.mtp.draft_vocab)
    again = with_mtp(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "saved"))
    assert torch.equal(again.head.draft_vocab, own.mtp.draft_vocab)


@pytest.mark.parametrize("init", ["random", "last_layer"])
def test_new_head(init):
    ref = tiny_hf_model("qwen3_5")
    model = with_mtp(ref, init=init, layers=2)
    assert len(model.mtp.layers) == 2 and model.loss_config.depth == 2
    if init == "last_layer":
        for own in model.mtp.layers:
            for k, v in ref.model.layers[3].state_dict().items():
                assert torch.equal(own.state_dict()[k], v), k


def test_missing_head_is_one_line(tmp_path):
    save_hf(tiny_hf_model("llama"), tmp_path)
    with pytest.raises(CheckpointError, match="no mtp.layers"):
        with_mtp(tf.AutoModelForCausalLM.from_pretrained(tmp_path))
    with pytest.raises(ValueError, match="not both"):
        with_mtp(tf.AutoModelForCausalLM.from_pretrained(tmp_path), head=tmp_path, init="random")


def test_transformers_trainer(tmp_path):
    """transformers' own Trainer (MTPTrainer): logs per depth, gradient accumulation, checkpoints with the head."""
    model = with_mtp(tiny_hf_model("llama"), init="last_layer", layers=1, depth=2, mtp_lambda=0.5)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (s + torch.arange(16)) % 256, "labels": (s + torch.arange(16)) % 256}
            for s in torch.randint(0, 256, (32,), generator=g)]
    args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                                gradient_accumulation_steps=2, learning_rate=3e-3, logging_steps=2, save_steps=4,
                                report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = MTPTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "mtp_ce_2" in h]
    assert len(logs) == 2 and {"main_ce", "mtp_ce_1", "mtp_acc_1", "mtp_acc_2", "mtp_tau"} <= set(logs[0])
    back = mtpkit.load_model(tmp_path / "checkpoint-4")
    for name, t in back.mtp.state_dict().items():
        assert torch.equal(t, model.mtp.state_dict()[name]), name


def test_transformers_trainer_detach_trunk_steps_the_trunk_as_main_loss_only(tmp_path):
    """MTPTrainer with detach_trunk clips the trunk and the head apart, so while clipping bites the trunk's weights
    follow transformers' own Trainer on the model without a head (a shared norm would scale its steps; the
    residue is the two main CEs' rounding, grown by Adam where gradients are near zero)."""
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (s + torch.arange(16)) % 256, "labels": (s + torch.arange(16)) % 256}
            for s in torch.randint(0, 256, (24,), generator=g)]

    def trained(model, trainer_class, run):
        args = tf.TrainingArguments(output_dir=str(tmp_path / run), max_steps=4, per_device_train_batch_size=4,
                                    learning_rate=3e-3, max_grad_norm=0.05, report_to=[], use_cpu=True,
                                    disable_tqdm=True, save_strategy="no")
        trainer_class(model=model, args=args, train_dataset=data).train()
        return model

    trunk = tiny_hf_model("llama")
    plain = trained(copy.deepcopy(trunk), tf.Trainer, "plain").state_dict()
    detached = trained(with_mtp(trunk, init="last_layer", layers=1, depth=2, mtp_lambda=3.0, detach_trunk=True),
                       MTPTrainer, "detached").model.state_dict()
    assert detached.keys() == plain.keys()
    for name, t in plain.items():
        torch.testing.assert_close(detached[name], t, rtol=0, atol=2e-5, msg=name)  # 3e-3 and more with one norm
