"""The next SmolLM2 head, grown on one GPU in one prepared, time-boxed job (docs/MTP.md section 6, "long inputs").

The shipped head's recipe (configs/smollm2_mtp_head.toml) at a GPU's scale: it warm-starts the shipped head on the
model's own continuations of short prompts and of long-input prompts (documents and code files of 500-4,000 tokens:
`mtpkit distill --long-share`) and on long training-side documents read whole (`python -m
mtpkit.datasets.documents`, no generation), packed whole so that the MTP attention sees each record's whole prompt,
toward the trunk's own greedy token at every position, prompt tokens included (`mtp.head_loss = "greedy"`,
`data.train_on_inputs`), and measures the shipped and the new head side by side on prompts no training data held.
Stages, each a mtpkit command or function, logged to OUT/log.txt; a rerun with the same OUT resumes every stage:

  profile   (GPU, --tiny) one distillation batch, eager against fixed-shape (CUDA-graph) steps: ms per step, the
            top kernels
  distill   short prompts, then long-input prompts (--batch-tokens caps their batches), features and the trunk's
            top-1 kept
  documents the trunk's features and top-1 over the documents (--docs: records built elsewhere, e.g. on the machine
            the held-out document chats were drawn on; else built here)
  train     the shipped head, one epoch-ish on the three feature sets (the short one twice), records whole in rows
  export    OUT/head.safetensors (bf16, with its draft vocabulary)
  measure   acceptance (k = 1 and 3, chain) of both heads on the held-out prompts, heldout2, the held-out
            document chats and a context sweep (128-4,096 tokens): OUT/summary.json

    python scripts/gpu_head.py --out OUT --budget 540                    # on the GPU machine
    python scripts/gpu_head.py --out /tmp/gpu_head_tiny --device cpu --tiny  # a check of the script on CPU
    python scripts/gpu_head.py --out OUT --device cpu --budget 6600        # the recipe at a CPU's scale
    python scripts/gpu_head.py --out OUT --device cpu --measure new=HEAD   # the measure stage alone: shipped vs HEAD
    python scripts/gpu_head.py --out OUT --device cpu --no-shipped --measure a=HEAD_A b=HEAD_B   # two heads alone
    python scripts/gpu_head.py --out OUT --device cpu --no-shipped --against OLD/summary.json:a --measure b=HEAD_B
    python scripts/gpu_head.py --out OUT --device cpu --no-shipped --against A/summary.json:a B/summary.json:b

Every stage stops in time: distillation takes --max-minutes, training is sent SIGTERM at its share of the budget
(it checkpoints and stops), and the measurements take what is left. The long prompts are built (reading installed
packages' documents: minutes of one CPU core) in the background while the GPU profiles and distils the short ones.
Figures: OUT/summary.json and OUT/log.txt; the head: OUT/head.safetensors.

On the lent GPU machine (no network; at most 64 MiB travel with a call) the embedded model's 98 MB GGUF travels in two
halves: `bash scripts/gpu_session.sh head` is the second of the two calls, which runs this job and copies
head.safetensors, summary.json and log.txt to $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import mtpkit
from mtpkit.assets import default_gguf_path
from mtpkit.bench.acceptance_se import decode_rows, length_figures, pair_with_first
from mtpkit.bench.contexts import context_prompts, python_docs
from mtpkit.loading import load_for_decoding
from mtpkit.prompts import encode_prompts, read_prompts
from mtpkit.resources import resource
from mtpkit.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parent.parent
SHIPPED = resource("smollm2_mtp_head.safetensors")
HELD_OUT = ("heldout_prompts.jsonl", "heldout2_prompts.jsonl", "doc_chat_heldout_prompts.jsonl")
# shares of the budget (the rest: measuring); sizes of the GPU run, of a CPU run and of the script's check
SHARES = {"distill_short": 0.2, "distill_long": 0.22, "documents": 0.08, "train": 0.25}
SIZES = {
    "gpu": dict(short_prompts=200_000, long_prompts=20_000, batch=1024, long_batch=256, batch_tokens=1_500_000,
                new_tokens=128, contexts=(128, 512, 2048, 4096), eval_tokens=128, eval_batch=40, limit=0,
                train_batch=16, train_steps=400, lr=1e-3, warmup=10, doc_tokens=1_500_000),
    # the same recipe at a 2-core CPU's scale (fp32); at lr 5e-4 its few short records let the head drift on short
    # prompts, at 2e-4 they held (docs/results/mix_head_cpu.txt); the documents' fp32 features take ~4.6 ms a token
    # on a 2-core EPYC, so 100k tokens fit the documents' share of a 6,600 s budget
    "cpu": dict(short_prompts=2_500, long_prompts=200, batch=64, long_batch=8, batch_tokens=32_000,
                new_tokens=128, contexts=(128, 512, 2048, 4096), eval_tokens=64, eval_batch=10, limit=0,
                train_batch=4, train_steps=40, lr=2e-4, warmup=3, doc_tokens=100_000),
    "tiny": dict(short_prompts=8, long_prompts=4, batch=4, long_batch=2, batch_tokens=12_000, new_tokens=8,
                 contexts=(64, 256), eval_tokens=8, eval_batch=4, limit=2, train_batch=2, train_steps=2, lr=1e-3,
                 warmup=1, doc_tokens=2_000),
}


class Job:
    def __init__(self, out: Path, budget: float):
        self.out, self.began, self.budget = out, time.monotonic(), budget
        self.log_path = out / "log.txt"

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.began)

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.began:6.0f}s] {msg}"
        print(line, flush=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")

    def start(self, args: list[str], module: str = "mtpkit") -> subprocess.Popen:
        """A mtpkit command (or another module's) in the background, its output appended to the log."""
        self.log(f"$ python -m {module} " + " ".join(args) + "  (in the background)")
        with self.log_path.open("a") as f:
            return subprocess.Popen([sys.executable, "-m", module, *args], stdout=f, stderr=subprocess.STDOUT,
                                    cwd=REPO)

    def run(self, args: list[str], seconds: float | None = None) -> int:
        """A mtpkit command, its output appended to the log; SIGTERM after `seconds` (the trainer then saves)."""
        self.log("$ mtpkit " + " ".join(args))
        with self.log_path.open("a") as f:
            proc = subprocess.Popen([sys.executable, "-m", "mtpkit", *args], stdout=f, stderr=subprocess.STDOUT,
                                    cwd=REPO)
            try:
                rc = proc.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
                rc = proc.wait()
                self.log(f"stopped at its share of the budget ({seconds:.0f} s)")
        self.log(f"rc={rc}")
        return rc


@torch.inference_mode()
def profile(job: Job, device: str, size: dict) -> dict:
    """One distillation batch of short prompts decoded eagerly and with fixed-shape steps: ms per new token step
    (median of 3 after a warm-up) and, on CUDA, the kernels that take the most device time in an eager step."""
    from mtpkit.datasets.distill_prompts import build_prompts
    from mtpkit.tokenizer import encode_prompt

    model = mtpkit.load_model(default_gguf_path()).eval().to(device)
    tok = load_tokenizer(default_gguf_path())
    prompts = [p for p in build_prompts(4 * size["batch"], seed=99) if "prompt" in p][: size["batch"]]
    rows = [encode_prompt(tok, p["prompt"], p["chat"]) for p in prompts]
    engines = ("eager", "cuda-graph") if device == "cuda" else ("eager", "static")
    steps = 16
    out = {"rows": len(rows), "new_tokens": steps}
    for engine in engines:
        times = []
        for _ in range(4):  # the first warms up (and captures the graphs)
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            mtpkit.generate(model, rows, max_new_tokens=steps, engine=engine)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[f"{engine}_ms_per_step"] = 1000 * sorted(times[1:])[1] / steps
        job.log(f"profile: {engine} {out[f'{engine}_ms_per_step']:.1f} ms per step at {len(rows)} rows "
                "(prefill included)")
    if device == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            mtpkit.generate(model, rows, max_new_tokens=steps)
            torch.cuda.synchronize()
        out["top_kernels"] = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)
    out["engine"] = min(engines, key=lambda e: out[f"{e}_ms_per_step"])
    return out


