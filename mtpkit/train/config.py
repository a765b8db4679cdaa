"""Training configuration: a TOML file -> dataclasses, with `--section.key=value` overrides.

Every section is a dataclass below; its fields are the valid keys. An unknown section or key is an error that
names it and lists the valid ones, so a typo never silently trains with a default.

    cfg = load_config("configs/shakespeare_qwen35_tiny.toml", ["--train.steps=10", "--optim.lr=1e-3"])
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigKeyError(ValueError):
    """An unknown section/key or a value of the wrong type in a training config."""


@dataclass
class ModelSection:
    path: str | None = None  # HF model directory or .gguf file to start from
    config: dict | str | None = None  # or: a config.json dict / path, to train from scratch (mtpkit.build_model)
    tokenizer: str | None = None  # HF tokenizer directory; default: model.path
    dtype: str = "float32"  # parameter dtype (keep float32 for training; autocast is train.autocast)


@dataclass
class MTPSection:
    depth: int = 1  # D: number of MTP depths trained (0: plain next-token training, no MTP module)
    # "sequential": the MTP module (DeepSeek-V3 / Qwen3.5 layout, chained depths) | "parallel": D parallel heads
    # (Gloeckle et al. 2024: one decoder layer each over the trunk's hidden, trained with the per-head backward;
    # mtpkit's own checkpoint layout, see docs/MTP.md)
    kind: str = "sequential"
    layers: int = 0  # MTP decoder layers of a new head (0: = depth); depths beyond them reuse the last layer
    init: str = "checkpoint"  # "checkpoint" (the model's own head) | "random" | "last_layer" (copy trunk's last layer)
    init_from: str | None = None  # init = "checkpoint" from this head file (`mtpkit export --mtp-only`): warm start
    only: bool = False  # MTP-only: trunk, embedding and lm_head frozen; only mtp.* is trained
    detach_trunk: bool = False  # joint, isolated: the trunk learns from the main loss only, mtp.* from the MTP loss
    # depths >= 2 attend to what a draft chain reads from the decode cache (depth 1's keys, then the chain's own),
    # not to their own depth's rows (models/mtp.py `_DraftedKV`); needs one shared MTP layer
    as_drafted: bool = False
    mtp_lambda: float = 0.1  # total MTP weight; depth d gets mtp_lambda / D unless `weights` is given
    weights: list[float] | None = None  # explicit per-depth weights, e.g. [0.51, 0.31, 0.18]
    lambda_schedule: list[list[float]] | None = None  # [[step, lambda], ...]: lambda from that step on
    depth_curriculum: list[list[int]] | None = None  # [[step, depths], ...]: number of trained depths from that step on
    ce_chunk_tokens: int = 2048  # cross-entropy chunk: logits of at most this many tokens exist at once
    # "hard": CE on the data's tokens | "soft": CE against the trunk's stored top-k distribution at the target
    # (the rest of its mass as one bucket; EAGLE-3 / Medusa-2 self-distillation) | "greedy": CE on the trunk's
    # stored top-1 there (what greedy verification accepts, also on text the trunk did not write); the last two
    # need data.mode = "features" built with --topk
    head_loss: str = "hard"
    # MTP CE over the N most frequent target ids of the training data (FR-Spec; with head_loss = "greedy", of the
    # trunk's top-1 at the targets); 0: over the ids the checkpoint's head drafts from if it has them
    # (draft_vocab.json), else over the full vocabulary
    draft_vocab: int = 0

    def __post_init__(self):
        """The checks of this section alone, so that one built in code (the loss takes it as its config) is as
        valid as one read from a file."""
        if self.depth < 0:
            raise ConfigKeyError(f"mtp.depth must be >= 0, not {self.depth}")
        if self.only and self.depth == 0:
            raise ConfigKeyError("mtp.only needs mtp.depth >= 1")
        if self.detach_trunk and (self.only or self.depth == 0):
            raise ConfigKeyError("mtp.detach_trunk needs mtp.depth >= 1 and mtp.only = false (mtp.only freezes the "
                                 "trunk)")
        if self.kind == "parallel" and self.layers not in (0, self.depth):
            raise ConfigKeyError(f"mtp.layers = {self.layers}, but parallel heads are one layer each: leave "
                                 f"mtp.layers = 0 (or {self.depth}, = mtp.depth)")
        if self.kind == "parallel" and (self.depth == 0 or self.detach_trunk):
            raise ConfigKeyError("mtp.kind = 'parallel' needs mtp.depth >= 1 (the number of heads) and "
                                 "mtp.detach_trunk = false (the heads share the trunk's final norm)")
        if self.as_drafted and (self.kind != "sequential" or self.layers not in (0, 1) or self.depth < 2):
            raise ConfigKeyError("mtp.as_drafted trains chained depths of one shared MTP layer: it needs mtp.kind = "
                                 "'sequential', mtp.depth >= 2 and a one-layer head (mtp.layers = 1)")
        if self.mtp_lambda < 0:
            raise ConfigKeyError(f"mtp.mtp_lambda must be >= 0, not {self.mtp_lambda}")
        if self.weights is not None:
            if len(self.weights) != self.depth:
                raise ConfigKeyError(f"mtp.weights has {len(self.weights)} entries but mtp.depth is {self.depth}")
            if self.weights and min(self.weights) < 0:
                raise ConfigKeyError(f"mtp.weights must be >= 0, not {self.weights}")
            if self.lambda_schedule is not None:
                raise ConfigKeyError("mtp.weights replace mtp.mtp_lambda: set mtp.weights or mtp.lambda_schedule, "
                                     "not both")
        for name in ("lambda_schedule", "depth_curriculum"):
            schedule = getattr(self, name)
            if schedule is None:
                continue
            pairs = all(isinstance(x, list) and len(x) == 2 for x in schedule)
            steps = [s for s, _ in schedule] if pairs else []
            if not steps or steps[0] != 0 or any(a >= b for a, b in zip(steps, steps[1:])):
                raise ConfigKeyError(f"mtp.{name} must be a list of [step, value] pairs with steps increasing from "
                                     f"0, not {schedule!r}")
        if self.depth_curriculum is not None and not all(1 <= n <= self.depth for _, n in self.depth_curriculum):
            raise ConfigKeyError(f"mtp.depth_curriculum values must lie in 1..mtp.depth ({self.depth}), not "
                                 f"{self.depth_curriculum}")
        if self.ce_chunk_tokens < 1:
            raise ConfigKeyError(f"mtp.ce_chunk_tokens must be >= 1, not {self.ce_chunk_tokens}")
        if self.draft_vocab < 0:
            raise ConfigKeyError(f"mtp.draft_vocab must be >= 0 (0: the full vocabulary), not {self.draft_vocab}")


@dataclass
class DataSection:
    paths: list[str] = field(default_factory=list)  # files or directories (.txt, .jsonl, .parquet)
    format: str = "auto"  # "auto" (by extension) | "text" | "jsonl" | "parquet"
    # "pretrain" (loss on every token) | "sft" (chat `messages`, assistant-only loss) | "tokens" (pre-tokenized
    # `input_ids` with an optional 0/1 `loss_mask` per token, as `mtpkit distill` writes) | "features" (the
    # trunk's stored hidden states from `mtpkit features`, for mtp.only training without the trunk)
    mode: str = "pretrain"
    # data.mode = "features": the directory `mtpkit features --out` (or `distill --features`) wrote, or a list of them
    features: str | list[str] | None = None
    text_field: str = "text"  # JSONL/Parquet column holding the text (pretrain)
    messages_field: str = "messages"  # JSONL/Parquet column holding chat messages (sft)
    text_split: str = "file"  # plain text: one document per "file" | "paragraph" (blank line) | "line"
    seq_len: int = 512  # packed row length in tokens
    add_bos: bool = True  # prepend the tokenizer's BOS token (if it has one) to every pretraining document
    add_eos: bool = True  # append the tokenizer's EOS token (if it has one) to every pretraining document
    shuffle: bool = True  # shuffle documents and packed rows, with a fresh permutation per epoch
    seed: int = 1234
    val_docs: int = 0  # documents held out (a seeded choice) for evaluation (train.eval_every)
    images: bool = False  # records carry images (mtpkit.data.images): a vision-language model is trained
    image_field: str = "image"  # pretrain records: the image path (or list of paths) placed before the text
    # pack documents whole: none spans two rows (rows end in padding; a longer one is refused), so every target's
    # MTP attention sees its document from the start (distilled records of a prompt and its continuation)
    whole_documents: bool = False
    # every token a target, the records' loss masks (prompts, user turns) set aside (axolotl's train_on_inputs); with
    # mtp.head_loss = "greedy" a head then learns the trunk's own next tokens over the prompts too
    train_on_inputs: bool = False


@dataclass
class TrainSection:
    run_dir: str = "runs/default"  # checkpoints, metrics.jsonl, config, tokenizer and plots go here
    steps: int = 100  # optimizer steps
    batch_size: int = 8  # global batch, in packed rows per optimizer step (over all ranks and micro-batches)
    micro_batch_size: int = 0  # rows per forward/backward on one rank (0: the whole per-rank batch)
    grad_clip: float = 1.0  # max global gradient norm (0: no clipping)
    autocast: str = "auto"  # "auto" (bf16 on CUDA when supported, else fp32) | "bf16" | "fp32"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    seed: int = 0  # model init and RNG seed
    threads: int = 0  # torch CPU threads (0: torch's default)
    eval_every: int = 0  # evaluate on the held-out documents (data.val_docs) every N steps and at the end
    eval_rows: int = 16  # held-out packed rows per evaluation (the same rows every time)


@dataclass
class OptimSection:
    lr: float = 3e-4  # peak learning rate of the trunk
    lr_mtp: float | None = None  # peak learning rate of mtp.* parameters (default: lr)
    weight_decay: float = 0.1  # on matrices; norms, biases and 1-D parameters get none
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 0  # linear warmup from 0 to the peak
    schedule: str = "cosine"  # "cosine" (to min_lr_ratio * peak at the last step) | "constant"
    min_lr_ratio: float = 0.1


@dataclass
class CheckpointSection:
    every: int = 0  # save a DCP checkpoint every N steps (0: only at the end and on SIGINT/SIGTERM)
    keep: int = 2  # keep the newest N checkpoints
    resume: str = "auto"  # "auto" (newest checkpoint in run_dir, if any) | "none" | a checkpoint directory
    save_final: bool = True  # save after the last step


@dataclass
class ParallelSection:
    dp_shard: int = -1  # data-parallel (FSDP2) replicas; -1: the torchrun world size / tp
    tp: int = 1  # tensor-parallel degree: heads, intermediate dims and vocabulary sharded (world = dp_shard x tp)
    fsdp: str = "auto"  # "auto" (when launched with several ranks) | "on" | "off"
    reshard_after_forward: bool = True
    ac: str = "none"  # activation checkpointing per block: "none" | "full"
    compile: bool = False  # torch.compile each block (trunk and MTP layers)


@dataclass
class LogSection:
    every: int = 1  # log line and metrics record every N steps
    progress: bool = True  # tqdm progress bar (rank 0)
    tensorboard: bool = False  # also write TensorBoard scalars to run_dir/tb (needs the tensorboard package)
    peak_tflops: float = 0.0  # peak dense TFLOP/s per device for MFU (0: known GPUs only, none on CPU)


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    mtp: MTPSection = field(default_factory=MTPSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    log: LogSection = field(default_factory=LogSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
_SECTION_TYPES = {f.name: type(f.default_factory()) for f in dataclasses.fields(TrainConfig)}
_CHOICES = {
    ("mtp", "init"): ("checkpoint", "random", "last_layer"),
    ("mtp", "kind"): ("sequential", "parallel"),
    ("data", "format"): ("auto", "text", "jsonl", "parquet"),
    ("data", "mode"): ("pretrain", "sft", "tokens", "features"),
    ("mtp", "head_loss"): ("hard", "soft", "greedy"),
    ("data", "text_split"): ("file", "paragraph", "line"),
    ("train", "autocast"): ("auto", "bf16", "fp32"),
    ("train", "device"): ("auto", "cpu", "cuda"),
    ("optim", "schedule"): ("cosine", "constant"),
    ("parallel", "fsdp"): ("auto", "on", "off"),
    ("parallel", "ac"): ("none", "full"),
    ("model", "dtype"): ("float32", "bfloat16", "float16"),
}


def valid_keys(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(_SECTION_TYPES[section])]


def _check_type(section: str, key: str, value: Any, annotation: str) -> Any:
    """Light type check against the field's annotation string; ints are accepted where floats are expected."""
    name = f"{section}.{key}"
    ann = annotation.replace(" ", "")
    if value is None:
        if "None" not in ann:
            raise ConfigKeyError(f"{name} cannot be empty")
        return None
    base = ann.split("|")
    if isinstance(value, bool):
        if "bool" not in base:
            raise ConfigKeyError(f"{name} expects {annotation}, got a boolean ({value})")
        return value
    if "float" in base and isinstance(value, int):
        return float(value)
    for kind, typ in (("int", int), ("float", float), ("str", str), ("dict", dict)):
        if kind in base and isinstance(value, typ):
            return value
    if any(b.startswith("list") for b in base) and isinstance(value, list):
        return value
    if "dict" in base and "str" in base and isinstance(value, str):
        return value
    raise ConfigKeyError(f"{name} expects {annotation}, got {type(value).__name__} ({value!r})")


