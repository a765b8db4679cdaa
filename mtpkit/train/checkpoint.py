"""Training checkpoints with torch.distributed.checkpoint (DCP), and export to an HF-layout directory.

A checkpoint is `RUN_DIR/checkpoints/step-NNNNNNNN/`:
    .metadata, __R_0.distcp   model and optimizer state, sharded (each rank writes its own shards; DCP reshards
                              on load, so a run saved on N ranks resumes on M ranks, or exports on one)
    train_state.pt            step, scheduler, data position (rows consumed + data fingerprint), world size
    rng-rank{R}.pt            python / numpy / torch (and CUDA) RNG state of rank R
It is written to `step-NNNNNNNN.tmp/` and renamed once every rank has finished, so a run killed while saving
never leaves a checkpoint that looks complete. The run directory also holds what export needs: config.toml,
model_config.json (the model's config.json) and tokenizer/.
"""

from __future__ import annotations

import contextlib
import logging
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger("mtpkit")

_STEP_PREFIX = "step-"


@contextlib.contextmanager
def _quiet():
    """DCP warns on every call that it runs without a process group; that is the intended single-process use."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        yield


def checkpoint_root(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.exists():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_STEP_PREFIX) and not p.name.endswith(".tmp")
            and (p / ".metadata").exists() and (p / "train_state.pt").exists()]
    return sorted(done, key=lambda p: int(p.name[len(_STEP_PREFIX):]))


def latest_checkpoint(run_dir) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir, step: int, model, optimizer, scheduler, loader, dist, keep: int = 2) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ..parallel.distributed import barrier, broadcast_object

    root = checkpoint_root(run_dir)
    final = root / f"{_STEP_PREFIX}{step:08d}"
    tmp = root / f"{final.name}.tmp"
    if dist.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier(dist)
    with _quiet():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng-rank{dist.rank}.pt")
    if dist.is_main:
        torch.save({"step": step, "scheduler": scheduler.state_dict(), "data": loader.state_dict(),
                    "world": dist.world}, tmp / "train_state.pt")
    barrier(dist)
    if dist.is_main:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(dist)
    return broadcast_object(final, dist)


def load_checkpoint(path, model, optimizer, scheduler, loader, dist) -> int:
    """Restore model, optimizer, scheduler, data position and (this rank's) RNG. Returns the step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    if not (path / ".metadata").exists() or not (path / "train_state.pt").exists():
        raise FileNotFoundError(f"{path} is not a complete mtpkit checkpoint (no .metadata / train_state.pt)")
    with _quiet():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train_state = torch.load(path / "train_state.pt", weights_only=False)
    scheduler.load_state_dict(train_state["scheduler"])
    loader.load_state_dict(train_state["data"])
    rng = path / f"rng-rank{dist.rank}.pt"
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))
    else:
        logger.warning("%s has no RNG state for rank %d (saved on %d ranks): RNG streams restart from the seed",
                       path, dist.rank, train_state.get("world", 1))
    return int(train_state["step"])


def load_model_weights(path, model) -> None:
    """Only the model weights of a checkpoint, into a (single-process, unsharded) model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    with _quiet():
        sd = get_model_state_dict(model)
        dcp.load({"model": sd}, checkpoint_id=str(path))
        set_model_state_dict(model, sd)


def resolve_checkpoint(run_or_ckpt) -> tuple[Path, Path]:
    """A run directory (its newest checkpoint) or a checkpoint directory -> (run_dir, checkpoint)."""
    p = Path(run_or_ckpt)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist")
    if (p / ".metadata").exists():
        return p.parent.parent, p
    ckpt = latest_checkpoint(p)
    if ckpt is None:
        raise FileNotFoundError(f"{p} is neither a checkpoint nor a run directory with checkpoints/step-*")
    return p, ckpt


def export(run_or_ckpt, out_dir, dtype: torch.dtype | None = None, mtp_only: bool = False) -> Path:
    """Write a training checkpoint as an HF-layout model directory: config.json (mtp_num_hidden_layers set),
    safetensors with `mtp.*` under the names vLLM and SGLang load, and the run's tokenizer files. With `mtp_only`,
    `out_dir` is instead one .safetensors file holding just the `mtp.*` tensors (a head for `--mtp`)."""
    import json

    from ..checkpoint.hf import build_model, save_model
    from .config import load_config
    from ..tokenizer import load_tokenizer
    from .trainer import build_train_model

    run_dir, ckpt = resolve_checkpoint(run_or_ckpt)
    cfg_path, raw_path = run_dir / "config.toml", run_dir / "model_config.json"
    if not cfg_path.exists() or not raw_path.exists():
        raise FileNotFoundError(f"{run_dir} lacks config.toml / model_config.json: is it an mtpkit run directory?")
    cfg = load_config(cfg_path)
    source = cfg.model.path
    if source is not None and Path(source).expanduser().exists():
        model = build_train_model(cfg)  # same structure as in training; keeps tensors the run did not train (vision)
    else:
        model = build_model(json.loads(raw_path.read_text()), vision=cfg.data.images)
    load_model_weights(ckpt, model)
    if mtp_only:
        from ..checkpoint.mtp_head import save_mtp_head

        return save_mtp_head(model, out_dir, dtype)
    if dtype is not None:
        model = model.to(dtype)
    tok_dir = run_dir / "tokenizer"
    tokenizer = load_tokenizer(tok_dir) if tok_dir.exists() else None
    out = save_model(model, out_dir, tokenizer)
    if (tok_dir / "preprocessor_config.json").exists():  # an image-trained run: the model takes images
        shutil.copy2(tok_dir / "preprocessor_config.json", out / "preprocessor_config.json")
    logger.info("exported %s (step %s) to %s", ckpt, ckpt.name[len(_STEP_PREFIX):].lstrip("0") or "0", out)
    return out
