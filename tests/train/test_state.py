"""Training checkpoints as honest state: nothing unpickled by mtpkit, a resume that applies changed optimizer
settings and refuses a changed model, a fallback from a truncated or unreadable newest checkpoint, stray
directories ignored, and a NaN stop that never calls the checkpoint holding the NaN-producing weights "good"."""

import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from train_runs import TINY_MODEL, read_metrics, tiny_config

from mtpkit.checkpoint.hf import CheckpointError
from mtpkit.cli import main
from mtpkit.train.state import latest_checkpoint, list_checkpoints
from mtpkit.train.optim import lr_factor


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4 (lr 3e-3, one warmup step)."""
    from mtpkit.train.trainer import train

    root = tmp_path_factory.mktemp("base")
    train(tiny_config(root, train={"steps": 4}, checkpoint={"every": 2}))
    return root


@pytest.fixture
def run(trained, tmp_path):
    """A private copy of the trained run; `run.config(**sections)` is its config with overrides."""
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _trainer(root, **sections):
    from mtpkit.train.trainer import Trainer

    sections.setdefault("train", {})
    sections["train"] = {"steps": 4, **sections["train"]}
    sections.setdefault("checkpoint", {"every": 2})
    return Trainer(tiny_config(root, **sections))


def _ckpt(root, step):
    return root / "run" / "checkpoints" / f"step-{step:08d}"


def test_no_torch_load_of_pickles_anywhere():
    src = Path(__file__).parents[2] / "mtpkit"
    offenders = [str(p) for p in src.rglob("*.py") if re.search(r"weights_only\s*=\s*False", p.read_text())]
    assert offenders == []


def test_checkpoint_files_are_json_and_dcp(run):
    files = sorted(p.name for p in _ckpt(run, 4).iterdir())
    assert files == [".metadata", "__0_0.distcp", "complete.json", "rng-rank0.json", "train_state.json"]
    marker = json.loads((_ckpt(run, 4) / "complete.json").read_text())
    assert marker["step"] == 4 and set(marker["files"]) == set(files) - {"complete.json"}


def test_a_crafted_pickle_in_a_checkpoint_is_never_run(run):
    class Boom:
        def __reduce__(self):
            return os.system, (f"touch {run / 'pwned'}",)

    for name in ("train_state.pt", "rng-rank0.pt"):  # the old format's files, as an attacker would plant them
        (_ckpt(run, 4) / name).write_bytes(pickle.dumps(Boom()))
    trainer = _trainer(run)
    assert trainer.step == 4 and not (run / "pwned").exists()


def test_resume_applies_a_changed_lr_and_logs_it(run, caplog):
    with caplog.at_level(logging.INFO, logger="mtpkit"):
        trainer = _trainer(run, optim={"lr": 1e-3}, train={"steps": 8})
    assert trainer.step == 4
    want = 1e-3 * lr_factor(4, 8, 1)  # the new peak lr under the new schedule, at the resumed step
    assert all(g["lr"] == pytest.approx(want, rel=1e-12) for g in trainer.optimizer.param_groups)
    assert trainer.scheduler.base_lrs == [1e-3] * len(trainer.optimizer.param_groups)
    assert "optim.lr 0.003 -> 0.001" in caplog.text and "train.steps 4 -> 8" in caplog.text
    rec = trainer.train_step()
    assert rec["lr"] == pytest.approx(want, rel=1e-12)
    # power: the saved optimizer state alone would have kept the old peak lr
    assert rec["lr"] != pytest.approx(3e-3 * lr_factor(4, 8, 1), rel=1e-3)


@pytest.mark.parametrize("sections, message", [
    (dict(mtp={"depth": 1}), r"mtp_num_hidden_layers 2 -> 1"),
    (dict(mtp={"depth": 2, "layers": 1}), r"mtp_num_hidden_layers 2 -> 1"),
    (dict(mtp={"only": True}), r"mtp\.only False -> True"),
    (dict(model={"config": dict(TINY_MODEL, intermediate_size=48)}), r"intermediate_size 64 -> 48"),
])
def test_resume_refuses_a_changed_model(run, sections, message):
    with pytest.raises(CheckpointError, match=message) as e:
        _trainer(run, **sections)
    assert "\n" not in str(e.value) and "start a new train.run_dir" in str(e.value)


def test_truncated_latest_checkpoint_falls_back_with_a_warning(run, caplog):
    shard = _ckpt(run, 4) / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    assert latest_checkpoint(run / "run").name == "step-00000002"
    with caplog.at_level(logging.WARNING, logger="mtpkit"):
        trainer = _trainer(run)
    assert trainer.step == 2 and trainer.last_checkpoint == _ckpt(run, 2)
    assert re.search(r"skipping checkpoint: .*step-00000004 .*__0_0\.distcp has \d+ bytes.*trying the previous",
                     caplog.text)


def test_unreadable_latest_checkpoint_falls_back(run, caplog):
    """Same sizes, garbage content: torch's CheckpointException (a BaseException) must not escape."""
    meta = _ckpt(run, 4) / ".metadata"
    meta.write_bytes(bytes(meta.stat().st_size))
    with caplog.at_level(logging.WARNING, logger="mtpkit"):
        trainer = _trainer(run)
    assert trainer.step == 2 and "cannot be read by torch.distributed.checkpoint" in caplog.text


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(run):
    for step in (2, 4):
        (_ckpt(run, step) / "complete.json").unlink()
    with pytest.raises(CheckpointError, match=r"none of the 2 checkpoints in .* is usable"):
        _trainer(run)
    assert len(read_metrics(run / "run")) == 4  # the metrics of the earlier run are kept


