"""The fine-tuning experiment (docs/MTP.md section 5): does training with the MTP loss keep a released head aligned?

SmolLM2-135M-Instruct with mtpkit's shipped head stands in for a released model with MTP. Every arm fine-tunes it on
Shakespeare's plays (three held out) with the same data, steps and seeds (configs/smollm2_shakespeare_finetune.toml;
a seed also sets the data order):
  a    main loss only (mtp.depth = 0: the head is dropped, as transformers-based tools do), the base head grafted back
  b01  main + 0.1 x MTP loss, joint          b03  the same with 0.3
  c    the trunk from the main loss, the head from the isolated MTP loss (mtp.detach_trunk)
  d    a, then an MTP-only refresh of the grafted head on the fine-tuned model's own greedy continuations of
       passages of the training plays (mtpkit distill's records, data.mode = "tokens")
Each arm is measured on held-out text of the three plays (main loss) and, drafting over the shipped head's
vocabulary, on held-out passages and on the benchmark's general prompts (mean acceptance length at k = 1..3 and
speedup over plain decoding, greedy, batch 1). Every stage is kept on disk and skipped when rerun.

    python scripts/finetune_alignment.py --out runs/alignment [--seeds 0,1] [--arms a,b01,b03,c,d]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

import mtpkit
from mtpkit.assets import cache_dir
from mtpkit.bench.speedup import run_bench
from mtpkit.checkpoint.graft import graft
from mtpkit.checkpoint.hf import save_model
from mtpkit.datasets.distill import distill
from mtpkit.datasets.shakespeare import shakespeare_texts
from mtpkit.prompts import Prompt, encode_prompts, read_prompts
from mtpkit.resources import DEFAULT_PROMPTS, resource
from mtpkit.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "smollm2_shakespeare_finetune.toml"
HELD_OUT = ("othello_gut.txt", "tempest_gut.txt", "twelfth_night_gut.txt")
ARMS = {
    "a": ["--mtp.depth=0"],
    "b01": ["--mtp.mtp_lambda=0.1"],
    "b03": ["--mtp.mtp_lambda=0.3"],
    "c": ["--mtp.detach_trunk=true"],
}
KS = (1, 2, 3)


def speeches(path: Path, min_words: int = 40) -> list[str]:
    """The play's paragraphs (speeches, stage directions) long enough to prompt with."""
    paras = [p.strip() for p in path.read_text(encoding="utf-8", errors="replace").split("\n\n")]
    return [p for p in paras if len(p.split()) >= min_words]


def prepare(out: Path, n_prompts: int) -> dict:
    """The base model directory (SmolLM2 + the shipped head, HF layout), the training plays and the held-out
    passages: prompts (their first ~60 words) and evaluation text."""
    texts = shakespeare_texts(cache_dir() / "shakespeare")
    train_dir = out / "plays"
    if not train_dir.exists():
        train_dir.mkdir(parents=True)
        for f in sorted(texts.glob("*.txt")):
            if f.name not in HELD_OUT:
                (train_dir / f.name).symlink_to(f.resolve())
    base = out / "base"
    if not base.exists():
        model, tok, _, _ = mtpkit.load_for_decoding()  # the embedded SmolLM2 with its shipped head
        save_model(model, base, tok)
    rng = random.Random(0)
    held = [s for name in HELD_OUT for s in speeches(texts / name)]
    rng.shuffle(held)
    domain = [Prompt(" ".join(s.split()[:60]), False, "shakespeare") for s in held[:n_prompts]]
    train_passages = [s for f in sorted(train_dir.glob("*.txt")) for s in speeches(f)]
    rng.shuffle(train_passages)
    return {"base": base, "train_dir": train_dir, "domain": domain, "eval_text": held[n_prompts:n_prompts + 64],
            "refresh_prompts": [" ".join(s.split()[:60]) for s in train_passages[:256]]}


def train(run_dir: Path, base: Path, data: list[str], extra: list[str], seed: int) -> float:
    """`mtpkit train` of the recipe (skipped when run_dir holds a finished run); returns its wall seconds."""
    done = run_dir / "wall_seconds.txt"
    if done.exists():
        return float(done.read_text())
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "mtpkit", "train", str(RECIPE), f"--model.path={base}", f"--train.run_dir={run_dir}",
           f"--train.seed={seed}", f"--data.seed={1234 + seed}", f"--data.paths={json.dumps(data)}", *extra]
    subprocess.run(cmd, check=True)
    seconds = time.perf_counter() - start
    done.write_text(f"{seconds:.1f}")
    return seconds


def export(run_dir: Path, out: Path) -> Path:
    if not out.exists():
        subprocess.run([sys.executable, "-m", "mtpkit", "export", str(run_dir), "--out", str(out)], check=True)
    return out


def refresh_records(model_dir: Path, prompts: list[str], out: Path) -> Path:
    """The fine-tuned model's own greedy continuations of training-play passages (resumes)."""
    model = mtpkit.load_model(model_dir, mtp=False).eval()
    tok = load_tokenizer(model_dir)
    records = [{"prompt": p, "chat": False, "kind": "shakespeare"} for p in prompts]
    distill(model, tok, records, out, max_new_tokens=64, batch_size=32)
    return out


@torch.inference_mode()
def held_out_loss(model, tok, texts: list[str], seq_len: int = 256) -> float:
    """Mean next-token cross-entropy of the trunk over the held-out passages (each cut to seq_len tokens)."""
    total = count = 0.0
    for t in texts:
        bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        ids = torch.tensor([[bos, *tok.encode(t, add_special_tokens=False)[: seq_len - 1]]])
        logits = model(ids).logits[0, :-1].float()
        total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return total / count


