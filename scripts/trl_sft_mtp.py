"""Fine-tune SmolLM2-135M-Instruct with its MTP head under TRL's SFTTrainer and PEFT LoRA, with mtpkit.hf's MTP loss.

The data and measures of scripts/finetune_alignment.py (Python sources of installed packages, held-out files; the
shipped head standing in for a released model's), trained through transformers instead of `mtpkit train`:
  mtp    LoRA on the trunk, the head trained fully, main + MTP loss at three chained depths with FastMTP's weights
         [0.51, 0.31, 0.18] x lambda (mtpkit.hf.MTPSFTTrainer), as that experiment's arms b train
  plain  the same LoRA fine-tune with TRL's own SFTTrainer (main loss only), the base head grafted back: what a
         transformers-based tool gives today (its arm a)
Each arm's adapters are merged and saved with `mtp.*` (servable by vLLM / SGLang as is), then measured as
finetune_alignment.py measures: held-out and general loss, and mean acceptance length at k = 1..3 on held-out
domain prompts and on general prompts (greedy, full vocabulary; `identical`: speculative == plain decoding).

    pip install -e .[hf-train]
    python scripts/trl_sft_mtp.py --out runs/trl_sft_mtp                 # 30 LoRA steps of 4 x 256 tokens an arm
    python scripts/trl_sft_mtp.py --out /tmp/trl_check --steps 2 --no-eval  # a check that it runs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune_alignment import KS, TINY, evaluate, general_answers, prepare  # noqa: E402  (the experiment's data)

from mtpkit.assets import default_gguf_path  # noqa: E402
from mtpkit.checkpoint.graft import graft  # noqa: E402
from mtpkit.datasets.code_corpus import read_corpus  # noqa: E402
from mtpkit.tokenizer import load_tokenizer  # noqa: E402
from mtpkit.refresh import FASTMTP_WEIGHTS  # noqa: E402

# the evaluation sets: finetune_alignment's CPU run trimmed to minutes (training length is --steps)
EVAL = dict(TINY, domain_prompts=16, general_prompts=16, new_tokens=64, loss_windows=8, seq_len=512, refresh_prompts=1)


def fine_tune(arm: str, base: Path, texts: list[str], out: Path, args) -> tuple[Path, float]:
    """One arm's LoRA fine-tune, merged and saved (skipped when done); returns its model directory and seconds."""
    import datasets
    import trl
    from peft import LoraConfig, get_peft_model

    from mtpkit.hf import with_mtp
    from mtpkit.hf.sft import MTPSFTTrainer

    final = out / ("merged" if arm == "mtp" else "grafted")
    done = out / "wall_seconds.txt"
    if final.exists() and done.exists():
        return final, float(done.read_text())
    start = time.perf_counter()
    tok = tf.AutoTokenizer.from_pretrained(base)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), lora)
    config = trl.SFTConfig(output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.batch,
                           learning_rate=args.lr, warmup_steps=max(1, args.steps // 20), logging_steps=5,
                           save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                           max_length=args.seq_len, dataset_text_field="text", gradient_checkpointing=False,
                           seed=args.seed, disable_tqdm=True)
    data = datasets.Dataset.from_dict({"text": texts})
    if arm == "mtp":  # the base directory's own mtp.* (the shipped head): one layer, chained to three depths
        model = with_mtp(model, depth=3, weights=[args.mtp_lambda * w for w in FASTMTP_WEIGHTS])
        trainer = MTPSFTTrainer(model=model, args=config, train_dataset=data, processing_class=tok)
    else:
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tok)
    trainer.train()
    merged = out / "merged"
    (model.merged() if arm == "mtp" else model.merge_and_unload()).save_pretrained(merged)
    tok.save_pretrained(merged)
    if arm == "plain":  # transformers saved no head: the base one copied back, as `mtpkit graft` does
        graft(base, merged, final, overwrite=True)
    seconds = time.perf_counter() - start
    done.write_text(f"{seconds:.1f}")
    return final, seconds


def chunks(docs: list[str], tok, tokens: int) -> list[str]:
    """Each file as consecutive pieces of at most `tokens` tokens: SFTTrainer truncates each example to max_length,
    which would train on the files' first lines (licences, imports) alone; packing instead would let attention run
    across files on CPU, where transformers' padding-free batches need FlashAttention."""
    out = []
    for doc in docs:
        ids = tok(doc, add_special_tokens=False)["input_ids"]
        out += [tok.decode(ids[i : i + tokens]) for i in range(0, len(ids), tokens)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/trl_sft_mtp")
    ap.add_argument("--arms", default="mtp,plain")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--mtp-lambda", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-eval", action="store_true", help="fine-tune and save only")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = dict(EVAL, train_tokens=max(args.steps * args.batch * args.seq_len, 65536))  # corpus: enough files
    setup = prepare(out, out / "corpus", load_tokenizer(default_gguf_path()), size)
    texts = chunks([d["text"] for d in read_corpus(out / "corpus" / "train.jsonl")], load_tokenizer(setup["base"]),
                   args.seq_len - 2)
    device = torch.device("cpu")
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    answers = None if args.no_eval else general_answers(setup, out, device, size["new_tokens"])
    if answers is not None and "base" not in results:
        results["base"] = {"wall_seconds": 0.0, **evaluate(setup["base"], setup, answers, device, size)}
        results_path.write_text(json.dumps(results))
    for arm in args.arms.split(","):
        model_dir, wall = fine_tune(arm, setup["base"], texts, out / arm / f"seed{args.seed}", args)
        print(f"{arm}: {model_dir} ({wall:.0f} s)", flush=True)
        if answers is not None:
            results[f"{arm}/seed{args.seed}"] = {"wall_seconds": wall,
                                                 **evaluate(model_dir, setup, answers, device, size)}
            results_path.write_text(json.dumps(results))
    for key, r in results.items():
        taus = {w: " ".join(f"{r[w][str(k)]['mean_acceptance_length']:.3f}" for k in KS) for w in ("domain", "general")}
        same = all(r[w][str(k)]["identical"] for w in ("domain", "general") for k in KS)
        print(f"{key:12s} loss domain {r['domain_loss']:.4f} general {r['general_loss']:.4f}; acceptance k=1..3 "
              f"domain {taus['domain']}, general {taus['general']}; speculative == plain: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
