"""`mtpkit refresh`: bring a fine-tuned model's MTP head back in line with its trunk, from the model's own words.

Fine-tuning moves the trunk; a head that was frozen, detached, or dropped and grafted back (what transformers-based
tools leave) still drafts for the old trunk. The refresh trains the head alone (trunk, embedding and lm_head frozen)
on the fine-tuned model's own greedy continuations of the user's prompts, from the hidden states that generating
them computed anyway, so it costs one generation pass and a short head training (docs/MTP.md section 5 measures it
against training with the MTP loss).

Stages, each kept under OUT and skipped or resumed when a rerun finds it (kill it and run the same command):
  OUT/model/           the fine-tune with --head-from's head grafted in (only when --head-from is given)
  OUT/distill.jsonl    the model's continuations of the training prompts; OUT/features: their hidden states
  OUT/train/           MTP-only head training from the features (trainer checkpoints)
  OUT/hf/              the refreshed model: the fine-tune's weights with the new mtp.*, served by vLLM / SGLang as is
  OUT/report.json      mean acceptance length at k = 1..3 before and after, on prompts held out of the distillation
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np

from .checkpoint.graft import NoHead, graft, head_keys
from .checkpoint.hf import CheckpointError
from .data.packing import PackedData
from .train.config import DataSection

FASTMTP_WEIGHTS = [0.51, 0.31, 0.18]  # one shared layer trained at three chained depths, as k = 3 drafting uses it


def head_layers(model_dir) -> int:
    """The MTP layers of an HF directory's head (its config, not its tensors); a one-line error when it has none."""
    try:
        keys = head_keys(model_dir)
    except NoHead:
        raise CheckpointError(f"{model_dir} has no MTP head (mtp.*): give --head-from BASE, the model it was "
                              "fine-tuned from (or an `mtpkit export --mtp-only` head file)") from None
    return int(keys.get("mtp_num_hidden_layers") or keys["num_nextn_predict_layers"])


def split_prompts(prompts: list[dict], eval_prompts: list[dict] | None, eval_every: int) -> tuple[list, list]:
    """(training prompts, held-out prompts): every `eval_every`-th prompt is held out unless a separate held-out
    list is given."""
    if eval_prompts is not None:
        train, held = prompts, eval_prompts
    else:
        held = prompts[eval_every - 1 :: eval_every]
        train = [p for i, p in enumerate(prompts) if i % eval_every != eval_every - 1]
    if not train or not held:
        raise ValueError(f"{len(prompts)} prompts leave {len(train)} to distill and {len(held)} to evaluate: give "
                         f"at least {eval_every} prompts, or --eval-prompts FILE")
    return train, held


def check_held_out_fits(model_dir: Path, config, held: list[dict], eval_tokens: int) -> None:
    """The report's prompts checked before any work (distillation checks its own): found at the report, a prompt
    too long would cost the report after hours of distillation and training."""
    from .prompts import check_fits
    from .tokenizer import encode_prompt, load_tokenizer

    tok = load_tokenizer(model_dir)
    check_fits([encode_prompt(tok, p["prompt"], p["chat"]) for p in held], eval_tokens, config,
               what="held-out prompt", fix="shorten or drop them in the held-out prompts")


def check_draft_vocab_size(vocab_size: int, n: int) -> None:
    """A draft vocabulary larger than the model's refused before distillation, not after it."""
    if not 0 <= n <= vocab_size:
        raise ValueError(f"--draft-vocab {n} must lie in 0..{vocab_size} (the model's vocabulary; 0: the head's own)")


