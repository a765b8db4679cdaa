"""TOML config -> dataclasses: overrides, unknown keys/sections, types, choices, cross-field checks, round trip."""

import tomllib

import pytest

from mtpkit.train.config import ConfigKeyError, config_from_dict, load_config, parse_value, to_toml

BASE = """
[model]
config = {model_type = "qwen3_5_text", hidden_size = 32, rope_parameters = {rope_theta = 1e4}}
tokenizer = "tok"

[mtp]
depth = 2

[data]
paths = ["a.txt", "b.jsonl"]

[train]
steps = 10
"""


@pytest.fixture
def cfg_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(BASE)
    return p


def test_file_defaults_and_overrides(cfg_file):
    cfg = load_config(cfg_file)
    assert cfg.mtp.depth == 2 and cfg.train.steps == 10 and cfg.optim.lr == 3e-4 and cfg.mtp.mtp_lambda == 0.1
    assert cfg.model.config["rope_parameters"] == {"rope_theta": 1e4}
    cfg = load_config(cfg_file, ["--train.steps=20", "--optim.lr=1e-3", "--mtp.weights=[0.51, 0.31]",
                                 "--data.shuffle=false", "--train.run_dir=runs/x", "optim.lr_mtp=2",
                                 '--model.tokenizer="a b"'])
    assert cfg.train.steps == 20 and cfg.optim.lr == 1e-3 and cfg.mtp.weights == [0.51, 0.31]
    assert cfg.data.shuffle is False and cfg.train.run_dir == "runs/x" and cfg.model.tokenizer == "a b"
    assert cfg.optim.lr_mtp == 2.0 and isinstance(cfg.optim.lr_mtp, float)  # ints are accepted as floats
    schedule = "--mtp.lambda_schedule=[[0, 0.3], [100, 0.1]]"
    assert load_config(cfg_file, [schedule]).mtp.lambda_schedule == [[0, 0.3], [100, 0.1]]
    with pytest.raises(ConfigKeyError, match="mtp.weights or mtp.lambda_schedule, not both"):
        load_config(cfg_file, [schedule, "--mtp.weights=[0.51, 0.31]"])


def test_unknown_key_in_file_names_it_and_lists_valid_keys(cfg_file):
    cfg_file.write_text(BASE + "\n[optim]\nlearning_rate = 1e-3\n")
    with pytest.raises(ConfigKeyError) as e:
        load_config(cfg_file)
    msg = str(e.value)
    assert "unknown config key 'optim.learning_rate'" in msg and "lr, lr_mtp" in msg and "warmup_steps" in msg


def test_unknown_key_or_section_in_override(cfg_file):
    with pytest.raises(ConfigKeyError, match=r"unknown config key 'train.stepz'.*valid keys in \[train\]: run_dir, steps"):
        load_config(cfg_file, ["--train.stepz=3"])
    with pytest.raises(ConfigKeyError, match=r"unknown config section 'trian'.*valid sections: model, mtp, data"):
        load_config(cfg_file, ["--trian.steps=3"])
    with pytest.raises(ConfigKeyError, match="must look like --section.key=value"):
        load_config(cfg_file, ["--steps=3"])
    cfg_file.write_text(BASE + "\n[optimizer]\nlr = 1\n")
    with pytest.raises(ConfigKeyError, match=r"unknown config section '\[optimizer\]'"):
        load_config(cfg_file)


def test_types_choices_and_cross_checks(cfg_file):
    with pytest.raises(ConfigKeyError, match="train.steps expects int, got str"):
        load_config(cfg_file, ["--train.steps=ten"])
    with pytest.raises(ConfigKeyError, match="mtp.only expects bool"):
        load_config(cfg_file, ["--mtp.only=1"])
    with pytest.raises(ConfigKeyError, match="mtp.init = 'copy' is not one of: checkpoint, random, last_layer"):
        load_config(cfg_file, ["--mtp.init=copy"])
    with pytest.raises(ConfigKeyError, match="mtp.weights has 1 entries but mtp.depth is 2"):
        load_config(cfg_file, ["--mtp.weights=[1.0]"])
    with pytest.raises(ConfigKeyError, match="set only one of model.path and model.config"):
        load_config(cfg_file, ["--model.path=x"])
    with pytest.raises(ConfigKeyError, match="seq_len > depth"):
        load_config(cfg_file, ["--data.seq_len=3"])
    with pytest.raises(ConfigKeyError, match="image placeholder tokens targets"):
        load_config(cfg_file, ["--data.train_on_inputs=true", "--data.images=true"])
    with pytest.raises(ConfigKeyError, match="set model.path"):
        config_from_dict({})
    with pytest.raises(FileNotFoundError):
        load_config(cfg_file.parent / "missing.toml")


def test_parse_value_and_round_trip(cfg_file):
    assert parse_value("3") == 3 and parse_value("1e-4") == 1e-4 and parse_value("true") is True
    assert parse_value("runs/a") == "runs/a" and parse_value("[1, 2]") == [1, 2]
    cfg = load_config(cfg_file, ["--mtp.depth_curriculum=[[0, 1], [50, 2]]"])
    text = to_toml(cfg)
    assert config_from_dict(tomllib.loads(text)) == cfg
