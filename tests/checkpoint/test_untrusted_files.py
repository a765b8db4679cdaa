"""Checkpoints, GGUF files and configs as untrusted data: every bad value is a one-line error naming it, raised
from cheap checks before the model is built (a config claiming millions of layers fails in milliseconds)."""

import json
import time

import pytest
import torch
from checkpoint_files import TINY, tiny_model, write_gguf

import mtpkit
from mtpkit import CheckpointError
from mtpkit.errors import MtpkitError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "m"
    mtpkit.save_model(tiny_model(0), out)
    return out


def _with_config(src, tmp_path, **changes):
    out = tmp_path / "edited"
    out.mkdir()
    (out / "model.safetensors").symlink_to(src / "model.safetensors")
    raw = json.loads((src / "config.json").read_text())
    raw.update(changes)
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size="64"), r"hidden_size must be a positive integer, not '64'"),
    (dict(hidden_size=-64), r"hidden_size must be a positive integer, not -64"),
    (dict(num_attention_heads=0), r"num_attention_heads must be a positive integer, not 0"),
    (dict(num_key_value_heads=3), r"num_attention_heads \(2\) must be a multiple of num_key_value_heads \(3\)"),
    (dict(vocab_size=None), r"vocab_size must be a positive integer, not None"),
    (dict(tie_word_embeddings="false"), r"tie_word_embeddings must be true or false, not 'false'"),
    (dict(rms_norm_eps=float("nan")), r"rms_norm_eps must be a number in \[0, 1\), not nan"),
    (dict(layer_types=["full_attention", "sliding_attention"]), r"layer_types must be a list of full_attention"),
    (dict(layer_types=["full_attention", "linear_attention"]), r"linear_attention layers, which model_type 'llama'"),
    (dict(hidden_act="gelu"), r"hidden_act must be one of silu, swish, not 'gelu'"),
    (dict(model_type=["llama"]), r"model_type \['llama'\] is not supported"),
    (dict(rope_scaling=[1, 2]), r"rope_scaling must be an object"),
    (dict(num_hidden_layers=5_000_000), r"num_hidden_layers = 5000000 is implausibly large"),
    (dict(num_hidden_layers=1000), r"num_hidden_layers = 1000 but the weights hold layers 0-1 \(2 of them\)"),
    (dict(mtp_num_hidden_layers=900), r"mtp_num_hidden_layers=900 but the checkpoint has no mtp"),
])
def test_bad_config_values_are_one_line_errors(saved, tmp_path, changes, message):
    path = _with_config(saved, tmp_path, **changes)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=message) as e:
        mtpkit.load_model(path)
    assert time.perf_counter() - t0 < 2.0  # cheap checks, nothing built
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_config_json_that_is_not_an_object(saved, tmp_path):
    path = _with_config(saved, tmp_path)
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json must hold a JSON object, not list"):
        mtpkit.load_model(path)


def test_the_intact_config_loads(saved):
    assert sum(p.numel() for p in mtpkit.load_model(saved).parameters()) > 0  # power for the cases above


def test_build_model_refuses_a_config_larger_than_free_memory():
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"describes a model of \d+\.\d GiB \(fp32\) but cpu has"):
        mtpkit.build_model(dict(TINY, vocab_size=2**24, hidden_size=2**16, head_dim=2**15))
    assert time.perf_counter() - t0 < 5.0


# --------------------------------------------------------------------------------------------------------- GGUF
@pytest.mark.parametrize("key, value, kind, message", [
    ("llama.block_count", 5_000_000, "UINT32", r"num_hidden_layers = 5000000 is implausibly large"),
    ("llama.block_count", 3, "UINT32", r"is missing 9 tensors \(first: model\.layers\.2\."),
    ("llama.embedding_length", "16", "STRING", r"embedding_length = '16', not an integer"),
    ("llama.attention.head_count", 0, "UINT32", r"head_count = 0, not a positive value"),
    ("llama.rope.freq_base", float("nan"), "FLOAT32", r"freq_base = nan, not a positive value"),
    ("llama.vocab_size", 1_000_000, "UINT32", r"token_embd of shape \(32, 16\) but the metadata says vocab"),
    ("llama.vocab_size", 4_000_000_000, "UINT32", r"vocab_size must be a positive integer, not 4000000000"),
    ("llama.feed_forward_length", None, "UINT32", r"lacks the GGUF metadata key llama\.'feed_forward_length'"),
])
def test_bad_gguf_metadata_fails_before_dequantizing(tmp_path, key, value, kind, message):
    import gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, {key: (value, getattr(gguf.GGUFValueType, kind))})
    t0 = time.perf_counter()
    with pytest.raises(MtpkitError, match=message) as e:
        mtpkit.load_model(path)
    assert time.perf_counter() - t0 < 2.0 and "\n" not in str(e.value)


def test_intact_gguf_loads_the_written_weights(tmp_path):
    hf = write_gguf(tmp_path / "m.gguf")
    model = mtpkit.load_model(tmp_path / "m.gguf")
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in hf.items())
