"""`[mtp] kind = "parallel"`: the trainer trains parallel heads (per-head metrics and held-out accuracy), export
writes them in mtpkit's layout (model directory and --mtp-only head file) with the trained weights, and an
MTP-only run on the exported model trains the heads alone."""

import json
from pathlib import Path

import pytest
import torch
from train_runs import TINY_MODEL, read_metrics, tiny_raw_config, write_toml

import mtpkit
from mtpkit.checkpoint.mtp_head import load_mtp_head
from mtpkit.cli import main
from mtpkit.train.state import load_model_weights
from mtpkit.train.config import ConfigKeyError, config_from_dict


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    raw = tiny_raw_config(root, mtp={"depth": 2, "init": "random", "kind": "parallel"},
                          data={"val_docs": 2}, train={"steps": 4, "eval_every": 2, "eval_rows": 4})
    assert main(["train", str(write_toml(root / "cfg.toml", raw))]) == 0
    return root


def test_trains_heads_with_per_head_metrics(run):
    records = read_metrics(run / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert len(r["mtp_loss"]) == 2 and len(r["mtp_acc"]) == 2 and all(0 <= a <= 1 for a in r["mtp_acc"])
        # the objective is main + (lambda / D) x each head's CE, as for the sequential module
        assert r["loss"] == pytest.approx(r["main_loss"] + 0.05 * sum(r["mtp_loss"]), rel=1e-5)
    assert records[-1]["mtp_loss"][0] < records[0]["mtp_loss"][0]
    assert len(records[1]["val_mtp_acc"]) == 2 and records[1]["val_tau_sim"] >= 1
    cfg = json.loads((run / "run" / "model_config.json").read_text())
    assert cfg["mtp_parallel_heads"] == 2 and cfg["mtp_num_hidden_layers"] == 0


def test_export_keeps_the_trained_heads(run, tmp_path):
    trained = mtpkit.build_model(dict(TINY_MODEL, mtp_parallel_heads=2))
    load_model_weights(run / "run" / "checkpoints" / "step-00000004", trained)
    assert main(["export", str(run / "run"), "--out", str(tmp_path / "hf")]) == 0
    back = mtpkit.load_model(tmp_path / "hf")
    for k, v in trained.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert main(["export", str(run / "run"), "--mtp-only", "--out", str(tmp_path / "h.safetensors")]) == 0
    fresh = load_mtp_head(mtpkit.build_model(TINY_MODEL), tmp_path / "h.safetensors")
    for k, v in trained.mtp_heads.state_dict().items():
        assert torch.equal(fresh.mtp_heads.state_dict()[k], v), k
    prompts = [[5, 6, 7, 8], [9, 10]]
    assert mtpkit.generate(back, prompts, max_new_tokens=8, draft_tokens=2).tokens == \
        mtpkit.generate(back, prompts, max_new_tokens=8).tokens


def test_mtp_only_from_the_exported_model_trains_the_heads_alone(run, tmp_path):
    assert main(["export", str(run / "run"), "--out", str(tmp_path / "hf")]) == 0
    raw = tiny_raw_config(run, mtp={"depth": 2, "init": "checkpoint", "kind": "parallel", "only": True},
                          train={"run_dir": str(tmp_path / "run2"), "steps": 2})
    raw["model"] = {"path": str(tmp_path / "hf"), "tokenizer": str(run / "tok")}
    assert main(["train", str(write_toml(tmp_path / "cfg.toml", raw))]) == 0
    before, after = mtpkit.load_model(tmp_path / "hf"), mtpkit.load_model(tmp_path / "hf")
    load_model_weights(tmp_path / "run2" / "checkpoints" / "step-00000002", after)
    changed = {k for k, v in after.state_dict().items() if not torch.equal(v, before.state_dict()[k])}
    assert changed and all(k.startswith("mtp_heads.") for k in changed)


@pytest.mark.parametrize("mtp, message", [
    ({"kind": "parallel", "depth": 2, "layers": 1}, "parallel heads are one layer each"),
    ({"kind": "parallel", "depth": 2, "detach_trunk": True}, "mtp.detach_trunk = false"),
    ({"kind": "tree"}, "mtp.kind = 'tree' is not one of: sequential, parallel"),
])
def test_config_errors(tmp_path, mtp, message):
    raw = {"model": {"config": dict(TINY_MODEL)}, "data": {"paths": ["x"], "seq_len": 32}, "mtp": mtp}
    with pytest.raises(ConfigKeyError, match=message):
        config_from_dict(raw)


def test_the_shakespeare_comparison_recipes_differ_only_in_the_head():
    from mtpkit.train.config import load_config
    from mtpkit.train.model_setup import build_train_model

    configs = Path(__file__).resolve().parents[2] / "configs"
    seq, par = (load_config(configs / f"{name}.toml") for name in ("shakespeare_qwen35_tiny",
                                                                   "shakespeare_qwen35_tiny_parallel"))
    a, b = seq.to_dict(), par.to_dict()
    width = b["model"]["config"].pop("mtp_parallel_intermediate_size")
    assert a["mtp"] == dict(b["mtp"], kind="sequential") and a["model"] == b["model"]
    assert {k: v for k, v in a["train"].items() if k != "run_dir"} == \
        {k: v for k, v in b["train"].items() if k != "run_dir"}
    assert all(a[s] == b[s] for s in ("data", "optim", "checkpoint", "parallel", "log"))
    mtp, heads = build_train_model(seq), build_train_model(par)
    n_mtp = sum(p.numel() for n, p in mtp.named_parameters() if n.startswith("mtp."))
    n_heads = sum(p.numel() for n, p in heads.named_parameters() if n.startswith("mtp_heads."))
    assert (n_mtp, n_heads, width) == (459776, 459648, 427)
