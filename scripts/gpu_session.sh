#!/usr/bin/env bash
# A short stay on a remote GPU machine reached by commands that each carry at most 64 MiB of files (no network there;
# ~15 minutes in all, released when idle), spent in two back-to-back commands on the same machine. The embedded
# model's 98 MB GGUF is too large for one command, so it travels in two halves, and each command does GPU work
# meanwhile:
#
#   bash scripts/gpu_session.sh split        # here, once: the GGUF in halves under the git-ignored .gpu/, the
#                                            #   head's training-side documents (.gpu/docs, 1.5 MB gzipped), and fla's
#                                            #   pure-Python wheels (no network there) under the git-ignored .whl/
#   bash scripts/gpu_session.sh check        # call 1, carry .gpu/half1 and .whl: keeps half 1 in /tmp/mtpkit, then
#                                            #   the GPU check (docs/MTP.md "The GPU check"; fla from the wheels)
#   bash scripts/gpu_session.sh alignment    # call 2, carry .gpu/half2: joins the GGUF, then the fine-tuning
#                                            #   experiment (scripts/finetune_alignment.py, docs/MTP.md section 5)
#   bash scripts/gpu_session.sh head         # or, in call 2 instead, carry .gpu/half2 and .gpu/docs: the next head
#                                            #   (scripts/gpu_head.py)
#
# Each stage runs under `timeout` so that what it finished is copied to $OUT (the folder whose files come back) even
# when it overruns; the budgets below leave ~2 minutes of the 15 for the machine's start. Checked on a CPU with
# `GPU_SESSION_TINY=1 OUT=/tmp/out bash scripts/gpu_session.sh split|check|alignment|head` (tiny sizes, on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:?"give a stage: split, check, alignment or head"}
CACHE=${GPU_SESSION_CACHE:-/tmp/mtpkit}
OUT=${OUT:?"set OUT to the folder whose files come back (the run tool sets it)"}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1  # the logs are complete up to the moment a timeout stops a stage
if [[ -n "${GPU_SESSION_TINY:-}" ]]; then
  CHECK=(--device cpu --tiny --budget 60); ALIGN=(--device cpu --size tiny --deadline-minutes 5)
  HEAD=(--device cpu --tiny); DOC_LINES=1
else
  CHECK=(--budget 200); ALIGN=(--device cuda --deadline-minutes 6); HEAD=(--budget 400); DOC_LINES=0
fi

case "$STAGE" in
  split)
    src=$($PY -c "from mtpkit.assets import default_gguf_path; print(default_gguf_path())")
    rm -rf .gpu/half1 .gpu/half2 && mkdir -p .gpu/half1 .gpu/half2
    split -n 2 -d "$src" .gpu/part && mv .gpu/part00 .gpu/half1/ && mv .gpu/part01 .gpu/half2/
    # the documents are read here, on the side of the split the held-out document chats were not drawn from
    rm -rf .gpu/docs && mkdir -p .gpu/docs
    $PY -m mtpkit.datasets.documents .gpu/docs/docs.jsonl --tokens 1500000 --seed 1 && gzip -9 .gpu/docs/docs.jsonl
    rm -rf .whl && $PY -m pip download -q --no-deps --only-binary=:all: -d .whl "flash-linear-attention>=0.3" fla-core
    du -sh .gpu/half1 .gpu/half2 .gpu/docs .whl ;;
  check)
    mkdir -p "$CACHE" && cp .gpu/half1/part00 "$CACHE/"
    if ls .whl/*.whl > /dev/null 2>&1; then
      $PY -m pip install -q --no-index --no-deps --target /tmp/fla .whl/*.whl && export PYTHONPATH=/tmp/fla
    fi
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
    timeout 260 $PY -m mtpkit.bench.gpu_check --out "$OUT/gpu_check" "${CHECK[@]}" > "$OUT/gpu_check.log" 2>&1 ||
      echo "gpu_check exited $?" >> "$OUT/gpu_check.log"
    tail -40 "$OUT/gpu_check.log" ;;
  alignment|head)
    cat "$CACHE/part00" .gpu/half2/part01 > "$CACHE/$GGUF"
    size=$($PY -c "from mtpkit.assets import SMOLLM2_GGUF_SIZE; print(SMOLLM2_GGUF_SIZE)")
    [[ $(stat -c %s "$CACHE/$GGUF") == "$size" ]] || { echo "the joined GGUF is not $size bytes: run check first"; exit 1; }
    export MTPKIT_CACHE=$CACHE PYTHONPATH=.
    if [[ $STAGE == alignment ]]; then
      timeout 420 $PY scripts/finetune_alignment.py --out /tmp/alignment --arms a,b01,c,d,b03,e \
        --no-speedup "${ALIGN[@]}" > "$OUT/alignment.log" 2>&1 || echo "exited $?" >> "$OUT/alignment.log"
      cp /tmp/alignment/{results.json,table.md,alignment.png} "$OUT/" 2>/dev/null || true
      tail -30 "$OUT/alignment.log"
    else
      gunzip -c .gpu/docs/docs.jsonl.gz > /tmp/docs.jsonl
      if (( DOC_LINES )); then sed -i "1,${DOC_LINES}!d" /tmp/docs.jsonl; fi  # the check's few documents
      timeout 450 $PY scripts/gpu_head.py --out /tmp/gpu_head --docs /tmp/docs.jsonl "${HEAD[@]}" \
        > "$OUT/gpu_head.log" 2>&1 ||
        echo "exited $?" >> "$OUT/gpu_head.log"
      cp /tmp/gpu_head/{head.safetensors,summary.json,log.txt} "$OUT/" 2>/dev/null || true
      tail -30 "$OUT/gpu_head.log"
    fi ;;
  *) echo "unknown stage $STAGE: split, check, alignment or head"; exit 2 ;;
esac
