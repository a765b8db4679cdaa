#!/usr/bin/env bash
# What `mtpkit distill --features` saves: distillation alone, distillation keeping the trunk's features, and the
# `mtpkit features` pass the second replaces, on the same prompts and batches, side by side in one run.
#   bash scripts/bench_distill_features.sh [WORK_DIR] [MINUTES] [DTYPE]
# (the default model; WORK_DIR is emptied; each distillation stops after MINUTES; DTYPE as `mtpkit distill --dtype`)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_env.sh >/dev/null
work=${1:-runs/bench_distill_features}; minutes=${2:-4}; dtype=${3:-auto}
rm -rf "$work"; mkdir -p "$work"
common=(--num-prompts 1024 --max-new-tokens 128 --batch-size 128 --seed 30 --dtype "$dtype")
mtpkit distill --out "$work/plain.jsonl" "${common[@]}" --max-minutes 0 2>/dev/null  # the prompt list, once
cp "$work/plain.jsonl.prompts.jsonl" "$work/kept.jsonl.prompts.jsonl"
mtpkit distill --out "$work/plain.jsonl" "${common[@]}" --max-minutes "$minutes" 2>/dev/null
mtpkit distill --out "$work/kept.jsonl" "${common[@]}" --max-minutes "$minutes" \
  --features "$work/kept_features" 2>/dev/null
mtpkit features --records "$work/plain.jsonl" --out "$work/pass_features" --compute "$dtype" 2>/dev/null
