#!/usr/bin/env bash
# The main job: MTP self-speculative decoding on the embedded default model (SmolLM2-135M-Instruct, fetched once
# from PyPI, with the MTP head shipped in mtpkit/resources) in float32, benchmarked against plain decoding,
# transformers' generate() and its prompt-lookup decoding on 20 prompts of several kinds, k = 1 and 3 as a chain and
# as a draft tree with the head's top 3 at the first position (--draft-widths 3), each also with drafts of up to 4
# tokens looked up in the context where its last 2-4 tokens occurred before (--draft-lookup 4), k = 0: those
# context drafts alone, without the head, and draft="auto" (--draft-auto: per row and step, plain, head or context
# drafts as the measured costs and acceptance say); prints the report.
# Extra arguments go to `mtpkit bench` (e.g. --dtype bfloat16, --quantize int8, --draft-min-prob 0,0.5). float32
# is the default because bf16 logits tie often (a step of 0.125 near 20), and a 1-row decode and a (k+1)-row verify
# round differently, so bf16 speculative output equals plain output only up to such ties (docs/MTP.md section 6).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_env.sh
mtpkit bench --dtype float32 --draft-tokens 0,1,3 --draft-widths 3 --draft-lookup 0,4 --draft-auto --repeats 1 --baseline hf,pld "$@"
