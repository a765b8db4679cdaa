"""FSDP2 over 2 CPU processes (torchrun, gloo) matches 1 process with the same global batch, step for step; its
sharded DCP checkpoint resumes in 1 process."""

import pytest
from train_runs import assert_runs_close, read_metrics, tiny_raw_config, torchrun, write_toml

pytestmark = pytest.mark.slow


def test_fsdp2_two_ranks_match_one_rank(tmp_path):
    from mtpkit.cli import main

    raw = tiny_raw_config(tmp_path, train={"steps": 4, "batch_size": 4})
    cfg = write_toml(tmp_path / "cfg.toml", raw)
    # 1 process: the global batch of 4 rows in 2 micro-batches of 2
    assert main(["train", str(cfg), f"--train.run_dir={tmp_path / 'one'}", "--train.micro_batch_size=2"]) == 0
    # 2 processes, FSDP2 on every block: 2 rows per rank in 2 micro-batches of 1
    out = torchrun(2, ["train", str(cfg), f"--train.run_dir={tmp_path / 'two'}", "--train.micro_batch_size=1"], tmp_path)
    assert "FSDP2 over 2 ranks" in out
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert len(one) == 4 and one[-1]["loss"] < one[0]["loss"]
    assert_runs_close(one, two)

    # the 2-rank sharded checkpoint of step 2 resumes in 1 process and continues exactly like the 1-rank run
    resumed = tmp_path / "resumed"
    assert main(["train", str(cfg), f"--train.run_dir={resumed}",
                 f"--checkpoint.resume={tmp_path / 'two' / 'checkpoints' / 'step-00000002'}"]) == 0
    assert_runs_close(one[2:], read_metrics(resumed))


def test_fsdp2_mtp_only_with_activation_checkpointing_matches_one_rank(tmp_path):
    """MTP-only under FSDP2 (the frozen trunk replicated, the MTP module sharded), with per-block AC applied
    before FSDP, equals the plain 1-process MTP-only run."""
    from mtpkit.cli import main

    raw = tiny_raw_config(tmp_path, train={"steps": 3, "batch_size": 4}, mtp={"only": True})
    cfg = write_toml(tmp_path / "cfg.toml", raw)
    assert main(["train", str(cfg), f"--train.run_dir={tmp_path / 'one'}"]) == 0
    torchrun(2, ["train", str(cfg), f"--train.run_dir={tmp_path / 'two'}", "--train.micro_batch_size=1",
                 "--parallel.ac=full"], tmp_path)
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert one[-1]["loss"] < one[0]["loss"]
    assert_runs_close(one, two)


def test_fsdp2_on_image_data_matches_one_rank(tmp_path):
    """A vision-language model on image chats: each rank takes its rows' images, the tower trains under FSDP2."""
    import json

    from mtpkit.cli import main
    from mtpkit.datasets.shapes import prepare_shapes

    root = prepare_shapes(tmp_path / "shapes", n_train=40, n_val=1, seed=2)
    model = json.loads((root / "model" / "config.json").read_text())
    model["text_config"].update(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
                                num_key_value_heads=1, layer_types=["linear_attention", "full_attention"],
                                linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                                linear_value_head_dim=16)
    model["vision_config"].update(depth=1, out_hidden_size=32)
    raw = {"model": {"config": model, "tokenizer": str(root / "model")},
           "mtp": {"depth": 1, "init": "random", "mtp_lambda": 0.3},
           "data": {"paths": [str(root / "train.jsonl")], "mode": "sft", "images": True, "seq_len": 192},
           "train": {"steps": 3, "batch_size": 4}, "optim": {"lr": 3e-3}, "log": {"progress": False}}
    cfg = write_toml(tmp_path / "cfg.toml", raw)
    assert main(["train", str(cfg), f"--train.run_dir={tmp_path / 'one'}"]) == 0
    torchrun(2, ["train", str(cfg), f"--train.run_dir={tmp_path / 'two'}", "--train.micro_batch_size=1"], tmp_path)
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert one[-1]["loss"] < one[0]["loss"]
    assert_runs_close(one, two)
