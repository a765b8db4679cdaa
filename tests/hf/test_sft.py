"""TRL's SFTTrainer with the MTP loss on a tiny Qwen3.5 (hybrid) model, full fine-tune and LoRA: the MTP loss
falls, the saved directory loads in mtpkit with the trained head byte-exact and in transformers, and speculative
decoding with it is plain decoding."""

import json

import pytest
import torch
import transformers as tf
from peft import LoraConfig, get_peft_model
from tiny_models import random_mtp_tensors, save_hf, save_word_tokenizer

import mtpkit
from mtpkit.hf import with_mtp
from mtpkit.models.presets import tiny_hf_model

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
from mtpkit.hf.sft import MTPSFTTrainer  # noqa: E402  (needs trl)

TRUNK_LORA = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "in_proj_qkv", "out_proj"])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Qwen3.5 checkpoint with a 1-layer head, and a word-level tokenizer (t0 .. t255)."""
    path = tmp_path_factory.mktemp("base")
    ref = tiny_hf_model("qwen3_5")
    save_hf(ref, path, mtp_tensors=random_mtp_tensors(ref))
    save_word_tokenizer(path)
    return path


def dataset():
    """Counting runs (t_k t_k+1 ...): every next token, and the ones after it, follow from the last."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 200, (64,), generator=g).tolist()
    return datasets.Dataset.from_dict({"text": [" ".join(f"t{s + i}" for i in range(20)) for s in starts]})


def train(base, out, model, fall: float, **args):
    """`fall`: the least the MTP CE must drop from the first logged steps to the last."""
    config = trl.SFTConfig(output_dir=str(out), max_steps=12, per_device_train_batch_size=8, logging_steps=3,
                           save_steps=12, report_to=[], use_cpu=True, max_length=32, dataset_text_field="text",
                           disable_tqdm=True, gradient_checkpointing=False, **args)
    tok = tf.AutoTokenizer.from_pretrained(base)
    trainer = MTPSFTTrainer(model=model, args=config, train_dataset=dataset(), processing_class=tok)
    trainer.train()
    trainer.save_model(str(out))
    logs = [h for h in trainer.state.log_history if "mtp_ce_1" in h]
    assert logs[-1]["mtp_ce_1"] < logs[0]["mtp_ce_1"] - fall, logs
    assert {"main_ce", "mtp_acc_1", "mtp_tau"} <= set(logs[-1])
    return trainer


def assert_serves(out, head: torch.nn.Module):
    """The directory loads in mtpkit with exactly `head`'s weights and in transformers; MTP decoding is lossless."""
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {f for n, f in index.items() if n.startswith("mtp.")} == {"mtp.safetensors"}
    assert json.loads((out / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    model = mtpkit.load_model(out, dtype=None)
    trained = head.state_dict()
    for name, t in model.mtp.state_dict().items():
        assert torch.equal(t, trained[name].cpu()), name
    tf.AutoModelForCausalLM.from_pretrained(out)  # transformers ignores mtp.* and loads the rest
    prompts = [[5, 6, 7, 8], [100, 101, 102]]
    plain = mtpkit.generate(model, prompts, max_new_tokens=16).tokens
    assert mtpkit.generate(model, prompts, max_new_tokens=16, draft_tokens=2).tokens == plain


def test_full_fine_tune(base, tmp_path):
    model = with_mtp(tf.AutoModelForCausalLM.from_pretrained(base), mtp_lambda=0.5)
    train(base, tmp_path, model, fall=0.5, learning_rate=3e-3)
    assert (tmp_path / "checkpoint-12" / "mtp.safetensors").is_file()  # the checkpoints carry the head too
    assert_serves(tmp_path, model.mtp)


@pytest.mark.parametrize("head_lora", [None, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "o_proj", "fc"])],
                         ids=["head_full", "head_lora"])
def test_lora(base, tmp_path, head_lora):
    """LoRA on the trunk; the head trained fully or by LoRA. The run saves the adapter and the head; merging
    both gives a servable directory."""
    hf = tf.AutoModelForCausalLM.from_pretrained(base)
    frozen = {n: p.clone() for n, p in hf.named_parameters()}
    model = with_mtp(get_peft_model(hf, TRUNK_LORA), mtp_lambda=0.5, head_lora=head_lora)
    train(base, tmp_path / "run", model, fall=0.1, learning_rate=1e-2)
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "run" / "mtp.safetensors").is_file()
    for n, p in model.hf_model.named_parameters():  # the trunk moved only through its adapters
        if "lora_" not in n:
            assert torch.equal(p, frozen[n.replace("base_layer.", "")]), n
    served = model.plain_head()
    merged = model.merged()
    merged.save_pretrained(tmp_path / "merged")
    tf.AutoTokenizer.from_pretrained(base).save_pretrained(tmp_path / "merged")
    assert_serves(tmp_path / "merged", served)