def distill_args(job: Job, name: str, args: list[str], minutes: float, device: str, size: dict, engine: str
                 ) -> list[str]:
    """`mtpkit distill` into OUT/NAME.jsonl and OUT/features_NAME, starting new batches for `minutes` (0: build and
    keep the prompt list only; a later run with the same arguments distils it)."""
    return ["distill", "--device", device, "--dtype", "float32", "--out", str(job.out / f"{name}.jsonl"),
            "--features", str(job.out / f"features_{name}"), "--topk", "1", "--max-new-tokens", str(size["new_tokens"]),
            "--engine", engine, "--max-minutes", f"{minutes:.2f}", *args]


def minutes_for(seconds: float) -> float:
    """Distillation minutes in a share of `seconds`, leaving time for the features to assemble."""
    return max(0.8 * seconds - 20, 5) / 60


def longest_record(*records: Path) -> int:
    return max(len(json.loads(line)["input_ids"]) for r in records for line in r.read_text().splitlines()
               if line.strip())


def documents_stage(job: Job, docs: Path, building: subprocess.Popen | None, seconds: float, device: str) -> bool:
    """The trunk's features and top-1 over the document records (waiting for their build); False when they are
    not complete in `seconds`, and training goes on without them."""
    if (building is not None and building.wait() != 0) or not docs.is_file():
        job.log(f"documents: no records at {docs}; training without them")
        return False
    rc = job.run(["features", "--records", str(docs), "--out", str(job.out / "features_docs"), "--topk", "1",
                  "--compute", "float32", "--device", device], seconds)
    if rc != 0:
        job.log("documents: features incomplete (a rerun resumes them); training without them")
    return rc == 0