def train_config(model_dir, features, run_dir, *, lengths: list[int], layers: int, depth: int | None, epochs: float,
                 lr: float, batch_size: int, seq_len: int, device: str, seed: int, progress: bool,
                 as_drafted: bool = False, whole_records: bool = False, autocast: str = "fp32",
                 draft_vocab: int = 0) -> dict:
    """The MTP-only training of the head from the features of records of `lengths` tokens: `epochs` passes over
    their packed rows, cosine schedule (`as_drafted`: chained depths attend as a draft chain reads the cache,
    `[mtp] as_drafted`; `whole_records`: rows of whole records, seq_len raised to the longest; `autocast`:
    train.autocast; `draft_vocab`: the head's CE over that many of the records' most frequent ids, the ids it then
    drafts from, `[mtp] draft_vocab`)."""
    depth = depth or (3 if layers == 1 else layers)
    if whole_records:
        seq_len = max(seq_len, *lengths)
        rows = PackedData([(np.zeros(n, dtype=np.int64), None) for n in lengths], seq_len, seed=DataSection.seed,
                          min_doc_tokens=depth + 2, whole=True).rows_per_epoch
        steps = max(1, math.ceil(epochs * rows / batch_size))
    else:
        steps = max(1, math.ceil(epochs * sum(lengths) / (batch_size * seq_len)))
    return {
        "model": {"path": str(model_dir)},
        "mtp": {"depth": depth, "layers": layers, "init": "checkpoint", "only": True, "as_drafted": as_drafted,
                "draft_vocab": draft_vocab, "weights": FASTMTP_WEIGHTS if depth == 3 else [1.0 / depth] * depth},
        "data": {"mode": "features", "features": str(features), "seq_len": seq_len, "whole_documents": whole_records},
        "train": {"run_dir": str(run_dir), "steps": steps, "batch_size": batch_size, "device": device,
                  "seed": seed, "autocast": autocast},
        "optim": {"lr": lr, "lr_mtp": lr, "warmup_steps": max(1, steps // 20), "weight_decay": 0.0},
        "checkpoint": {"every": max(1, steps // 4), "keep": 1},
        "log": {"every": max(1, steps // 10), "progress": progress},
    }


def acceptance(model_dir, prompts: list[dict], *, device, dtype, ks, num_tokens: int, batch_size: int) -> dict:
    """Mean acceptance length (+- SE over prompts) and per-position acceptance at each k, greedy."""
    from .bench.acceptance_se import decode_rows, length_figures
    from .checkpoint.hf import load_model
    from .kernels.compute_dtype import resolve
    from .tokenizer import encode_prompt, load_tokenizer

    model = load_model(model_dir).eval()
    model = model.to(device=device, dtype=resolve(dtype, device, model.config))
    tok = load_tokenizer(model_dir)
    rows = [encode_prompt(tok, p["prompt"], p["chat"]) for p in prompts]
    out = {}
    for k in ks:
        _, lengths, per_position = decode_rows(model, rows, k=k, num_tokens=num_tokens, eos_token_id=tok.eos_token_id,
                                               batch_size=batch_size)
        out[str(k)] = length_figures(lengths, per_position)
    return out


def refresh(model, prompts, out, *, head_from=None, eval_prompts=None, eval_every: int = 10,
            max_new_tokens: int = 128, batch_size: int = 64, device: str = "auto", dtype: str = "auto",
            depth: int | None = None, epochs: float = 2.0, lr: float = 1e-3, train_batch_size: int = 16,
            seq_len: int = 1024, seed: int = 0, ks=(1, 2, 3), eval_tokens: int = 128, progress: bool = True,
            as_drafted: bool = False, whole_records: bool = False, draft_vocab: int = 0) -> dict:
    """Refresh the MTP head of the HF directory `model` (with --head-from's head grafted in first when given) on
    the model's own continuations of `prompts` (a prompts file, `datasets.distill.read_user_prompts`); write OUT as
    the module docstring says and return the report."""
    from .datasets.distill import distill_model, manifest_path, read_user_prompts
    from .manifest import read_manifest
    from .models.config import config_from_hf
    from .parallel.distributed import pick_device
    from .train.config import config_from_dict
    from .train.export import export
    from .train.trainer import train

    out = Path(out)
    train_prompts, held = split_prompts(read_user_prompts(prompts),
                                        read_user_prompts(eval_prompts) if eval_prompts else None, eval_every)
    model = Path(model)
    config = config_from_hf(json.loads((model / "config.json").read_text()))
    check_held_out_fits(model, config, held, eval_tokens)
    check_draft_vocab_size(config.vocab_size, draft_vocab)
    device_type = pick_device(device, setting="--device {}").type
    seconds = {}
    start = time.perf_counter()
    if head_from is not None:
        model_dir = out / "model"
        if not model_dir.exists():
            graft(head_from, model, model_dir)
    else:
        model_dir = model
    layers = head_layers(model_dir)
    seconds["graft"] = time.perf_counter() - start

    start = time.perf_counter()
    records, features = out / "distill.jsonl", out / "features"
    # the prompts' digest in the manifest: a rerun after the prompts file changed is refused, not resumed on the
    # first run's prompt list
    digest = hashlib.sha256(json.dumps(train_prompts, sort_keys=True).encode()).hexdigest()[:16]
    distill_model(model_dir, records, lambda tokenizer: train_prompts, device=device_type, dtype=dtype,
                  batch_size=batch_size, max_new_tokens=max_new_tokens, features=features,
                  recorded={"refresh_prompts": digest})
    seconds["distill"] = time.perf_counter() - start

    start = time.perf_counter()
    lengths = [len(json.loads(line)["input_ids"]) for line in records.read_text().splitlines() if line.strip()]
    tokens = sum(lengths)
    # the head trains in the dtype distillation measured (--dtype auto) or was given: bf16 only where it is faster
    autocast = "bf16" if read_manifest(manifest_path(records))["dtype"] == "bfloat16" else "fp32"
    cfg = config_from_dict(train_config(model_dir, features, out / "train", lengths=lengths, layers=layers,
                                        depth=depth, epochs=epochs, lr=lr, batch_size=train_batch_size,
                                        seq_len=seq_len, device=device_type, seed=seed, progress=progress,
                                        as_drafted=as_drafted, whole_records=whole_records, autocast=autocast,
                                        draft_vocab=draft_vocab))
    refreshed = out / "hf"
    if not refreshed.exists():
        train(cfg)
        export(out / "train", refreshed)
    seconds["train"] = time.perf_counter() - start

    start = time.perf_counter()
    figures = {name: acceptance(path, held, device=device_type, dtype=dtype, ks=ks, num_tokens=eval_tokens,
                                batch_size=batch_size) for name, path in (("before", model_dir), ("after", refreshed))}
    seconds["report"] = time.perf_counter() - start
    report = {"model": str(model), "head_from": None if head_from is None else str(head_from),
              "train_prompts": len(train_prompts), "eval_prompts": len(held), "distilled_tokens": tokens,
              "train_steps": cfg.train.steps, "depth": cfg.mtp.depth, "device": device_type, "seconds": seconds,
              **figures}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def render(report: dict) -> str:
    """The before/after table of a report."""
    lines = [f"refresh of {report['model']}: {report['train_prompts']} prompts distilled "
             f"({report['distilled_tokens']} tokens), {report['train_steps']} head steps at depth {report['depth']}; "
             f"held-out: {report['eval_prompts']} prompts",
             f"  {'k':>2}  {'before':>14}  {'after':>14}  per-position acceptance after"]
    for k, before in report["before"].items():
        after = report["after"][k]
        lines.append(f"  {k:>2}  {before['mean_acceptance_length']:>7.3f} ±{before['se']:.3f}  "
                     f"{after['mean_acceptance_length']:>7.3f} ±{after['se']:.3f}  "
                     + " ".join(f"{a:.2f}" for a in after["accepted_per_position"]))
    return "\n".join(lines)
