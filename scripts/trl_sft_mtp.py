"""Fine-tune SmolLM2-135M-Instruct with its MTP head under TRL's SFTTrainer and PEFT LoRA, with mtpkit.hf's MTP loss.

The setup of scripts/finetune_alignment.py (Shakespeare's plays, three held out; the shipped head standing in for a
released model's), trained through transformers instead of `mtpkit train`:
  mtp    LoRA on the trunk, the head trained fully, main + lambda x MTP loss (mtpkit.hf.MTPSFTTrainer)
  plain  the same LoRA fine-tune with TRL's own SFTTrainer (main loss only), the base head grafted back: what a
         transformers-based tool gives today
Each arm's adapters are merged and saved with `mtp.*` (servable by vLLM / SGLang as is), then measured as
finetune_alignment.py measures: held-out loss, and mean acceptance length (k = 1..3) on held-out passages of the
plays and on the benchmark's general prompts, drafting over the shipped head's vocabulary.

    pip install -e .[hf-train]
    python scripts/trl_sft_mtp.py --out runs/trl_sft_mtp [--steps 60] [--arms mtp,plain] [--no-eval]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune_alignment import evaluate, prepare, speeches  # noqa: E402  (the experiment's data and measures)

import mtpkit  # noqa: E402
from mtpkit.assets import default_gguf_path  # noqa: E402
from mtpkit.bench.speedup import DEFAULT_HEAD, DEFAULT_PROMPTS, read_prompts, resource  # noqa: E402
from mtpkit.checkpoint.graft import graft  # noqa: E402
from mtpkit.checkpoint.mtp_head import load_mtp_head  # noqa: E402


def passages(train_dir: Path, seed: int) -> list[str]:
    """The training plays' speeches, shuffled."""
    out = [s for f in sorted(train_dir.glob("*.txt")) for s in speeches(f)]
    random.Random(seed).shuffle(out)
    return out


def fine_tune(arm: str, base: Path, texts: list[str], out: Path, args) -> float:
    """One arm's LoRA fine-tune, merged and saved to out/merged (skipped when done); returns its wall seconds."""
    import datasets
    import trl
    from peft import LoraConfig, get_peft_model

    from mtpkit.hf import with_mtp
    from mtpkit.hf.sft import MTPSFTTrainer

    done = out / "wall_seconds.txt"
    if done.exists():
        return float(done.read_text())
    start = time.perf_counter()
    tok = tf.AutoTokenizer.from_pretrained(base)
    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, lora)
    config = trl.SFTConfig(output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.batch,
                           learning_rate=args.lr, warmup_steps=3, logging_steps=5, save_strategy="no",
                           report_to=[], use_cpu=True, max_length=args.max_length, dataset_text_field="text",
                           gradient_checkpointing=False, seed=args.seed, disable_tqdm=True)
    data = datasets.Dataset.from_dict({"text": texts})
    if arm == "mtp":  # the shipped head file: its draft vocabulary is the one it drafts over when deployed
        model = with_mtp(model, head=resource(DEFAULT_HEAD), mtp_lambda=args.mtp_lambda)
        trainer = MTPSFTTrainer(model=model, args=config, train_dataset=data, processing_class=tok)
    else:
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tok)
    trainer.train()
    merged = model.merged() if arm == "mtp" else model.merge_and_unload()
    merged.save_pretrained(out / "merged")
    tok.save_pretrained(out / "merged")
    if arm == "plain":  # transformers saved no head: the base one copied back, as `mtpkit graft` does
        graft(base, out / "merged", out / "grafted")
    seconds = time.perf_counter() - start
    done.write_text(f"{seconds:.1f}")
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/trl_sft_mtp")
    ap.add_argument("--arms", default="mtp,plain")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--mtp-lambda", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=8, help="held-out domain prompts (and general ones)")
    ap.add_argument("--num-tokens", type=int, default=48)
    ap.add_argument("--no-eval", action="store_true", help="fine-tune and save only")
    args = ap.parse_args()
    out = Path(args.out)
    setup = prepare(out, args.prompts)
    texts = passages(setup["train_dir"], args.seed)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    general = read_prompts(resource(DEFAULT_PROMPTS))[: args.prompts]
    vocab = load_mtp_head(mtpkit.load_model(default_gguf_path()), resource(DEFAULT_HEAD)).drafter.draft_vocab
    if not args.no_eval and "base" not in results:
        results["base"] = {"wall_seconds": 0.0, **evaluate(setup["base"], setup, general, vocab, args.num_tokens)}
    for arm in args.arms.split(","):
        run = out / arm / f"seed{args.seed}"
        wall = fine_tune(arm, setup["base"], texts, run, args)
        model_dir = run / ("merged" if arm == "mtp" else "grafted")
        print(f"{arm}: {model_dir} ({wall:.0f} s)")
        if not args.no_eval:
            results[f"{arm}/seed{args.seed}"] = {"wall_seconds": wall,
                                                 **evaluate(model_dir, setup, general, vocab, args.num_tokens)}
            results_path.write_text(json.dumps(results, indent=1))
    for key, r in results.items():
        tau = {name: r[name]["1"]["mean_acceptance_length"] for name in ("domain", "general")}
        print(f"{key:14s} held-out loss {r['held_out_loss']:.3f}  tau(k=1) domain {tau['domain']:.3f} "
              f"general {tau['general']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