def epoch_parts(parts: dict[Path, Path]) -> list[str]:
    """The feature directories one epoch reads: the short records twice, so that their share holds beside the
    long-input records and documents (with them once, the short held-out prompts lost; the shipped head's recipe)."""
    return [str(f) for f in parts for _ in range(2 if f.name == "features_short" else 1)]


def train(job: Job, parts: dict[Path, Path], seconds: float, device: str, size: dict) -> Path | None:
    """The shipped head trained on the feature directories `parts` (features -> the records they hold), in a run
    directory of its own per set of parts (a rerun that adds the documents trains afresh, one with the same parts
    resumes); None if training failed. The head keeps drafting over the shipped head's ids (`mtp.draft_vocab = 0`):
    re-derived from long-input-heavy records they moved toward the documents' words and the short prompts lost."""
    run_dir = job.out / "_".join(["train"] + [f.name.removeprefix("features_") for f in parts])
    seq_len = -(-longest_record(*parts.values()) // 64) * 64  # rows hold the longest record whole, in blocks of 64
    rc = job.run(["train", str(REPO / "configs/smollm2_mtp_head.toml"), "--mtp.init=checkpoint",
                  f"--mtp.init_from={SHIPPED}", "--mtp.draft_vocab=0",
                  "--data.features=" + json.dumps(epoch_parts(parts)),
                  "--mtp.head_loss=greedy", "--data.train_on_inputs=true", f"--data.seq_len={seq_len}",
                  "--data.whole_documents=true",
                  f"--train.run_dir={run_dir}", f"--train.device={device}",
                  "--train.autocast=" + ("bf16" if device == "cuda" else "fp32"),
                  f"--train.steps={size['train_steps']}", f"--train.batch_size={size['train_batch']}",
                  f"--train.micro_batch_size={size['train_batch']}", "--train.eval_every=0", "--data.val_docs=0",
                  f"--checkpoint.every={max(1, size['train_steps'] // 8)}", f"--optim.warmup_steps={size['warmup']}",
                  f"--optim.lr={size['lr']}", f"--optim.lr_mtp={size['lr']}", "--log.every=10",
                  "--log.progress=false"], seconds)
    if rc not in (0, 130):  # 130: stopped at its share of the budget, its checkpoint saved
        return None
    head = job.out / "head.safetensors"
    rc = job.run(["export", str(run_dir), "--mtp-only", "--dtype", "bfloat16", "--out", str(head), "--overwrite"])
    return head if rc == 0 else None


def _own_figures(by_set: dict) -> dict:
    """An earlier run's figures of a head without its pairings there (against another base, stale here)."""
    return {s: {key: {k: v for k, v in f.items() if not k.startswith("minus_")} if isinstance(f, dict) else f
                for key, f in figures.items()} for s, figures in by_set.items()}


@torch.inference_mode()
def measure(job: Job, heads: dict[str, Path], device: str, size: dict, known: dict | None = None) -> dict:
    """Mean acceptance length at k = 1 and 3 (chain, greedy) per held-out set and context length, for each head,
    with its standard error over prompts and the tokens kept per step of every prompt; then each head against the
    first (the shipped one, unless --no-shipped; or the first of `known`, {name: figures} of earlier runs, which are
    not decoded again), paired over the same prompts (`bench/acceptance_se.py`)."""
    tok = load_tokenizer(default_gguf_path())  # the heads sit on one trunk: its prompts are tokenized once
    sets = {f: encode_prompts(read_prompts(resource(f))[: size["limit"] or None], tok) for f in HELD_OUT}
    by_length = context_prompts(python_docs(), tok, list(size["contexts"]), size["limit"] or 8)
    sets.update({f"context_{n}": prompts for n, prompts in by_length.items()})
    for name, figures in (known or {}).items():
        other = [s for s, prompts in sets.items() if figures.get(s, {}).get("prompts") != len(prompts)]
        if other:
            raise SystemExit(f"{name}'s earlier figures cover other prompts in {', '.join(other)}: measure it with "
                             "the same size")
    result = {name: _own_figures(by_set) for name, by_set in (known or {}).items()}
    for name, head in heads.items():
        model = load_for_decoding(head=head).model.eval().to(device)
        result[name] = {}
        for set_name, prompts in sets.items():
            if job.left() < 20:
                job.log(f"measure: out of time before {name} / {set_name}")
                break
            rows = [p.inputs or p.ids for p in prompts]
            figures = result[name][set_name] = {"prompts": len(prompts)}
            for k in (1, 3):
                _, lengths, per_position = decode_rows(model, rows, k=k, num_tokens=size["eval_tokens"],
                                                       eos_token_id=tok.eos_token_id, batch_size=size["eval_batch"])
                figures[f"k{k}"] = {**length_figures(lengths, per_position), "lengths": lengths}
            job.log(f"measure: {name} {set_name}: " + ", ".join(
                f"k{k} {figures[f'k{k}']['mean_acceptance_length']:.3f} +- {figures[f'k{k}']['se']:.3f}"
                for k in (1, 3)))
    try:
        rows = pair_with_first(result)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    base = next(iter(result))
    for name, set_name, paired in rows:
        job.log(f"measure: {name} - {base} {set_name}: " + ", ".join(
            f"{key} {d['difference']:+.3f} +- {d['se']:.3f}" for key, d in paired.items()))
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=540, help="seconds for the whole job")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=tuple(SIZES), help="prompts, batches and training steps (default: gpu on "
                    "cuda, cpu on a CPU)")
    ap.add_argument("--tiny", action="store_true", help="= --size tiny: a few prompts and steps, checks the script")
    ap.add_argument("--measure", nargs="+", metavar="NAME=HEAD", help="only the measure stage, of the shipped head "
                    "and these (a head trained elsewhere, e.g. on a CPU), into OUT/summary.json")
    ap.add_argument("--no-shipped", action="store_true", help="with --measure: leave the shipped head out (its "
                    "figures do not change run to run); the others are paired against the first given")
    ap.add_argument("--against", nargs="+", metavar="SUMMARY:NAME", help="with --no-shipped: pair the heads "
                    "against head NAME's figures in an earlier run's SUMMARY (summary.json, same size and "
                    "--eval-tokens) instead of decoding it again; the heads of further SUMMARY:NAMEs are paired "
                    "against the first from their figures too (no --measure needed: two earlier runs compared)")
    ap.add_argument("--eval-tokens", type=int, help="new tokens a prompt in the measure stage (default: the size's)")
    ap.add_argument("--eval-batch", type=int, help="prompts decoded together in the measure stage")
    ap.add_argument("--docs", type=Path, help="document records to train on (python -m mtpkit.datasets.documents); "
                    "default: built into OUT/docs.jsonl with the size's tokens")
    args = ap.parse_args()
    pairs = [spec.partition("=") for spec in args.measure or ()]
    if any(not name or not head for name, _, head in pairs):
        ap.error("--measure takes NAME=HEAD pairs, e.g. new=runs/head.safetensors")
    if args.no_shipped and not pairs and len(args.against or ()) < 2:
        ap.error("--no-shipped goes with --measure NAME=HEAD ... (or two --against figures)")
    known = {}
    for spec in args.against or ():
        path, _, name = spec.rpartition(":")
        if not args.no_shipped or not path:
            ap.error("--against SUMMARY:NAME goes with --no-shipped --measure NAME=HEAD ...")
        earlier = json.loads(Path(path).read_text()).get("acceptance", {})
        if name not in earlier:
            ap.error(f"--against: {path} holds no head {name!r} (it holds {', '.join(earlier) or 'none'})")
        if name in known or name in {n for n, _, _ in pairs}:
            ap.error(f"--against: head {name!r} is named twice; each head needs its own name")
        known[name] = earlier[name]
    size = dict(SIZES["tiny" if args.tiny else args.size or ("gpu" if args.device == "cuda" else "cpu")])
    size.update({k: v for k, v in (("eval_tokens", args.eval_tokens), ("eval_batch", args.eval_batch)) if v})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    job = Job(out, args.budget)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    summary["torch"] = torch.__version__
    job.log(f"start: {summary['device']}, budget {args.budget:.0f} s")
    if args.measure or known:
        heads = {} if args.no_shipped else {"shipped": SHIPPED}
        heads.update({name: Path(head) for name, _, head in pairs})
        summary["acceptance"] = measure(job, heads, args.device, size, known)
        summary_path.write_text(json.dumps(summary, indent=1))
        return 0

    budget = args.budget
    short = ["--num-prompts", str(size["short_prompts"]), "--batch-size", str(size["batch"]), "--seed", "41",
             "--word-share", "0.35", "--no-literature"]
    long = ["--num-prompts", str(size["long_prompts"]), "--batch-size", str(size["long_batch"]), "--batch-tokens",
            str(size["batch_tokens"]), "--seed", "42", "--long-share", "0.9", "--no-literature"]
    # the long prompts' build is CPU work, in the background while a GPU profiles and distils; on a CPU it would
    # share two cores with the distillation, so it runs after it. The engine decides batches' arithmetic, not which
    # prompts: the build takes the eager one
    build = distill_args(job, "long", long, 0, args.device, size, "eager")
    building = job.start(build) if args.device == "cuda" else None
    docs = args.docs or out / "docs.jsonl"
    docs_args = [str(docs), "--tokens", str(size["doc_tokens"]), "--seed", "1"]
    docs_building = None
    if not docs.is_file():  # a CPU read of every installed package's prose: beside the GPU's work, or in turn
        docs_building = job.start(docs_args, module="mtpkit.datasets.documents")
        if args.device != "cuda":
            docs_building.wait()
    if "profile" not in summary and (args.device == "cuda" or args.tiny):  # a CPU distils eagerly: no profile
        summary["profile"] = profile(job, args.device, size)
        summary_path.write_text(json.dumps(summary, indent=1))
    engine = summary.get("profile", {}).get("engine", "eager")
    job.run(distill_args(job, "short", short, minutes_for(SHARES["distill_short"] * budget), args.device, size,
                         engine))
    job.log(f"long prompts built: rc={building.wait() if building else job.run(build)}")
    job.run(distill_args(job, "long", long, minutes_for(SHARES["distill_long"] * budget), args.device, size, engine))
    parts = {out / f"features_{name}": out / f"{name}.jsonl" for name in ("short", "long")}
    if documents_stage(job, docs, docs_building, SHARES["documents"] * budget, args.device):
        parts[out / "features_docs"] = docs
    for features in parts:
        meta = json.loads((features / "meta.json").read_text())
        summary[features.name] = {k: meta.get(k) for k in ("records", "tokens")}
    head = train(job, parts, SHARES["train"] * budget, args.device, size)
    summary_path.write_text(json.dumps(summary, indent=1))
    if head is None:
        job.log("training or its export failed (the log above says why): no head to measure")
        return 1
    summary["acceptance"] = measure(job, {"shipped": SHIPPED, "new": head}, args.device, size)
    summary["seconds"] = time.monotonic() - job.began
    summary_path.write_text(json.dumps(summary, indent=1))
    job.log(f"done in {summary['seconds']:.0f} s -> {summary_path}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
