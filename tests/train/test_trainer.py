"""The trainer end to end on a tiny Qwen3.5-architecture model: a smoke run through the CLI (metrics, plot),
NaN stopping with the last good checkpoint kept, MTP-only mode, lr_mtp groups and the schedule, FLOPs."""

from __future__ import annotations

import math

import pytest
import torch
from train_runs import TINY_MODEL, read_metrics, tiny_config, tiny_raw_config, write_toml

from mtpkit.train.config import ConfigKeyError, config_from_dict


# --------------------------------------------------------------------------------------------------------- tests
def test_smoke_run_through_cli_writes_metrics_checkpoints_and_plot(tmp_path, capsys):
    from mtpkit.cli import main

    cfg = write_toml(tmp_path / "cfg.toml", tiny_raw_config(tmp_path))
    assert main(["train", str(cfg), "--train.steps=4", "--log.tensorboard=true", "--data.val_docs=2",
                 "--train.eval_every=3"]) == 0
    out = capsys.readouterr().out
    assert "step 4/4" in out and "acc" in out and "tok/s" in out and "mem" in out and "val main" in out
    recs = read_metrics(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [r["step"] for r in recs if "val_main_loss" in r] == [3, 4] and len(recs[3]["val_mtp_acc"]) == 2
    for r in recs:
        assert math.isfinite(r["loss"]) and len(r["mtp_loss"]) == 2 and len(r["mtp_acc"]) == 2
        # the objective is main + sum_d (lambda / D) * CE_d
        assert r["loss"] == pytest.approx(r["main_loss"] + 0.05 * sum(r["mtp_loss"]), rel=1e-5)
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts == ["step-00000002", "step-00000004"]
    assert (tmp_path / "run" / "config.toml").exists() and (tmp_path / "run" / "tokenizer" / "tokenizer.json").exists()
    assert any((tmp_path / "run" / "tb").iterdir())
    assert main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    # the run is complete: running the same command again resumes at step 4 and does nothing
    assert main(["train", str(cfg), "--train.steps=4", "--data.val_docs=2"]) == 0
    assert len(read_metrics(tmp_path / "run")) == 4


def test_nan_loss_stops_with_clear_message_and_keeps_last_good_checkpoint(tmp_path):
    from mtpkit.train.state import latest_checkpoint
    from mtpkit.train.trainer import NonFiniteLoss, Trainer

    trainer = Trainer(tiny_config(tmp_path, train={"steps": 6}, checkpoint={"every": 2}))
    calls = {"n": 0}

    def poison(module, args, output):  # the 4th optimizer step's micro-batches produce NaN
        calls["n"] += 1
        return output * float("nan") if calls["n"] > 6 else output

    trainer.model.model.layers[0].register_forward_hook(poison)  # 2 micro-batches per step
    good = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(NonFiniteLoss) as e:
        trainer.fit()
    msg = str(e.value)
    assert "step 4" in msg and "nan" in msg and "step-00000002" in msg and "not updated" in msg
    assert latest_checkpoint(tmp_path / "run").name == "step-00000002"
    assert not any(math.isnan(v.float().sum()) for v in trainer.model.state_dict().values())
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    assert any(not torch.equal(good[k], v) for k, v in trainer.model.state_dict().items())  # it did train


def test_mtp_only_leaves_trunk_bit_identical_and_uses_lr_mtp(tmp_path):
    from mtpkit.train.trainer import Trainer

    trainer = Trainer(tiny_config(tmp_path, mtp={"only": True}, optim={"lr": 1e-3, "lr_mtp": 5e-3},
                                  train={"steps": 2}, checkpoint={"every": 0, "save_final": False}))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    names = {g["name"] for g in trainer.optimizer.param_groups}
    assert names == {"mtp", "mtp_no_decay"}  # the frozen trunk is not even in the optimizer
    assert all(g["initial_lr"] == 5e-3 for g in trainer.optimizer.param_groups)
    trainer.fit()
    after = trainer.model.state_dict()
    for k, v in after.items():
        assert torch.equal(before[k], v) != k.startswith("mtp."), k
    assert all(p.grad is None for n, p in trainer.model.named_parameters() if not n.startswith("mtp."))


def test_mtp_head_from_checkpoint_or_last_layer(tmp_path):
    import mtpkit
    from mtpkit.train.model_setup import build_train_model

    raw = tiny_raw_config(tmp_path)
    model = mtpkit.build_model(dict(TINY_MODEL))
    mtpkit.save_model(model, tmp_path / "plain")
    raw["model"] = {"path": str(tmp_path / "plain"), "tokenizer": str(tmp_path / "tok")}
    raw["mtp"] = {"depth": 2, "init": "checkpoint"}
    with pytest.raises(ValueError, match="has no MTP head.*'random' or 'last_layer'"):
        build_train_model(config_from_dict(raw))
    raw["mtp"]["init"] = "last_layer"
    m = build_train_model(config_from_dict(raw))
    last = m.model.layers[1].state_dict()
    assert m.config.mtp_num_hidden_layers == 2
    assert all(torch.equal(v, m.mtp.layers[1].state_dict()[k]) for k, v in last.items())
    mtpkit.save_model(m, tmp_path / "with_mtp")
    raw["model"]["path"] = str(tmp_path / "with_mtp")
    raw["mtp"] = {"depth": 3, "init": "checkpoint"}  # 2 layers, 3 chained depths (the last layer is reused)
    m2 = build_train_model(config_from_dict(raw))
    assert torch.equal(m2.mtp.fc.weight, m.mtp.fc.weight)


def test_mtp_head_from_a_head_file_warm_starts_a_plain_checkpoint(tmp_path):
    import mtpkit
    from mtpkit.checkpoint.mtp_head import save_mtp_head
    from mtpkit.train.model_setup import build_train_model

    raw = tiny_raw_config(tmp_path)
    torch.manual_seed(0)
    mtpkit.save_model(mtpkit.build_model(dict(TINY_MODEL)), tmp_path / "plain")
    headed = mtpkit.load_model(tmp_path / "plain")
    mtpkit.add_mtp(headed, 2, init="random")
    save_mtp_head(headed, tmp_path / "head.safetensors", dtype=None)
    raw["model"] = {"path": str(tmp_path / "plain"), "tokenizer": str(tmp_path / "tok")}
    raw["mtp"] = {"depth": 2, "init": "checkpoint", "init_from": str(tmp_path / "head.safetensors")}
    m = build_train_model(config_from_dict(raw))
    assert m.state_dict().keys() == headed.state_dict().keys()
    assert all(torch.equal(v, headed.state_dict()[k]) for k, v in m.state_dict().items())  # trunk and head
    raw["mtp"]["layers"] = 1
    with pytest.raises(ValueError, match="mtp.layers = 1 but .*head.safetensors has a 2-layer MTP head"):
        build_train_model(config_from_dict(raw))
    raw["mtp"] = {"depth": 2, "init": "random", "init_from": str(tmp_path / "head.safetensors")}
    with pytest.raises(ConfigKeyError, match="mtp.init_from .* goes with mtp.init = 'checkpoint'"):
        config_from_dict(raw)


def test_lr_schedule_warmup_cosine_and_groups():
    from mtpkit.train.optim import lr_factor, param_groups
    import mtpkit

    assert [lr_factor(s, 10, 2) for s in (0, 1)] == [0.5, 1.0]
    assert lr_factor(2, 10, 2) == pytest.approx(1.0) and lr_factor(9, 10, 2) == pytest.approx(0.1)
    assert lr_factor(5, 10, 0, "constant") == 1.0
    model = mtpkit.build_model(dict(TINY_MODEL, mtp_num_hidden_layers=1))
    groups = {g["name"]: g for g in param_groups(model, 1e-3, 1e-4, 0.1)}
    assert set(groups) == {"trunk", "trunk_no_decay", "mtp", "mtp_no_decay"}
    assert groups["mtp"]["lr"] == 1e-4 and groups["trunk"]["lr"] == 1e-3 and groups["mtp_no_decay"]["weight_decay"] == 0
    n = sum(p.numel() for g in groups.values() for p in g["params"])
    assert n == sum(p.numel() for p in model.parameters())


def test_flops_count_mtp_layers_and_their_lm_head():
    from mtpkit.models.config import config_from_hf
    from mtpkit.train.flops import flops_per_token, layer_flops

    c = config_from_hf(dict(TINY_MODEL))
    T, H, V = 64, c.hidden_size, c.vocab_size
    base = flops_per_token(c, T, 0)
    w, mix = layer_flops(c, "full_attention", False, T)
    per_depth = 6 * (w + 2 * H * H + H * V) + 3 * mix
    assert flops_per_token(c, T, 2) - base == per_depth * 2
    # MTP-only: trunk forward only, the lm_head of each depth passes an input gradient but trains no weight
    only = flops_per_token(c, T, 2, mtp_only=True)
    assert only < flops_per_token(c, T, 2)
    assert only - flops_per_token(c, T, 0, mtp_only=True) == 2 * (6 * (w + 2 * H * H) + 3 * mix + 4 * H * V)


def test_missing_data_and_short_documents_are_clear_errors(tmp_path):
    from mtpkit.cli import main

    raw = tiny_raw_config(tmp_path)
    raw["data"]["paths"] = [str(tmp_path / "nope.txt")]
    assert main(["train", str(write_toml(tmp_path / "a.toml", raw))]) == 2
    (tmp_path / "empty.jsonl").write_text("\n")
    raw["data"]["paths"] = [str(tmp_path / "empty.jsonl")]
    assert main(["train", str(write_toml(tmp_path / "b.toml", raw))]) == 2
    (tmp_path / "short").mkdir()
    for i in range(3):
        (tmp_path / "short" / f"{i}.txt").write_text("the")  # 1 token + EOS < depth + 2
    raw["data"]["paths"] = [str(tmp_path / "short")]
    with pytest.raises(ValueError, match="shorter than 4 tokens"):
        from mtpkit.train.trainer import Trainer

        Trainer(config_from_dict(raw))


def test_cli_errors_are_one_line(tmp_path, capsys):
    from mtpkit.cli import main

    cfg = write_toml(tmp_path / "cfg.toml", tiny_raw_config(tmp_path))
    assert main(["train", str(cfg), "--train.stepz=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown config key 'train.stepz'" in err and "steps" in err


def test_seq_len_beyond_the_models_positions_is_refused_before_the_run_dir_is_made(tmp_path, capsys):
    from mtpkit.cli import main

    raw = tiny_raw_config(tmp_path, model={"config": dict(TINY_MODEL, max_position_embeddings=64)})
    assert main(["train", str(write_toml(tmp_path / "cfg.toml", raw)), "--data.seq_len=65"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "data.seq_len = 65 is beyond the model's max_position_embeddings (64)" in err
    assert not (tmp_path / "run").exists()
    assert main(["train", str(tmp_path / "cfg.toml"), "--data.seq_len=64", "--train.steps=1"]) == 0  # power


def test_ac_and_compile_wrap_blocks_without_changing_names_or_numbers():
    import copy

    import mtpkit
    from mtpkit.parallel import apply_ac, apply_compile
    from mtpkit.train.config import MTPSection
    from mtpkit.train.loss import compute_loss, shift_labels

    torch.manual_seed(0)
    model = mtpkit.build_model(dict(TINY_MODEL, mtp_num_hidden_layers=2))
    wrapped = copy.deepcopy(model)
    apply_ac(wrapped)
    apply_compile(wrapped, backend="eager")
    assert list(wrapped.state_dict()) == list(model.state_dict())
    ids = torch.randint(0, 320, (2, 24))
    seg = (torch.arange(24) >= 10).long().expand(2, 24)
    batch = {"input_ids": ids, "segment_ids": seg, "labels": shift_labels(ids, seg)}
    losses = []
    for m in (model, wrapped):
        out = compute_loss(m, batch, MTPSection(depth=2))
        out.total.backward()
        losses.append(out.total.detach())
    assert torch.allclose(losses[0], losses[1], rtol=1e-6)
    clean = lambda n: n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")  # noqa: E731
    grads = {clean(n): p.grad for n, p in wrapped.named_parameters()}
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[n], rtol=1e-5, atol=1e-7), n


def test_depth_zero_is_plain_next_token_training(tmp_path):
    from mtpkit.train.trainer import Trainer

    trainer = Trainer(tiny_config(tmp_path, mtp={"depth": 0}, train={"steps": 2},
                                  checkpoint={"every": 0, "save_final": False}))
    assert trainer.model.mtp is None
    summary = trainer.fit()
    # the objective is normalised by global token counts and the reported main loss by local ones: equal only
    # to rounding, so compare with a tolerance (bitwise equality held on one machine and failed on another)
    assert summary["last"]["mtp_loss"] == []
    assert summary["last"]["loss"] == pytest.approx(summary["last"]["main_loss"], rel=1e-6)


def test_detach_trunk_trunk_steps_as_main_loss_only_training_even_when_clipping_bites(tmp_path):
    """With the trunk detached from the MTP loss, its updates are those of main-loss-only training: the MTP
    gradients (clipped apart) must not scale the trunk's step through a shared clipping norm."""
    import mtpkit
    from mtpkit.train.trainer import Trainer

    raw = tiny_raw_config(tmp_path)
    torch.manual_seed(0)
    mtpkit.save_model(mtpkit.add_mtp(mtpkit.build_model(dict(TINY_MODEL)), 2), tmp_path / "init")

    def trunk_after(mtp: dict, run: str) -> dict:
        trainer = Trainer(config_from_dict({
            **raw, "model": {"path": str(tmp_path / "init"), "tokenizer": raw["model"]["tokenizer"]},
            "mtp": {**mtp, "init": "checkpoint"}, "train": {**raw["train"], "steps": 3, "grad_clip": 0.05,
                                                            "run_dir": str(tmp_path / run)},
            "checkpoint": {"every": 0, "save_final": False}}))
        trainer.fit()
        return {k: v for k, v in trainer.model.state_dict().items() if not k.startswith("mtp.")}

    detached = trunk_after({"depth": 2, "mtp_lambda": 3.0, "detach_trunk": True}, "detached")
    plain = trunk_after({"depth": 0}, "plain")
    assert detached.keys() == plain.keys()
    for k, v in plain.items():
        assert torch.allclose(detached[k], v, rtol=1e-5, atol=1e-7), k
