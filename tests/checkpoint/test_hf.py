"""HF checkpoint I/O: byte-exact round trips (mtp.* and model.visual.* included), both expert layouts, bad input."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import random_mtp_tensors, save_hf

import mtpkit
from mtpkit import CheckpointError
from mtpkit.models.presets import tiny_hf_model


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) \
        if a.dtype != torch.bool else torch.equal(a, b)


@pytest.fixture(scope="module")
def released_bf16(tmp_path_factory):
    """A bf16 Qwen3.5 VLM checkpoint with a vision tower and mtp.* tensors, as released."""
    ref = tiny_hf_model("qwen3_5_vlm")
    mtp = {k: v.to(torch.bfloat16) for k, v in random_mtp_tensors(ref).items()}
    path = tmp_path_factory.mktemp("released")
    save_hf(ref.to(torch.bfloat16), path, mtp_tensors=mtp)
    return path


def test_round_trip_is_byte_exact(released_bf16, tmp_path):
    original = load_file(released_bf16 / "model.safetensors")
    assert any(k.startswith("model.visual.") for k in original) and any(k.startswith("mtp.") for k in original)
    model = mtpkit.load_model(released_bf16, dtype=None)
    mtpkit.save_model(model, tmp_path / "a")
    saved = load_file(tmp_path / "a" / "model.safetensors")
    assert set(saved) == set(original)
    assert all(_bytes_equal(saved[k], original[k]) for k in original)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1 and cfg["model_type"] == "qwen3_5"
    again = mtpkit.load_model(tmp_path / "a", dtype=None)
    a, b = model.state_dict(), again.state_dict()
    assert all(_bytes_equal(a[k], b[k]) for k in a)


def test_sharded_save_and_load(released_bf16, tmp_path):
    model = mtpkit.load_model(released_bf16)
    mtpkit.save_model(model, tmp_path, max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = mtpkit.load_model(tmp_path)
    ids = torch.randint(0, 240, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(ids, mtp=True).mtp_logits[0], again(ids, mtp=True).mtp_logits[0])


def test_per_expert_and_fused_experts_load_the_same(tmp_path):
    ref = tiny_hf_model("qwen3_5_moe")
    save_hf(ref, tmp_path / "fused")
    save_hf(ref, tmp_path / "per_expert", per_expert=True)
    assert any(".experts.0.gate_proj." in k for k in load_file(tmp_path / "per_expert" / "model.safetensors"))
    a, b = mtpkit.load_model(tmp_path / "fused"), mtpkit.load_model(tmp_path / "per_expert")
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def _edit_weights(path, fn):
    f = path / "model.safetensors"
    sd = load_file(f)
    fn(sd)
    save_file(sd, str(f), metadata={"format": "pt"})


@pytest.fixture
def llama_dir(tmp_path):
    save_hf(tiny_hf_model("llama"), tmp_path / "llama")
    return tmp_path / "llama"


def test_missing_tensor_is_named(llama_dir):
    _edit_weights(llama_dir, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        mtpkit.load_model(llama_dir)


def test_unexpected_tensor_is_named(llama_dir):
    _edit_weights(llama_dir, lambda sd: sd.__setitem__("model.layers.9.foo.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.9\.foo\.weight"):
        mtpkit.load_model(llama_dir)


def test_wrong_shape_is_named(llama_dir):
    _edit_weights(llama_dir, lambda sd: sd.__setitem__("model.norm.weight", torch.ones(65)))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight \(65,\) \(config expects \(64,\)\)"):
        mtpkit.load_model(llama_dir)


def test_mtp_layers_without_mtp_tensors(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no mtp.\\* tensors.*mtp=False"):
        mtpkit.load_model(llama_dir)
    assert mtpkit.load_model(llama_dir, mtp=False).mtp is None


def test_truncated_safetensors(llama_dir):
    f = llama_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt: re-download"):
        mtpkit.load_model(llama_dir)


def test_garbage_safetensors(llama_dir):
    (llama_dir / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        mtpkit.load_model(llama_dir)


def test_unknown_model_type_lists_supported(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="'gpt_neox' is not supported; supported: .*qwen3_5.*"):
        mtpkit.load_model(llama_dir)


def test_directory_without_config(llama_dir):
    (llama_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        mtpkit.load_model(llama_dir)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        mtpkit.load_model(tmp_path / "nope")


def test_config_of_other_model(llama_dir, tmp_path):
    """A config that does not match the weights reports what is wrong, not a raw torch error."""
    other = tmp_path / "other"
    save_hf(tiny_hf_model("qwen3"), other)
    shutil.copy(other / "config.json", llama_dir / "config.json")
    with pytest.raises(CheckpointError, match="config.json"):
        mtpkit.load_model(llama_dir)
