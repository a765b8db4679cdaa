"""Parallel heads in checkpoints (mtpkit's own layout: `mtp_heads.layers.{j-1}.*` for head j, config.json's
`mtp_parallel_heads`): model directories and head files round-trip byte for byte, and what does not fit is a
one-line error."""

import json

import pytest
import torch
from drafting import CONFIGS
from safetensors import safe_open

import mtpkit
from mtpkit.checkpoint.graft import read_head
from mtpkit.checkpoint.mtp_head import load_mtp_head, save_mtp_head
from mtpkit.models.config import ConfigError

RAW = dict(CONFIGS["qwen3_5"], mtp_num_hidden_layers=0, mtp_parallel_heads=2, mtp_parallel_intermediate_size=80)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return mtpkit.build_model(RAW)


def names(path):
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_model_directory_round_trip(model, tmp_path):
    mtpkit.save_model(model, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["mtp_parallel_heads"] == 2 and cfg["mtp_parallel_intermediate_size"] == 80
    assert cfg["mtp_num_hidden_layers"] == 0
    stored = names(tmp_path / "m" / "model.safetensors")
    assert {"mtp_heads.layers.0.self_attn.q_proj.weight", "mtp_heads.layers.1.mlp.down_proj.weight"} <= stored
    assert not any(n.startswith("mtp.") for n in stored)
    back = mtpkit.load_model(tmp_path / "m")
    assert same_state(back, model) and back.mtp_heads.layers[0].mlp.down_proj.weight.shape[1] == 80
    # mtp=False drops the heads, and a re-save no longer claims them
    bare = mtpkit.load_model(tmp_path / "m", mtp=False)
    assert bare.mtp_heads is None and bare.drafter is None
    mtpkit.save_model(bare, tmp_path / "bare")
    cfg = json.loads((tmp_path / "bare" / "config.json").read_text())
    assert "mtp_parallel_heads" not in cfg and "mtp_parallel_intermediate_size" not in cfg


def test_config_without_head_tensors_and_both_kinds_are_errors(model, tmp_path):
    mtpkit.save_model(mtpkit.build_model(dict(RAW, mtp_parallel_heads=0)), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(cfg, mtp_parallel_heads=2)))
    with pytest.raises(mtpkit.CheckpointError, match="mtp_parallel_heads = 2 but the weights hold no layers"):
        mtpkit.load_model(tmp_path / "m")
    with pytest.raises(ConfigError, match="sets both mtp_num_hidden_layers"):
        mtpkit.config_from_hf(dict(RAW, mtp_num_hidden_layers=1))


def test_head_file_round_trip(model, tmp_path):
    model.mtp_heads.draft_vocab = torch.tensor([1, 5, 7])
    try:
        path = save_mtp_head(model, tmp_path / "heads.safetensors", dtype=None)
    finally:
        model.mtp_heads.draft_vocab = None
    assert all(n.startswith("mtp_heads.") for n in names(path) - {"draft_vocab"})
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["mtp_parallel_heads"] == "2"
    # onto a model with a sequential MTP module: replaced by the file's heads, width from the metadata
    target = mtpkit.build_model(dict(RAW, mtp_num_hidden_layers=1, mtp_parallel_heads=0,
                                     mtp_parallel_intermediate_size=0))
    load_mtp_head(target, path)
    assert target.mtp is None and target.config.mtp_parallel_heads == 2 and target.config.mtp_num_hidden_layers == 0
    assert same_state(target.mtp_heads, model.mtp_heads) and target.mtp_heads.draft_vocab.tolist() == [1, 5, 7]
    assert mtpkit.generate(target, [[1, 2, 3]], max_new_tokens=6, draft_tokens=2).tokens == \
        mtpkit.generate(target, [[1, 2, 3]], max_new_tokens=6).tokens


def test_graft_refuses_parallel_heads(model, tmp_path):
    path = save_mtp_head(model, tmp_path / "heads.safetensors")
    with pytest.raises(mtpkit.CheckpointError, match="vLLM and SGLang do not serve"):
        read_head(path)
