"""Training state: checkpoints of a run with torch.distributed.checkpoint (DCP), saved, resumed and found.

A checkpoint is `RUN_DIR/checkpoints/step-NNNNNNNN/`:
    .metadata, __R_0.distcp   model and optimizer state, sharded (each rank writes its own shards; DCP reshards
                              on load, so a run saved on N ranks resumes on M ranks, or exports on one)
    train_state.json          step, scheduler, data position (rows consumed + data fingerprint), world size, and
                              the run's config (train config + model config.json) to compare with on resume
    rng-rank{R}.json          python / numpy / torch (and CUDA) RNG state of rank R
    complete.json             written last: the size of every file above
It is written to `step-NNNNNNNN.tmp/`, fsynced, and renamed once every rank has finished, so a run killed while
saving never leaves a checkpoint that looks complete. On resume a checkpoint whose files do not have the sizes
complete.json records (truncated, half-copied) or that fails to load is skipped with a warning, and the previous
one is used. Nothing here is unpickled by mtpkit (JSON only); DCP's own `.metadata` is a pickle that torch reads,
so a run directory is trusted input (docs/MTP.md, "Trust model"). The run directory also holds what export.py needs:
config.toml, model_config.json (the model's config.json) and tokenizer/.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from ..checkpoint.hf import CheckpointError
from ..checkpoint.safe_write import fsync

logger = logging.getLogger("mtpkit")

_STEP_DIR = re.compile(r"^step-(\d+)$")  # anything else (step-4.tmp, step-4.bak, step-4.diverged) is not one
MARKER = "complete.json"
_TRAIN_STATE = "train_state.json"
# changing these would train a different model than the checkpoint holds: refused on resume
_FIXED = ("mtp.depth", "mtp.layers", "mtp.only", "model.dtype", "data.images")
# where the run's model comes from: compared through the model's config.json instead
_IDENTITY = ("model.path", "model.config", "model.tokenizer", "train.run_dir", "checkpoint.resume")


class CorruptCheckpoint(CheckpointError):
    """A checkpoint whose files are incomplete or unreadable (resume falls back to the previous one)."""


@contextlib.contextmanager
def _quiet():
    """DCP warns on every call that it runs without a process group; that is the intended single-process use."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        yield


@contextlib.contextmanager
def _dcp_errors(path: Path):
    """DCP failures as one CorruptCheckpoint; torch's CheckpointException derives from BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (CheckpointException, Exception) as e:  # noqa: B014 (CheckpointException is not an Exception)
        first = str(e).strip().splitlines()
        raise CorruptCheckpoint(f"{path} cannot be read by torch.distributed.checkpoint "
                                f"({type(e).__name__}: {first[-1] if first else ''})") from None


@contextlib.contextmanager
def _save_errors(run_dir, tmp: Path):
    """A failed save (a full disk, most often) as one line naming the last good checkpoint, its partial files
    removed: left in place they keep the disk full and the resume fails the same way."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (CheckpointException, OSError) as e:  # noqa: B014 (CheckpointException is not an Exception)
        shutil.rmtree(tmp, ignore_errors=True)
        cause = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        last = latest_checkpoint(run_dir)
        raise CheckpointError(f"saving checkpoint {tmp.name.removesuffix('.tmp')} failed ({cause}); its partial "
                              f"files were removed. The last good checkpoint is {last or 'none (no step saved)'}: "
                              "free disk space, then run the same command to resume from it") from None


