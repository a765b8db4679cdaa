"""The fine-tuning experiment (docs/MTP.md section 5): does training with the MTP loss keep a released head aligned?

SmolLM2-135M-Instruct with mtpkit's shipped head stands in for a released model with MTP. Every arm fine-tunes it on
the same Python sources of installed packages (`mtpkit.datasets.code_corpus`: whole files, never seen by the head),
with the same data order, steps and seed:
  a    main loss only (mtp.depth = 0: the head is dropped, as transformers-based tools do), the base head grafted back
  b01  main + 0.1 x MTP loss, joint          b03  the same with 0.3
  c    the trunk from the main loss, the head from the isolated MTP loss (mtp.detach_trunk)
  d    a, then `mtpkit refresh` (MTP-only on the fine-tuned model's own continuations of training-file prompts)
  e    b01, then the same refresh
  f    a, then the same refresh with its chained depths trained as they draft (`mtpkit refresh --as-drafted`)
  g    a, then the refresh on the domain prompts plus half as many general ones (the recipe for a domain refresh)
  h    a, then the refresh of d with every record whole in one row (`mtpkit refresh --whole-records`: the head
       attends over each continuation's whole prompt, as when drafting, where d's rows of 512 cut 640-token records)
The MTP loss trains the head's one layer at three chained depths with FastMTP's weights [0.51, 0.31, 0.18] x lambda,
as it drafts at k = 3. Every model is measured on held-out files (main loss over windows of the run's seq_len:
1,024 tokens, 512 at CPU scale), on the base
model's own answers to the 60 general benchmark prompts (main loss: what the fine-tune costs the model's general
behaviour), and by greedy speculative decoding over the full vocabulary of prompts cut mid-file from held-out files
(domain) and of the general prompts, until EOS: mean acceptance length at k = 1..3 per prompt (standard errors
over prompts, paired between arms), per-position acceptance, and whether every speculative row equals plain
decoding; the domain prompts also past EOS (new_tokens each). Speedup over plain decoding (batch 1, medians of
interleaved repeats) is timed last, for as many models as the time allows.

Every stage is kept under --out and skipped when rerun; --deadline-minutes stops starting new stages in time to
write the results (results.json, table.md, alignment.png).

    python scripts/finetune_alignment.py --out runs/alignment --device cuda --seeds 0,1   # the full run (GPU)
    python scripts/finetune_alignment.py --out runs/alignment_cpu --device cpu --size cpu  # the CPU-scale run
    python scripts/finetune_alignment.py --out runs/alignment_long --device cpu --size cpu-long --arms a,b01
        # twice the training tokens, in bf16 autocast (for CPUs with AMX), on the CPU run's evaluation sets
    python scripts/finetune_alignment.py --out runs/alignment_tiny --device cpu --size tiny # a check of the script
    python scripts/finetune_alignment.py --out runs/alignment_cpu --device cpu --size cpu --arms a --more-domain 96
        # base and a on 96 domain prompts more: the drift test (a - base) at a smaller standard error
    python scripts/finetune_alignment.py --out runs/alignment_cpu --device cpu --size cpu --arms a,d \
        --extra d_cli=runs/alignment_cpu/refresh_cli/hf --pair d_cli-d
        # `mtpkit refresh`'s own output measured as a row and set against arm d

On the lent GPU machine (no network; one GPU for minutes): `bash scripts/gpu_session.sh alignment`, the second of its
two calls (the embedded model's GGUF travels in two halves), runs this script under a timeout with --deadline-minutes
and copies results.json, table.md, alignment.png and the log to $OUT (results.json is written after every arm). The
corpus is built there from that machine's installed packages, so its figures are a run of their own, not the CPU
run's sets.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

import mtpkit
from mtpkit.assets import default_gguf_path
from mtpkit.bench.acceptance_se import decode_rows, length_figures, paired_difference_se
from mtpkit.checkpoint.graft import graft
from mtpkit.checkpoint.hf import save_model
from mtpkit.datasets.code_corpus import build_code_corpus, cut_prompts, read_corpus
from mtpkit.datasets.distill_prompts import build_prompts
from mtpkit.loading import load_for_decoding
from mtpkit.prompts import read_prompts
from mtpkit.resources import DEFAULT_PROMPTS, resource
from mtpkit.tokenizer import encode_prompt, load_tokenizer
from mtpkit.train.config import config_from_dict
from mtpkit.train.export import export
from mtpkit.refresh import FASTMTP_WEIGHTS, refresh
from mtpkit.train.trainer import train

GENERAL_PROMPTS = (resource(DEFAULT_PROMPTS), resource("heldout_prompts.jsonl"), resource("heldout2_prompts.jsonl"))
ARMS = {  # arm -> the [mtp] section of its fine-tune (None: the refresh of another arm)
    "a": {"depth": 0},
    "b01": {"mtp_lambda": 0.1},
    "b03": {"mtp_lambda": 0.3},
    "c": {"mtp_lambda": 0.1, "detach_trunk": True},
    "d": None,
    "e": None,
    "f": None,
    "g": None,
    "h": None,
}
REFRESHED = {"d": "a", "e": "b01", "f": "a", "g": "a", "h": "a"}
WHOLE = {"h"}  # refreshes that pack each distilled record whole into a row
AS_DRAFTED = {"f"}  # refreshes whose depths >= 2 attend as a draft chain reads the MTP cache ([mtp] as_drafted)
MIXED = {"g"}  # refreshes on the domain prompts plus half as many general ones (the recipe MTP.md gives users)
# sizes: (train tokens per arm, rows per step, seq_len, domain prompts, general prompts, new tokens, loss windows,
# refresh prompts, timed prompts)
FULL = dict(train_tokens=2_097_152, batch=32, seq_len=1024, domain_prompts=128, general_prompts=60, new_tokens=160,
            loss_windows=64, refresh_prompts=2048, timed_prompts=4)
# the CPU-scale run: >= 300k training tokens per arm, >= 64 domain prompts of >= 128 new tokens
CPU = dict(train_tokens=327_680, batch=4, seq_len=512, domain_prompts=64, general_prompts=40, new_tokens=128,
           loss_windows=32, refresh_prompts=256, timed_prompts=2)
# the CPU-scale run trained twice as long, in bf16 autocast (1.5-1.9x fp32's tokens/s on a 2-core AMX Xeon); its
# held-out sets are the CPU run's (which files are held out does not depend on the size)
CPU_LONG = dict(CPU, train_tokens=655_360, cpu_autocast="bf16")
TINY = dict(train_tokens=2048, batch=2, seq_len=256, domain_prompts=4, general_prompts=3, new_tokens=16,
            loss_windows=2, refresh_prompts=12, timed_prompts=1)
KS = (1, 2, 3)
# the domain prompts decoded past EOS, new_tokens each (vLLM's benchmarks' --ignore-eos): the fine-tuned models end
# some files at once, so until EOS they write fewer tokens; past it they start another file
PAST_EOS = "domain_past_eos"


class Deadline:
    def __init__(self, minutes: float | None):
        self.end = None if minutes is None else time.monotonic() + 60 * minutes

    def allows(self, seconds: float) -> bool:
        return self.end is None or time.monotonic() + seconds < self.end


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prepare(out: Path, corpus: Path, tok, size: dict) -> dict:
    """The base model directory (SmolLM2 + the shipped head, HF layout), the corpus, and the evaluation sets:
    domain prompts, held-out loss windows, general prompts and the refresh prompts (cut from training files)."""
    base = out / "base"
    if not base.exists():
        model, tokenizer, _, _ = load_for_decoding()  # the embedded SmolLM2 with the shipped head
        model.drafter.draft_vocab = None  # every arm's head drafts and trains over the full vocabulary
        save_model(model, base, tokenizer)
    if not (corpus / "manifest.json").exists():
        build_code_corpus(corpus, tok, train_tokens=int(size["train_tokens"] * 1.05))
    sets_path = out / "eval_sets.json"
    if sets_path.exists():
        return {"base": base, **json.loads(sets_path.read_text())}
    held = read_corpus(corpus / "heldout.jsonl")
    domain = domain_prompts(held, tok, size["domain_prompts"], size)
    prompt_files = {p["path"] for p in domain}
    windows = []
    for doc in held:  # loss windows from held-out files that gave no prompt
        ids = tok(doc["text"])["input_ids"]
        if doc["path"] not in prompt_files and len(ids) >= size["seq_len"]:
            windows.append(ids[: size["seq_len"]])
        if len(windows) == size["loss_windows"]:
            break
    general = [p for f in GENERAL_PROMPTS for p in read_prompts(f)][: size["general_prompts"]]
    general = [{"prompt": p.text, "chat": p.chat, "kind": p.kind} for p in general]
    train_docs = read_corpus(corpus / "train.jsonl")
    refresh_prompts = cut_prompts(train_docs, tok, size["refresh_prompts"], context_tokens=512, min_left=128, seed=1,
                                  per_file=8)
    sets = {"domain": domain, "windows": windows, "general": general, "refresh_prompts": refresh_prompts}
    sets_path.write_text(json.dumps(sets))
    with (out / "refresh_prompts.jsonl").open("w") as f:
        f.writelines(json.dumps({"prompt": p["prompt"], "kind": "code"}) + "\n" for p in refresh_prompts)
    with (out / "refresh_eval_prompts.jsonl").open("w") as f:
        f.writelines(json.dumps({"prompt": p["prompt"], "kind": "code"}) + "\n" for p in domain[:16])
    return {"base": base, **sets}


def domain_prompts(held: list[dict], tok, n: int, size: dict) -> list[dict]:
    """n prompts cut mid-file from n held-out files; a larger n continues the same draw (its first prompts are
    those of a smaller n)."""
    return cut_prompts(held, tok, n, context_tokens=512, min_left=size["new_tokens"] + 64)


def more_domain_prompts(out: Path, setup: dict, corpus: Path, tok, size: dict, n: int) -> list[dict]:
    """n domain prompts beyond the first ones, from files that gave none: the drift test's extension (a - base has
    the smallest effect of the comparisons, so it needs the most prompts). Kept in eval_sets.json."""
    if len(setup.get("domain_more", [])) != n:
        domain = setup["domain"]
        drawn = domain_prompts(read_corpus(corpus / "heldout.jsonl"), tok, len(domain) + n, size)
        if drawn[: len(domain)] != domain:
            raise ValueError("the held-out corpus no longer gives the run's domain prompts: --more-domain needs the "
                             "corpus the run was prepared with (--corpus)")
        setup["domain_more"] = drawn[len(domain):]
        sets = {k: v for k, v in setup.items() if k != "base"}
        (out / "eval_sets.json").write_text(json.dumps(sets))
    return setup["domain_more"]


def mixed_refresh_prompts(out: Path, setup: dict) -> Path:
    """The domain refresh prompts plus half as many general ones, drawn from the distillation prompt kinds (chat,
    prose, lists, code requests: mtpkit/datasets/distill_prompts.py), none of them a general evaluation prompt."""
    path = out / "refresh_mix_prompts.jsonl"
    if not path.exists():
        held = {p["prompt"] for p in setup["general"]}
        n = len(setup["refresh_prompts"]) // 2
        general = [p for p in build_prompts(4 * n, seed=7) if "prompt" in p and p["prompt"] not in held][:n]
        lines = (out / "refresh_prompts.jsonl").read_text().splitlines()
        lines += [json.dumps({"prompt": p["prompt"], "chat": p["chat"], "kind": p["kind"]}) for p in general]
        path.write_text("\n".join(lines) + "\n")
    return path


def general_answers(setup: dict, out: Path, device, new_tokens: int) -> list[list[int]]:
    """The base model's greedy answers to the general prompts (prompt + answer ids): the general loss text."""
    path = out / "general_answers.json"
    if path.exists():
        return json.loads(path.read_text())
    model = mtpkit.load_model(setup["base"]).eval().to(device)
    tok = load_tokenizer(setup["base"])
    rows = [encode_prompt(tok, p["prompt"], p["chat"]) for p in setup["general"]]
    res = mtpkit.generate(model, rows, max_new_tokens=2 * new_tokens, eos_token_id=tok.eos_token_id)
    answers = [[r, t] for r, t in zip(rows, res.tokens)]
    path.write_text(json.dumps(answers))
    return answers


