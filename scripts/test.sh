#!/usr/bin/env bash
# The whole test suite (real-weights and multi-process tests included), after setting up .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_env.sh
python -m pytest -q "$@"