def checkpoint_root(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def _step_dirs(run_dir) -> list[Path]:
    """Every `step-N` directory of a run, complete or not, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    dirs = [(int(m[1]), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(dirs)]


def checkpoint_problem(path) -> str | None:
    """Why a checkpoint directory cannot be used (None when complete.json is there and every file it lists has
    the recorded size). Cheap: sizes only, no data read."""
    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        return f"it has no {MARKER} (an interrupted save, or written by an older mtpkit)"
    try:
        files = json.loads(marker.read_text())["files"]
        sizes = {str(k): int(v) for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return f"its {MARKER} is unreadable"
    for name, size in sizes.items():
        f = path / name
        if Path(name).is_absolute() or ".." in Path(name).parts or not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {MARKER} records {size} (truncated or half-copied)"
    if ".metadata" not in sizes or _TRAIN_STATE not in sizes:
        return f"its {MARKER} does not list .metadata and {_TRAIN_STATE}"
    return None


def list_checkpoints(run_dir) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    return [p for p in _step_dirs(run_dir) if checkpoint_problem(p) is None]


def latest_checkpoint(run_dir, warn: bool = False) -> Path | None:
    """The newest complete checkpoint; with `warn`, newer incomplete ones are named in a warning."""
    for p in reversed(_step_dirs(run_dir)):
        problem = checkpoint_problem(p)
        if problem is None:
            return p
        if warn:
            logger.warning("skipping checkpoint %s: %s", p, problem)
    return None


# ---------------------------------------------------------------------------------------------- JSON state files
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)


def _rng_state() -> dict:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{path} is unreadable ({e})") from None
    if not isinstance(obj, dict):
        raise CorruptCheckpoint(f"{path} does not hold a JSON object")
    return obj


# ------------------------------------------------------------------------------------------------------ save / load
def save_checkpoint(run_dir, step: int, model, optimizer, scheduler, loader, dist, keep: int = 2,
                    config: dict | None = None) -> Path:
    """Collective: every rank calls it. `config` ({"train": TrainConfig dict, "model": config.json dict}) is
    stored for the comparison on resume. Returns the checkpoint directory."""
    from ..parallel.distributed import barrier, broadcast_object

    root = checkpoint_root(run_dir)
    final = root / f"step-{step:08d}"
    tmp = root / f"{final.name}.tmp"
    with _save_errors(run_dir, tmp):
        if dist.is_main:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        barrier(dist)
        _save_files(tmp, final, step, model, optimizer, scheduler, loader, dist, config)
    if dist.is_main:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(dist)
    return broadcast_object(final, dist)


def _save_files(tmp: Path, final: Path, step: int, model, optimizer, scheduler, loader, dist,
                config: dict | None) -> None:
    """save_checkpoint's writes: the state into `tmp`, fsynced, listed in its marker, then renamed to `final`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ..parallel.distributed import barrier

    with _quiet():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    _write_json(tmp / f"rng-rank{dist.rank}.json", _rng_state())
    if dist.is_main:
        _write_json(tmp / _TRAIN_STATE, {"step": step, "scheduler": scheduler.state_dict(), "data": loader.state_dict(),
                                         "world": dist.world, "config": config})
    barrier(dist)
    if dist.is_main:
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        for p in files:
            fsync(p)
        _write_json(tmp / MARKER, {"step": step, "files": {str(p.relative_to(tmp)): p.stat().st_size for p in files}})
        fsync(tmp / MARKER)
        fsync(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        fsync(final.parent)


def _flat(train_cfg: dict) -> dict:
    return {f"{sec}.{k}": v for sec, values in train_cfg.items() for k, v in values.items()}


def _compare(path: Path, saved: dict | None, new: dict | None) -> list[str]:
    """Refuse a resume that would train another model; return the other settings that changed, as
    'key old -> new'."""
    if not saved or not new:
        return []
    new = json.loads(json.dumps(new))  # tuples as lists, as they were saved
    if saved.get("model") != new.get("model"):
        old, cur = saved.get("model") or {}, new.get("model") or {}
        keys = sorted(k for k in set(old) | set(cur) if old.get(k) != cur.get(k))
        shown = ", ".join(f"{k} {old.get(k)!r} -> {cur.get(k)!r}" for k in keys[:3])
        raise CheckpointError(f"{path} holds another model ({shown}): resume with the model it was trained with, "
                              "or start a new train.run_dir")
    old, cur = _flat(saved.get("train") or {}), _flat(new.get("train") or {})
    changed = [k for k in sorted(set(old) | set(cur)) if old.get(k) != cur.get(k) and k not in _IDENTITY]
    fixed = [f"{k} {old.get(k)!r} -> {cur.get(k)!r}" for k in changed if k in _FIXED]
    if fixed:
        raise CheckpointError(f"{path} was trained with other model settings ({', '.join(fixed)}): resume with "
                              "the same ones, or start a new train.run_dir")
    return [f"{k} {old.get(k)!r} -> {cur.get(k)!r}" for k in changed]


def _apply_hyperparameters(optimizer, scheduler, fresh: list[dict]) -> None:
    """The optimizer's hyperparameters and the schedule's peak lrs as the current config sets them (loading the
    optimizer and scheduler state restored the saved ones), and the lr of the resumed step under the new
    schedule."""
    for group, new in zip(optimizer.param_groups, fresh):
        group.update({k: v for k, v in new.items() if k != "lr"})
    scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
    for group, factor, base in zip(optimizer.param_groups, scheduler.lr_lambdas, scheduler.base_lrs):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def load_checkpoint(path, model, optimizer, scheduler, loader, dist, config: dict | None = None) -> int:
    """Restore model, optimizer, scheduler, data position and (this rank's) RNG. Returns the step.

    With `config` (as given to save_checkpoint) the saved one is compared first: a different model or MTP
    module is refused; changed optimizer and schedule settings (optim.*, train.steps) are applied and logged."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CorruptCheckpoint(f"{path} is not a complete mtpkit checkpoint: {problem}")
    train_state = _read_json(path / _TRAIN_STATE)
    changes = _compare(path, train_state.get("config"), config)
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    saved_groups = [g.get("name") for g in optimizer.param_groups]
    with _quiet(), _dcp_errors(path):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if [g.get("name") for g in optimizer.param_groups] != saved_groups:
        raise CheckpointError(f"{path} has other optimizer parameter groups than this run: start a new train.run_dir")
    try:
        scheduler.load_state_dict(train_state["scheduler"])
        loader.load_state_dict(train_state["data"])
        step = int(train_state["step"])
    except (KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpoint(f"{path / _TRAIN_STATE} is malformed ({type(e).__name__}: {e})") from None
    if changes:
        _apply_hyperparameters(optimizer, scheduler, fresh)
        if dist.is_main:
            logger.info("resuming with changed settings: %s", "; ".join(changes))
    rng = path / f"rng-rank{dist.rank}.json"
    if rng.exists():
        try:
            _set_rng_state(_read_json(rng))
        except (KeyError, TypeError, ValueError, RuntimeError, binascii.Error) as e:
            raise CorruptCheckpoint(f"{rng} is malformed ({type(e).__name__}: {e})") from None
    else:
        logger.warning("%s has no RNG state for rank %d (saved on %d ranks): RNG streams restart from the seed",
                       path, dist.rank, train_state.get("world", 1))
    return step


def resume_latest(run_dir, model, optimizer, scheduler, loader, dist, config: dict | None = None):
    """Auto-resume: (checkpoint, step) of the newest checkpoint that is complete and loads; a newer truncated or
    unreadable one is skipped with a warning. None when the run has no checkpoint; an error when it has some and
    none is usable (starting over would silently discard them)."""
    dirs = _step_dirs(run_dir)
    for path in reversed(dirs):
        try:
            return path, load_checkpoint(path, model, optimizer, scheduler, loader, dist, config)
        except CorruptCheckpoint as e:
            logger.warning("skipping checkpoint: %s; trying the previous one", e)
    if dirs:
        root = checkpoint_root(run_dir)
        raise CheckpointError(f"none of the {len(dirs)} checkpoints in {root} is usable (see the warnings above): "
                              f"delete {root} to start the run over")
    return None


def set_aside(ckpt: Path, dist) -> Path:
    """Rename a checkpoint to `step-N.diverged` (kept for inspection, ignored by resume and export): its weights
    gave a non-finite loss, so resuming from it would only repeat that."""
    from ..parallel.distributed import barrier

    aside = ckpt.with_name(ckpt.name + ".diverged")
    if dist.is_main:
        if aside.exists():
            shutil.rmtree(aside)
        ckpt.rename(aside)
    barrier(dist)
    return aside


def load_model_weights(path, model) -> None:
    """Only the model weights of a checkpoint, into a (single-process, unsharded) model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    with _quiet(), _dcp_errors(Path(path)):
        sd = get_model_state_dict(model)
        dcp.load({"model": sd}, checkpoint_id=str(path))
        set_model_state_dict(model, sd)


def resolve_checkpoint(run_or_ckpt) -> tuple[Path, Path]:
    """A run directory (its newest complete checkpoint) or a checkpoint directory -> (run_dir, checkpoint)."""
    p = Path(run_or_ckpt)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist")
    if (p / ".metadata").exists():
        problem = checkpoint_problem(p)
        if problem is not None:
            raise CorruptCheckpoint(f"{p} is not a complete checkpoint: {problem}")
        return p.parent.parent, p
    ckpt = latest_checkpoint(p, warn=True)
    if ckpt is None:
        raise FileNotFoundError(f"{p} is neither a checkpoint nor a run directory with complete checkpoints/step-*")
    return p, ckpt