def model_dir(out: Path, key: str) -> Path:
    """Where the model measured as `key` ("base" or "ARM/seedN") lives."""
    if key == "base":
        return out / "base"
    arm, seed = key.split("/")
    return out / arm / seed / ("grafted" if arm == "a" else "hf")


def fine_tune(arm: str, seed: int, setup: dict, corpus: Path, out: Path, device, size: dict) -> tuple[Path, float]:
    """Fine-tune the base model as arm `arm` (seed: init and data order); returns its HF directory with a head
    (arm a: the base head grafted back) and the wall seconds of training."""
    run = out / arm / f"seed{seed}"
    hf = model_dir(out, f"{arm}/seed{seed}")
    done = run / "wall_seconds.txt"
    if hf.exists() and done.exists():
        return hf, float(done.read_text())
    steps = max(1, size["train_tokens"] // (size["batch"] * size["seq_len"]))
    mtp = dict(ARMS[arm])
    if mtp.get("depth", 3):
        lam = mtp.pop("mtp_lambda")
        mtp.update(depth=3, layers=1, init="checkpoint", weights=[lam * w for w in FASTMTP_WEIGHTS])
    cfg = config_from_dict({
        "model": {"path": str(setup["base"])},
        "mtp": mtp,
        "data": {"paths": [str(corpus / "train.jsonl")], "text_field": "text", "seq_len": size["seq_len"],
                 "seed": 1000 + seed},
        "train": {"run_dir": str(run / "run"), "steps": steps, "batch_size": size["batch"], "device": device.type,
                  "seed": seed, "autocast": "bf16" if device.type == "cuda" else size.get("cpu_autocast", "fp32")},
        "optim": {"lr": 3e-4, "warmup_steps": max(1, steps // 20), "weight_decay": 0.0},
        # on a CPU an arm takes hours: checkpoints let a killed run resume
        "checkpoint": {"every": 0 if device.type == "cuda" else max(1, steps // 16), "keep": 1},
        "log": {"every": max(1, steps // 16), "progress": False},
    })
    start = time.perf_counter()
    summary = train(cfg)
    if summary["status"] != "finished":  # SIGINT/SIGTERM: the run stopped at a checkpoint; a rerun resumes it
        raise SystemExit(f"{arm}/seed{seed}: training stopped at step {summary['step']} of {steps}; rerun to resume")
    seconds = time.perf_counter() - start
    export(run / "run", run / "hf", overwrite=True)
    shutil.rmtree(run / "run" / "checkpoints", ignore_errors=True)  # the exported weights are what is measured
    if arm == "a":  # what a transformers-based tool's fine-tune gets: the base head copied back
        graft(setup["base"], run / "hf", hf)
        shutil.rmtree(run / "hf")
    done.write_text(f"{seconds:.1f}")
    return hf, seconds


@torch.inference_mode()
def losses(model, windows: list[list[int]], answers: list[list[list[int]]], device, batch: int = 16) -> dict:
    """Mean next-token cross-entropy over the held-out windows (domain) and over the base model's answers (general:
    the answer tokens only, after their prompts)."""
    total = count = 0.0
    for s in range(0, len(windows), batch):
        ids = torch.tensor(windows[s : s + batch], device=device)
        logits = model(ids).logits[:, :-1].float()
        total += F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
        count += ids[:, 1:].numel()
    domain = total / count
    total = count = 0.0
    for prompt, answer in answers:
        if not answer:
            continue
        ids = torch.tensor([prompt + answer], device=device)
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        total += F.cross_entropy(logits, ids[0, len(prompt):], reduction="sum").item()
        count += len(answer)
    return {"domain_loss": domain, "general_loss": total / count}


@torch.inference_mode()
def acceptance(model, rows: list[list[int]], eos, new_tokens: int, batch: int) -> dict:
    """Per k: the tokens kept per step of every prompt, per-position acceptance, identical to plain greedy. eos None:
    every row runs `new_tokens`."""
    plain, _, _ = decode_rows(model, rows, k=0, num_tokens=new_tokens, eos_token_id=eos, batch_size=batch)
    out = {"new_tokens": statistics.mean(map(len, plain))}
    for k in KS:
        tokens, lengths, per_position = decode_rows(model, rows, k=k, num_tokens=new_tokens, eos_token_id=eos,
                                                    batch_size=batch)
        out[str(k)] = {**length_figures(lengths, per_position), "per_prompt": lengths, "identical": tokens == plain}
    return out


def evaluate(model_dir: Path, setup: dict, answers, device, size: dict, sets=("domain", "general", PAST_EOS)) -> dict:
    """Losses (when answers are given) and acceptance over each of `sets`."""
    model = mtpkit.load_model(model_dir).eval().to(device)
    tok = load_tokenizer(model_dir)
    result = losses(model, setup["windows"], answers, device) if answers is not None else {}
    batch = 128 if device.type == "cuda" else 64  # on 2 cores a 64-row step streams the weights once for 4x the rows
    for name in sets:
        prompts = setup["domain" if name == PAST_EOS else name]
        rows = [encode_prompt(tok, p["prompt"], p.get("chat", False)) for p in prompts]
        result[name] = acceptance(model, rows, None if name == PAST_EOS else tok.eos_token_id, size["new_tokens"],
                                  batch)
    return result


def measure_past_eos(results: dict, out: Path, setup: dict, device, size: dict, deadline, took: dict) -> None:
    """The domain prompts past EOS for every measured model that lacks them."""
    for key, result in results.items():
        if PAST_EOS in result or not model_dir(out, key).exists() or not deadline.allows(1.2 * took.get("past", 0.0)):
            continue
        start = time.perf_counter()
        result[PAST_EOS] = evaluate(model_dir(out, key), setup, None, device, size, (PAST_EOS,))[PAST_EOS]
        took["past"] = time.perf_counter() - start
        (out / "results.json").write_text(json.dumps(results))
        log(f"{key}: domain past EOS in {took['past']:.0f} s; k=1..3 "
            + " ".join(f"{result[PAST_EOS][str(k)]['mean_acceptance_length']:.3f}" for k in KS))


@torch.inference_mode()
def timed_speedup(model_dir: Path, setup: dict, device, size: dict, repeats: int = 3) -> dict:
    """tokens/s of plain decoding and of k = 1..3 at batch 1 on the first domain prompts, each prompt's
    configurations interleaved, `repeats` rounds; speedup = median speculative / median plain tokens/s."""
    model = mtpkit.load_model(model_dir).eval().to(device)
    tok = load_tokenizer(model_dir)
    rows = [encode_prompt(tok, p["prompt"]) for p in setup["domain"][: size["timed_prompts"]]]
    ks = (0, *KS)
    for k in ks:  # warm-up: every configuration and prompt length once
        mtpkit.generate(model, rows[:1], max_new_tokens=8, draft_tokens=k)
    rates = {k: [] for k in ks}
    for _ in range(repeats):
        for row in rows:
            for k in ks:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                res = mtpkit.generate(model, [row], max_new_tokens=size["new_tokens"], draft_tokens=k,
                                      eos_token_id=tok.eos_token_id)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                rates[k].append(len(res.tokens[0]) / (time.perf_counter() - start))
    plain = statistics.median(rates[0])
    return {"plain_tokens_per_second": plain, "repeats": repeats, "prompts": len(rows),
            **{str(k): statistics.median(rates[k]) / plain for k in KS}}


def summary(results: dict) -> dict:
    """Per arm, over its seeds: mean of each figure, and the SE over prompts (paired SE against the base for
    acceptance, pooled over seeds as the mean of the per-seed SEs / sqrt(seeds))."""
    arms = {}
    for key, r in results.items():
        arms.setdefault(key.split("/")[0], []).append(r)
    base = results.get("base")
    table = {}
    for arm, rs in arms.items():
        row = {"seeds": len(rs), "domain_loss": statistics.mean(r["domain_loss"] for r in rs),
               "general_loss": statistics.mean(r["general_loss"] for r in rs),
               "wall_seconds": statistics.mean(r.get("wall_seconds", 0.0) for r in rs)}
        for where in ("domain", "general"):
            row[f"{where}_new_tokens"] = statistics.mean(r[where]["new_tokens"] for r in rs)
            for k in map(str, KS):
                row[f"{where}_k{k}"] = statistics.mean(r[where][k]["mean_acceptance_length"] for r in rs)
                row[f"{where}_k{k}_se"] = statistics.mean(r[where][k]["se"] for r in rs) / math.sqrt(len(rs))
                if base is not None and arm != "base":
                    diffs = [paired_difference_se(r[where][k]["per_prompt"], base[where][k]["per_prompt"])
                             for r in rs]
                    row[f"{where}_k{k}_vs_base"] = statistics.mean(d for d, _ in diffs)
                    row[f"{where}_k{k}_vs_base_se"] = statistics.mean(s for _, s in diffs) / math.sqrt(len(rs))
                row[f"{where}_k{k}_identical"] = all(r[where][k]["identical"] for r in rs)
        speed = [r["speedup"] for r in rs if "speedup" in r]
        if speed:
            row["speedup"] = {k: statistics.mean(s[k] for s in speed) for k in map(str, KS)}
            row["plain_tokens_per_second"] = statistics.mean(s["plain_tokens_per_second"] for s in speed)
        table[arm] = row
    return table


def paired_vs(results: dict, arm: str, other: str, where: str = "domain", k: str = "1") -> tuple[float, float]:
    """Mean over the seeds both arms have of arm - other (mean acceptance length), with its paired SE."""
    seeds = [key.split("/")[1] for key in results if key.startswith(arm + "/")]
    other_key = (lambda s: "base") if other == "base" else (lambda s: f"{other}/{s}")
    pairs = [paired_difference_se(results[f"{arm}/{s}"][where][k]["per_prompt"],
                                  results[other_key(s)][where][k]["per_prompt"])
             for s in seeds if other_key(s) in results]
    if not pairs:
        return float("nan"), float("nan")
    return statistics.mean(d for d, _ in pairs), statistics.mean(s for _, s in pairs) / math.sqrt(len(pairs))


def drift_vs_base(results: dict, key: str) -> dict[str, tuple[float, float, int]] | None:
    """key - base per k over the domain prompts and their extension together (paired), with the prompt count; None
    unless both were measured on the extension."""
    if "domain_more" not in results[key] or "domain_more" not in results.get("base", {}):
        return None
    out = {}
    for k in map(str, KS):
        mine, base = ([*r["domain"][k]["per_prompt"], *r["domain_more"][k]["per_prompt"]]
                      for r in (results[key], results["base"]))
        out[k] = (*paired_difference_se(mine, base), len(mine))
    return out


def render(table: dict) -> str:
    head = ("| arm | seeds | domain loss | general loss | " + " | ".join(f"domain k={k}" for k in KS) + " | "
            + " | ".join(f"general k={k}" for k in KS) + " | domain k=1 vs base | speedup k=1/2/3 | identical "
            "| train s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for arm, r in table.items():
        cells = [str(r["seeds"]), f"{r['domain_loss']:.4f}", f"{r['general_loss']:.4f}"]
        cells += [f"{r[f'{w}_k{k}']:.3f} ±{r[f'{w}_k{k}_se']:.3f}" for w in ("domain", "general") for k in KS]
        cells.append(f"{r['domain_k1_vs_base']:+.3f} ±{r['domain_k1_vs_base_se']:.3f}" if "domain_k1_vs_base" in r
                     else "-")
        cells.append(" / ".join(f"{r['speedup'][k]:.2f}" for k in map(str, KS)) if "speedup" in r else "-")
        cells.append("yes" if all(r[f"{w}_k{k}_identical"] for w in ("domain", "general") for k in KS) else "NO")
        cells.append(f"{r['wall_seconds']:.0f}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(table: dict, path: Path) -> Path:
    """Mean acceptance length against k per arm (domain and general prompts, +- SE) and the held-out losses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, where in zip(axes, ("domain", "general")):
        for arm, r in table.items():
            ax.errorbar(KS, [r[f"{where}_k{k}"] for k in KS], yerr=[r[f"{where}_k{k}_se"] for k in KS],
                        marker="o", capsize=3, label=arm, linestyle="--" if arm == "base" else "-")
        ax.set(title=f"{where} prompts (held out)", xlabel="draft tokens k", ylabel="mean acceptance length",
               xticks=KS)
        ax.grid(alpha=0.3)
    axes[0].legend()
    names = list(table)
    x = range(len(names))
    axes[2].bar([i - 0.2 for i in x], [table[a]["domain_loss"] for a in names], 0.4, label="domain (held-out files)")
    axes[2].bar([i + 0.2 for i in x], [table[a]["general_loss"] for a in names], 0.4, label="general (base answers)")
    axes[2].set_xticks(list(x), names)
    axes[2].set(title="held-out main loss")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_arm(arm, seed, key, setup, corpus, out, device, size, results, answers, took, tiny) -> dict | None:
    """Train (or refresh) one arm and evaluate it; None when the arm it refreshes is missing."""
    start = time.perf_counter()
    if arm in REFRESHED:
        source = f"{REFRESHED[arm]}/seed{seed}"
        if source not in results:
            log(f"{key}: skipped, {source} was not trained")
            return None
        prompts = mixed_refresh_prompts(out, setup) if arm in MIXED else out / "refresh_prompts.jsonl"
        rep = refresh(model_dir(out, source), prompts, out / arm / f"seed{seed}",
                      eval_prompts=out / "refresh_eval_prompts.jsonl", device=device.type, dtype="float32",
                      batch_size=512 if device.type == "cuda" else 16, seed=seed, seq_len=size["seq_len"],
                      train_batch_size=32 if device.type == "cuda" else size["batch"],
                      max_new_tokens=16 if tiny else 128, ks=(1,), eval_tokens=64, progress=False,
                      as_drafted=arm in AS_DRAFTED, whole_records=arm in WHOLE)
        wall = results[source]["wall_seconds"] + sum(rep["seconds"].values())
        extra = {"refresh": {"distilled_tokens": rep["distilled_tokens"], "steps": rep["train_steps"],
                             "seconds": rep["seconds"]}}
        took["refresh"] = time.perf_counter() - start
    else:
        _, wall = fine_tune(arm, seed, setup, corpus, out, device, size)
        extra = {}
        took["train"] = time.perf_counter() - start
    eval_start = time.perf_counter()
    value = {"wall_seconds": wall, **extra, **evaluate(model_dir(out, key), setup, answers, device, size)}
    took["eval"] = time.perf_counter() - eval_start
    return value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/alignment")
    ap.add_argument("--corpus", help="the code corpus directory (default: OUT/corpus, built on first use)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--arms", default="a,b01,d,c,b03,e", help="in the order they run (a refresh after its arm)")
    ap.add_argument("--size", choices=("full", "cpu", "cpu-long", "tiny"), default="full",
                    help="full: the GPU run; cpu: the CPU-scale run (days of 2 cores); cpu-long: cpu's arms trained "
                         "twice as long; tiny: checks the script")
    ap.add_argument("--deadline-minutes", type=float, help="start no stage that would end after this")
    ap.add_argument("--no-speedup", action="store_true", help="skip the timed speedup stage")
    ap.add_argument("--more-domain", type=int, default=0, metavar="N",
                    help="measure base and the finished --arms on N domain prompts more (the drift test at a smaller "
                         "standard error)")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=DIR",
                    help="also measure the HF model directory DIR as the row NAME (e.g. `mtpkit refresh`'s OUT/hf, "
                         "to set against arm d)")
    ap.add_argument("--pair", action="append", default=[], metavar="A-B",
                    help="print row A - row B paired over prompts (domain and general, k = 1..3), e.g. b01-a")
    args = ap.parse_args()
    size = {"full": FULL, "cpu": CPU, "cpu-long": CPU_LONG, "tiny": TINY}[args.size]
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    deadline = Deadline(args.deadline_minutes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = Path(args.corpus) if args.corpus else out / "corpus"
    tok = load_tokenizer(default_gguf_path())
    setup = prepare(out, corpus, tok, size)
    answers = general_answers(setup, out, device, size["new_tokens"])
    log(f"prepared: {len(setup['domain'])} domain prompts, {len(setup['general'])} general, "
        f"{len(setup['windows'])} loss windows, {len(setup['refresh_prompts'])} refresh prompts")
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}

    def save(key, value, seconds):
        results[key] = value
        results_path.write_text(json.dumps(results))
        log(f"{key}: {seconds:.0f} s; domain loss {value['domain_loss']:.4f}, general {value['general_loss']:.4f}; "
            f"domain k=1..3 " + " ".join(f"{value['domain'][str(k)]['mean_acceptance_length']:.3f}" for k in KS)
            + "; general " + " ".join(f"{value['general'][str(k)]['mean_acceptance_length']:.3f}" for k in KS))

    took: dict[str, float] = {}
    if "base" not in results:
        start = time.perf_counter()
        save("base", {"wall_seconds": 0.0, **evaluate(setup["base"], setup, answers, device, size)},
             time.perf_counter() - start)
    took["eval"] = 0.0
    arms = args.arms.split(",")
    for seed in map(int, args.seeds.split(",")):
        for arm in arms:
            key = f"{arm}/seed{seed}"
            need = took.get("refresh" if arm in REFRESHED else "train", 0.0) + took.get("eval", 0.0)
            if key in results:
                continue
            if not deadline.allows(1.2 * need):
                log(f"{key}: skipped, the deadline leaves too little time ({need:.0f} s needed)")
                continue
            start = time.perf_counter()
            try:
                value = run_arm(arm, seed, key, setup, corpus, out, device, size, results, answers, took,
                                args.size == "tiny")
            except Exception:  # noqa: BLE001 - one arm's failure is logged; the others still run in the time left
                log(f"{key}: failed\n{traceback.format_exc()}")
                continue
            if value is not None:
                save(key, value, time.perf_counter() - start)
    for spec in args.extra:
        name, _, path = spec.partition("=")
        if not path or name in ARMS or name == "base" or not name.isidentifier():
            ap.error(f"--extra {spec}: give NAME=DIR with a NAME of letters, digits and _ that is no arm's")
        key, link = f"{name}/seed0", model_dir(out, f"{name}/seed0")
        if not link.exists():  # a link where model_dir looks, so the later stages treat the row as an arm's
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path(path).resolve(), target_is_directory=True)
        if key not in results:
            start = time.perf_counter()
            save(key, {"wall_seconds": 0.0, **evaluate(link, setup, answers, device, size)},
                 time.perf_counter() - start)
    measure_past_eos(results, out, setup, device, size, deadline, took)
    if args.more_domain:
        more_domain_prompts(out, setup, corpus, tok, size, args.more_domain)
        for key in ("base", *[f"{a}/seed{s}" for s in map(int, args.seeds.split(",")) for a in arms]):
            measured = results.get(key, {}).get("domain_more")  # on another N's extension: measured again
            if (key not in results or measured and len(measured["1"]["per_prompt"]) == args.more_domain
                    or not deadline.allows(took.get("more", 0) * 1.2)):
                continue
            start = time.perf_counter()
            results[key]["domain_more"] = evaluate(model_dir(out, key), setup, None, device, size,
                                                   ("domain_more",))["domain_more"]
            took["more"] = time.perf_counter() - start
            results_path.write_text(json.dumps(results))
            log(f"{key}: {args.more_domain} domain prompts more in {took['more']:.0f} s; k=1..3 " + " ".join(
                f"{results[key]['domain_more'][str(k)]['mean_acceptance_length']:.3f}" for k in KS))
    if not args.no_speedup:
        for key in ("base", *[k for k in results if k.endswith("/seed0")]):
            if "speedup" in results[key] or not model_dir(out, key).exists():
                continue
            if not deadline.allows(took.get("speedup", 60.0) * 1.2):
                log(f"{key}: speedup skipped (deadline)")
                continue
            start = time.perf_counter()
            try:
                results[key]["speedup"] = timed_speedup(model_dir(out, key), setup, device, size)
            except Exception:  # noqa: BLE001 - as for the arms
                log(f"{key}: speedup failed\n{traceback.format_exc()}")
                continue
            took["speedup"] = time.perf_counter() - start
            results_path.write_text(json.dumps(results))
            log(f"{key}: speedup {results[key]['speedup']}")
    table = summary(results)
    text = render(table)
    extras = []
    for arm in [arm for arm in ARMS if arm != "a"]:
        if any(k.startswith(arm + "/") for k in results) and any(k.startswith("a/") for k in results):
            d, se = paired_vs(results, arm, "a")
            extras.append(f"- domain k=1, {arm} - a: {d:+.3f} ± {se:.3f} (paired over prompts and seeds)")
    for pair in args.pair:
        a, _, b = pair.partition("-")
        for where in ("domain", "general"):
            extras.append(f"- {where}, {a} - {b}, k=1..3: " + ", ".join(
                "{:+.3f} ± {:.3f}".format(*paired_vs(results, a, b, where, str(k))) for k in KS))
    for key, r in results.items():
        if PAST_EOS in r:
            vs = ("; k=1 vs base " + "{:+.3f} ± {:.3f}".format(*paired_difference_se(
                r[PAST_EOS]["1"]["per_prompt"], results["base"][PAST_EOS]["1"]["per_prompt"]))
                  if key != "base" and PAST_EOS in results.get("base", {}) else "")
            extras.append(f"- {key} past EOS ({r[PAST_EOS]['new_tokens']:.0f} new tokens a prompt; until EOS "
                          f"{r['domain']['new_tokens']:.1f}), k=1..3: " + " / ".join(
                              f"{r[PAST_EOS][str(k)]['mean_acceptance_length']:.3f}" for k in KS) + vs)
    for key in results:
        drift = drift_vs_base(results, key) if key != "base" else None
        if drift:
            same = all(results[key]["domain_more"][k]["identical"] for k in map(str, KS))
            extras.append(f"- {key} - base over {drift['1'][2]} domain prompts (with the extension), k=1..3: "
                          + ", ".join(f"{d:+.3f} ± {se:.3f}" for d, se, _ in drift.values())
                          + f"; extension identical to plain: {'yes' if same else 'NO'}")
    (out / "table.md").write_text(text + "\n\n" + "\n".join(extras) + "\n")
    (out / "summary.json").write_text(json.dumps(table, indent=1))
    print(text)
    print("\n".join(extras))
    print(f"plot: {plot(table, out / 'alignment.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