def _section_from_dict(section: str, values: dict) -> Any:
    cls = _SECTION_TYPES[section]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigKeyError(
                f"unknown config key '{section}.{key}'; valid keys in [{section}]: {', '.join(fields)}"
            )
        kwargs[key] = _check_type(section, key, value, str(fields[key].type))
        choices = _CHOICES.get((section, key))
        if choices and kwargs[key] not in choices:
            raise ConfigKeyError(f"{section}.{key} = {value!r} is not one of: {', '.join(choices)}")
    return cls(**kwargs)


def config_from_dict(raw: dict) -> TrainConfig:
    for section, values in raw.items():
        if section not in _SECTION_TYPES:
            raise ConfigKeyError(
                f"unknown config section '[{section}]'; valid sections: {', '.join(_SECTION_TYPES)}"
            )
        if not isinstance(values, dict):
            raise ConfigKeyError(f"'{section}' must be a [section] table, not a value ({values!r})")
    cfg = TrainConfig(**{s: _section_from_dict(s, raw.get(s, {})) for s in _SECTION_TYPES})
    validate(cfg)
    return cfg


def parse_value(text: str) -> Any:
    """A TOML value (`3`, `1e-4`, `true`, `[0.5, 0.3]`, `"x"`); anything that is not valid TOML is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `--section.key=value` (or `section.key=value`) overrides to a raw config dict, in order."""
    for item in overrides:
        arg = item[2:] if item.startswith("--") else item
        if "=" not in arg or "." not in arg.split("=", 1)[0]:
            raise ConfigKeyError(f"override {item!r} must look like --section.key=value")
        dotted, value = arg.split("=", 1)
        section, key = dotted.split(".", 1)
        if section not in _SECTION_TYPES:
            raise ConfigKeyError(
                f"unknown config section '{section}' in override {item!r}; valid sections: {', '.join(_SECTION_TYPES)}"
            )
        if key not in valid_keys(section):
            raise ConfigKeyError(
                f"unknown config key '{section}.{key}' in override {item!r}; "
                f"valid keys in [{section}]: {', '.join(valid_keys(section))}"
            )
        raw.setdefault(section, {})[key] = parse_value(value)
    return raw


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> TrainConfig:
    """Read a TOML config (or start from defaults when path is None) and apply overrides."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"config file {p} does not exist")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigKeyError(f"{p} is not valid TOML: {e}") from None
    return config_from_dict(apply_overrides(raw, list(overrides)))


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks that no single type can express (the [mtp] section checks its own fields when built)."""
    if cfg.model.path is None and cfg.model.config is None:
        raise ConfigKeyError("set model.path (HF directory or .gguf) or model.config (config.json dict/path)")
    if cfg.model.path is not None and cfg.model.config is not None:
        raise ConfigKeyError("set only one of model.path and model.config")
    if cfg.data.seq_len < 2:
        raise ConfigKeyError(f"data.seq_len must be >= 2, not {cfg.data.seq_len}")
    if cfg.mtp.depth and cfg.data.seq_len <= cfg.mtp.depth + 1:
        raise ConfigKeyError(
            f"data.seq_len = {cfg.data.seq_len} leaves no MTP target at depth {cfg.mtp.depth}: use seq_len > depth + 1"
        )
    for key in ("steps", "batch_size"):
        if getattr(cfg.train, key) < 1:
            raise ConfigKeyError(f"train.{key} must be >= 1")
    if cfg.train.micro_batch_size < 0:
        raise ConfigKeyError("train.micro_batch_size must be >= 0")
    if cfg.optim.warmup_steps < 0 or cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 1:
        raise ConfigKeyError("optim.warmup_steps and checkpoint.every must be >= 0, checkpoint.keep >= 1")
    if cfg.data.images and cfg.data.mode == "tokens":
        raise ConfigKeyError("data.images needs data.mode = 'pretrain' or 'sft' (pre-tokenized data has no images)")
    if (cfg.data.mode == "features") != (cfg.data.features is not None):
        raise ConfigKeyError("data.mode = 'features' and data.features = DIR (from `mtpkit features`) go together")
    if cfg.data.train_on_inputs and cfg.data.images:
        raise ConfigKeyError("data.train_on_inputs would make image placeholder tokens targets: set it false for "
                             "image data")
    if cfg.data.mode == "features" and not cfg.mtp.only:
        raise ConfigKeyError("data.mode = 'features' trains the MTP head alone on a frozen trunk: set mtp.only = true")
    if cfg.mtp.init_from is not None and (cfg.mtp.init != "checkpoint" or cfg.model.path is None):
        raise ConfigKeyError("mtp.init_from (a head file to start from) goes with mtp.init = 'checkpoint' and a "
                             "model.path")
    if cfg.mtp.head_loss != "hard" and cfg.data.mode != "features":
        raise ConfigKeyError(f"mtp.head_loss = {cfg.mtp.head_loss!r} needs the trunk's stored top-k: data.mode = "
                             "'features' with features built by `mtpkit features --topk K`")
    if cfg.train.eval_every and not cfg.data.val_docs:
        raise ConfigKeyError("train.eval_every needs held-out documents: set data.val_docs")
    if cfg.log.every < 1:
        raise ConfigKeyError("log.every must be >= 1")
    if cfg.parallel.tp < 1 or cfg.parallel.dp_shard == 0 or cfg.parallel.dp_shard < -1:
        raise ConfigKeyError("parallel.tp must be >= 1 and parallel.dp_shard >= 1 (or -1: world size / tp)")
    if cfg.parallel.tp > 1 and cfg.parallel.fsdp == "off":
        raise ConfigKeyError("parallel.tp > 1 needs FSDP2 on the data-parallel mesh (it reduces the gradients of "
                             "tp-replicated weights): set parallel.fsdp = 'auto'")
    if cfg.parallel.tp > 1 and cfg.data.images:
        raise ConfigKeyError("parallel.tp > 1 supports text models (the vision tower has no tensor-parallel plan): "
                             "set parallel.tp = 1 for image data")
    if cfg.parallel.tp > 1 and (cfg.mtp.head_loss == "soft" or cfg.mtp.draft_vocab):
        raise ConfigKeyError("parallel.tp > 1 computes the hard CE over vocabulary shards only: use "
                             "mtp.head_loss = 'hard' and mtp.draft_vocab = 0, or parallel.tp = 1")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v) if v == v and abs(v) != float("inf") else ("nan" if v != v else ("inf" if v > 0 else "-inf"))
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML (None values omitted), saved in the run directory."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
        lines.append("")
    return "\n".join(lines)