def evaluate(model_dir: Path, setup: dict, general: list[Prompt], vocab: torch.Tensor, num_tokens: int) -> dict:
    # every arm drafts over the shipped head's vocabulary, as deployed
    model, tok, _, _ = mtpkit.load_for_decoding(model_dir, draft_vocab=vocab)
    result = {"held_out_loss": held_out_loss(model, tok, setup["eval_text"])}
    for name, prompts in (("domain", setup["domain"]), ("general", general)):
        prompts = encode_prompts([Prompt(p.text, p.chat, p.kind) for p in prompts], tok)
        rep = run_bench(model, prompts, num_tokens=num_tokens, ks=list(KS), repeats=1, step_repeats=0,
                        eos_token_id=tok.eos_token_id, progress=False)
        result[name] = {str(r["draft_tokens"]): {"mean_acceptance_length": r["mean_acceptance_length"],
                                            "speedup": r["speedup"], "identical": r["identical"]}
                        for r in rep["runs"]}
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/alignment")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--arms", default="a,b01,b03,c,d")
    ap.add_argument("--prompts", type=int, default=8, help="held-out domain prompts (and general ones)")
    ap.add_argument("--num-tokens", type=int, default=48)
    ap.add_argument("--refresh-steps", type=int, default=30)
    args = ap.parse_args()
    out = Path(args.out)
    setup = prepare(out, args.prompts)
    general = read_prompts(resource(DEFAULT_PROMPTS))[: args.prompts]
    vocab = mtpkit.load_for_decoding().model.drafter.draft_vocab
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if "base" not in results:
        results["base"] = {"wall_seconds": 0.0, **evaluate(setup["base"], setup, general, vocab, args.num_tokens)}
        results_path.write_text(json.dumps(results, indent=1))
    plays = [str(setup["train_dir"])]
    for seed in map(int, args.seeds.split(",")):
        for arm in args.arms.split(","):
            key = f"{arm}/seed{seed}"
            if key in results:
                continue
            run = out / ("a" if arm == "d" else arm) / f"seed{seed}"  # d starts from a's fine-tune
            wall = train(run, setup["base"], plays, ARMS["a" if arm == "d" else arm], seed)
            model_dir = export(run, run / "hf")
            if arm in ("a", "d"):  # what a transformers-based tool's fine-tune gets: the base head copied back
                if not (run / "grafted").exists():
                    graft(setup["base"], model_dir, run / "grafted")
                model_dir = run / "grafted"
            if arm == "d":
                refresh = out / "d" / f"seed{seed}"
                start = time.perf_counter()
                records = refresh_records(model_dir, setup["refresh_prompts"], refresh / "records.jsonl")
                wall += time.perf_counter() - start
                wall += train(refresh / "run", model_dir, [str(records)],
                              ["--mtp.only=true", "--data.mode=tokens", f"--train.steps={args.refresh_steps}",
                               "--optim.lr=3e-4", "--train.batch_size=4"], seed)
                model_dir = export(refresh / "run", refresh / "hf")
            results[key] = {"wall_seconds": wall, **evaluate(model_dir, setup, general, vocab, args.num_tokens)}
            results_path.write_text(json.dumps(results, indent=1))
            print(key, json.dumps(results[key]))
    print(table(results))
    print(f"plot: {plot(results, out / 'alignment.png')}")
    return 0


def _by_arm(results: dict) -> dict[str, list[dict]]:
    arms = {}
    for key, r in results.items():
        arms.setdefault(key.split("/")[0], []).append(r)
    return arms


def plot(results: dict, path: Path) -> Path:
    """Mean acceptance length against k per arm (domain and general prompts; seeds averaged) and the held-out loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = _by_arm(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, where in zip(axes, ("domain", "general")):
        for arm, rs in arms.items():
            ys = [sum(r[where][str(k)]["mean_acceptance_length"] for r in rs) / len(rs) for k in KS]
            ax.plot(KS, ys, marker="o", label=arm, linestyle="--" if arm == "base" else "-")
        ax.set(title=f"{where} prompts", xlabel="draft tokens k", ylabel="mean acceptance length", xticks=KS)
        ax.grid(alpha=0.3)
    axes[0].legend()
    names = list(arms)
    axes[2].bar(names, [sum(r["held_out_loss"] for r in arms[a]) / len(arms[a]) for a in names])
    lo = min(r["held_out_loss"] for rs in arms.values() for r in rs)
    axes[2].set(title="held-out main loss (3 plays)", ylim=(lo - 0.1, None))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def table(results: dict) -> str:
    """Markdown: per arm (mean over seeds, +- half the spread when there are several) the held-out loss and the
    mean acceptance length / speedup at each k on domain and general prompts."""
    arms = _by_arm(results)
    head = "| arm | held-out loss | " + " | ".join(f"{w} len k={k}" for w in ("domain", "general") for k in KS) + \
        " | domain speedup k=1..3 | wall s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def fmt(xs):
        m = sum(xs) / len(xs)
        return f"{m:.3f}" + (f" ±{(max(xs) - min(xs)) / 2:.3f}" if len(xs) > 1 else "")

    for arm, rs in arms.items():
        cells = [fmt([r["held_out_loss"] for r in rs])]
        cells += [fmt([r[w][str(k)]["mean_acceptance_length"] for r in rs]) for w in ("domain", "general") for k in KS]
        cells.append(" / ".join(f"{sum(r['domain'][str(k)]['speedup'] for r in rs) / len(rs):.2f}" for k in KS))
        cells.append(f"{sum(r['wall_seconds'] for r in rs) / len(rs):.0f}")
        lines.append(f"| {arm} ({len(rs)} seed{'s' * (len(rs) > 1)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
