"""The model a run trains and the tokenizer it reads, from the [model] and [mtp] sections of its config."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint.hf import build_model, load_model
from ..checkpoint.mtp_head import load_mtp_head
from ..models.mtp import add_mtp
from ..models.parallel_heads import add_parallel_heads
from .config import TrainConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _raw_model_config(spec) -> dict:
    if isinstance(spec, dict):
        return json.loads(json.dumps(spec))
    p = Path(spec).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise FileNotFoundError(f"model.config: {p} does not exist")
    return json.loads(p.read_text())


def build_train_model(cfg: TrainConfig):
    """The model a run trains: loaded (model.path) or built from a config.json (model.config), with an MTP head of
    `mtp.layers or mtp.depth` layers (mtp.kind = "parallel": mtp.depth parallel heads) from the checkpoint,
    random, or copied from the trunk's last layer."""
    m = cfg.mtp
    layers = m.layers or m.depth
    dtype = _DTYPES[cfg.model.dtype]
    vision = cfg.data.images  # image data trains the vision tower too; otherwise it is carried through untouched
    parallel = m.kind == "parallel"
    add_head = add_parallel_heads if parallel else add_mtp
    if cfg.model.config is not None:
        raw = _raw_model_config(cfg.model.config)
        target = raw.get("text_config", raw)  # VLM layout: the text model's config
        key, other = ("mtp_parallel_heads", "mtp_num_hidden_layers") if parallel else \
            ("mtp_num_hidden_layers", "mtp_parallel_heads")
        target[key] = layers if m.depth and m.init != "last_layer" else 0
        target.pop(other, None)
        model = build_model(raw, dtype=dtype, vision=vision)
        if m.depth and m.init == "last_layer":
            add_head(model, layers, "last_layer")
        return model
    path = Path(cfg.model.path).expanduser()
    if m.depth == 0:
        return load_model(path, dtype=dtype, mtp=False, vision=vision)
    if m.init == "checkpoint":
        model = load_model(path, dtype=dtype, mtp=m.init_from is None, vision=vision)
        source = path
        if m.init_from is not None:
            source = Path(m.init_from).expanduser()
            load_mtp_head(model, source)
        head, what = (model.mtp_heads, "parallel heads") if parallel else (model.mtp, "MTP head")
        if head is None:
            raise ValueError(
                f"{source} has no {what} (mtp.init = 'checkpoint'): set mtp.init = 'random' or 'last_layer' to add one"
            )
        want = m.depth if parallel else m.layers  # parallel: one head per depth; sequential: 0 = the checkpoint's
        if want and want != len(head.layers):
            raise ValueError(f"mtp.{'depth' if parallel else 'layers'} = {want} but {source} has a {len(head.layers)}-"
                             f"layer {what}: match it, or use mtp.init = 'random' / 'last_layer'")
        return model
    model = load_model(path, dtype=dtype, mtp=False, vision=vision)
    return add_head(model, layers, m.init)


def tokenizer_path(cfg: TrainConfig) -> str:
    if cfg.model.tokenizer:
        return cfg.model.tokenizer
    if cfg.model.path:
        return cfg.model.path
    raise ValueError("model.config has no tokenizer: set model.tokenizer to an HF tokenizer directory")
