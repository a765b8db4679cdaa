"""Export: a training run's checkpoint -> an HF-layout model directory (`mtpkit export RUN_DIR --out DIR`), or a
head file of the MTP module alone (`--mtp-only`)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from ..checkpoint.hf import build_model, read_draft_vocab, save_model
from ..checkpoint.mtp_head import save_mtp_head
from ..checkpoint.safe_write import check_target
from ..tokenizer import load_tokenizer
from .config import load_config
from .model_setup import build_train_model
from .state import load_model_weights, resolve_checkpoint

logger = logging.getLogger("mtpkit")


def export(run_or_ckpt, out_dir, dtype: torch.dtype | None = None, mtp_only: bool = False,
           overwrite: bool = False) -> Path:
    """Write a training checkpoint as an HF-layout model directory: config.json (mtp_num_hidden_layers set),
    safetensors with `mtp.*` under the names vLLM and SGLang load (parallel heads: mtpkit's own `mtp_heads.*`), and
    the run's tokenizer files. With `mtp_only`, `out_dir` is instead one .safetensors file holding just the head's
    tensors (a head for `--mtp`). An existing
    target is refused unless `overwrite` (see `mtpkit.save_model`)."""
    check_target(Path(out_dir), overwrite, is_file=mtp_only)  # before minutes of loading
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
    if model.drafter is not None:  # trained with mtp.draft_vocab: it drafts over those ids, saved with the head
        model.drafter.draft_vocab = read_draft_vocab(run_dir, model.config.vocab_size)
    if mtp_only:
        return save_mtp_head(model, out_dir, dtype, overwrite=overwrite)
    if dtype is not None:
        model = model.to(dtype)
    tok_dir = run_dir / "tokenizer"
    tokenizer = load_tokenizer(tok_dir) if tok_dir.exists() else None
    out = save_model(model, out_dir, tokenizer, overwrite=overwrite)
    if (tok_dir / "preprocessor_config.json").exists():  # an image-trained run: the model takes images
        shutil.copy2(tok_dir / "preprocessor_config.json", out / "preprocessor_config.json")
    logger.info("exported %s (step %s) to %s", ckpt, ckpt.name[len("step-"):].lstrip("0") or "0", out)
    return out
