"""`mtpkit.load_for_decoding`: the embedded SmolLM2 comes with its shipped head; another checkpoint with the head
file given, in the dtype, quantisation and draft vocabulary asked for."""

import pytest
import torch
from tiny_models import random_mtp_tensors, save_hf, save_word_tokenizer

import mtpkit
from mtpkit.checkpoint.mtp_head import save_mtp_head
from mtpkit.decode.int8 import Int8Linear
from mtpkit.models.presets import tiny_hf_model
from mtpkit.resources import DEFAULT_HEAD, resource


@pytest.mark.slow
def test_the_embedded_model_comes_with_its_shipped_head(smollm2_gguf):
    model, tokenizer, path, head = mtpkit.load_for_decoding()
    assert path == smollm2_gguf and head == resource(DEFAULT_HEAD)
    assert model.drafter is not None and model.drafter.draft_vocab is not None  # the head's own vocabulary
    assert model.output_weight.dtype == torch.float32 and not model.training
    assert tokenizer.decode(tokenizer.encode("Hello there")).strip() == "Hello there"


def test_a_checkpoint_with_a_head_file_in_int8_over_the_full_vocabulary(tmp_path):
    save_hf(tiny_hf_model("llama"), tmp_path / "m")
    save_word_tokenizer(tmp_path / "m")
    ref = tiny_hf_model("llama")
    save_hf(ref, tmp_path / "with_head", mtp_tensors=random_mtp_tensors(ref))
    with_head = mtpkit.load_model(tmp_path / "with_head")
    with_head.mtp.draft_vocab = torch.arange(64)
    save_mtp_head(with_head, tmp_path / "head.safetensors")

    model, tokenizer, _, head = mtpkit.load_for_decoding(tmp_path / "m", head=tmp_path / "head.safetensors")
    assert head == tmp_path / "head.safetensors" and torch.equal(model.drafter.draft_vocab, torch.arange(64))
    torch.testing.assert_close(model.drafter.fc.weight, with_head.mtp.fc.weight, rtol=1e-2, atol=1e-3)  # stored bf16
    assert tokenizer.eos_token == "t255"
    model = mtpkit.load_for_decoding(tmp_path / "m", head=tmp_path / "head.safetensors", quantize="int8",
                                     draft_vocab="full").model
    assert model.drafter.draft_vocab is None and model.output_weight.dtype == torch.bfloat16
    assert isinstance(model.model.layers[0].self_attn.q_proj, Int8Linear)
    assert mtpkit.load_for_decoding(tmp_path / "m", dtype=torch.bfloat16).head is None  # no head: none loaded
    with pytest.raises(ValueError, match="draft_vocab"):
        mtpkit.load_for_decoding(tmp_path / "m", draft_vocab="head")