def test_stray_directories_are_ignored_by_resume_and_export(run, tmp_path_factory):
    shutil.copytree(_ckpt(run, 2), run / "run" / "checkpoints" / "step-00000004.bak")
    (run / "run" / "checkpoints" / "step-00000009.tmp").mkdir()
    assert [p.name for p in list_checkpoints(run / "run")] == ["step-00000002", "step-00000004"]
    assert _trainer(run).step == 4
    out = tmp_path_factory.mktemp("export") / "hf"
    assert main(["export", str(run / "run"), "--out", str(out)]) == 0


def test_export_refuses_a_non_empty_target_unless_overwrite(run, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    assert main(["export", str(run / "run"), "--out", str(out)]) == 2
    assert "already holds model.safetensors: pass overwrite=True (CLI: --overwrite)" in capsys.readouterr().err
    assert main(["export", str(run / "run"), "--out", str(out), "--overwrite"]) == 0
    assert (out / "model.safetensors").stat().st_size > 100


def test_nan_from_the_checkpointed_weights_sets_that_checkpoint_aside(tmp_path):
    """Checkpoints every step; the forward of step 3 gives NaN. Its input weights are exactly those of
    step-00000002, so resuming from that one (at any lr) would only repeat the NaN: it is set aside, and the
    message names step-00000001 as the last good checkpoint."""
    from mtpkit.train.trainer import NonFiniteLoss

    trainer = _trainer(tmp_path, train={"steps": 6}, checkpoint={"every": 1, "keep": 2})
    calls = {"n": 0}

    def poison(module, args, output):  # 2 micro-batches per step: from step 3 on, NaN
        calls["n"] += 1
        return output * float("nan") if calls["n"] > 4 else output

    trainer.model.model.layers[0].register_forward_hook(poison)
    with pytest.raises(NonFiniteLoss) as e:
        trainer.fit()
    msg = str(e.value)
    assert "step 3" in msg and "step-00000002 holds these weights and was set aside as step-00000002.diverged" in msg
    assert "the last good checkpoint is" in msg and msg.count("step-00000001") == 1
    assert "with a lower optim.lr" in msg and "\n" not in msg
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-00000001"]
    assert (tmp_path / "run" / "checkpoints" / "step-00000002.diverged").is_dir()
    resumed = _trainer(tmp_path, train={"steps": 6}, optim={"lr": 1e-3}, checkpoint={"every": 1, "keep": 2})
    assert resumed.step == 1 and resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_factor(1, 6, 1))
    assert torch.isfinite(torch.tensor(resumed.train_step()["loss"]))


def test_a_refused_resume_leaves_the_run_files_as_they_were(run):
    """Another model config in an existing run: refused, and config.toml / model_config.json still describe the
    weights there (before the fix they were overwritten first, and export paired the new config with them)."""
    before = {name: (run / "run" / name).read_bytes() for name in ("config.toml", "model_config.json")}
    with pytest.raises(CheckpointError, match="intermediate_size 64 -> 48"):
        _trainer(run, model={"config": dict(TINY_MODEL, intermediate_size=48)})
    assert {name: (run / "run" / name).read_bytes() for name in before} == before


def test_a_second_trainer_on_one_run_dir_is_refused(run):
    from mtpkit.locking import OutputBusy

    first = _trainer(run, train={"steps": 6})
    with pytest.raises(OutputBusy, match=r"run directory .*run is being written by another process \(pid \d+") as e:
        _trainer(run, train={"steps": 6})
    assert "\n" not in str(e.value)
    first.fit()
    assert first.step == 6 and _trainer(run, train={"steps": 6}).step == 6  # released once the first has finished


def test_a_full_disk_during_a_save_is_one_line_naming_the_last_good_checkpoint(run, monkeypatch):
    import errno

    import torch.distributed.checkpoint as dcp

    real = dcp.save

    def fills_the_disk(state, checkpoint_id):  # writes part of the checkpoint, then the disk is full
        real(state, checkpoint_id=checkpoint_id)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp, "save", fills_the_disk)
    trainer = _trainer(run, train={"steps": 6}, checkpoint={"every": 1})
    with pytest.raises(CheckpointError) as e:
        trainer.fit()
    msg = str(e.value)
    assert "\n" not in msg and "No space left on device" in msg and "partial files were removed" in msg
    assert f"The last good checkpoint is {_ckpt(run, 4)}:" in msg
    assert sorted(p.name for p in (run / "run" / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    monkeypatch.setattr(dcp, "save", real)
    assert _trainer(run, train={"steps": 6}).step == 4  # power: the run resumes from it
