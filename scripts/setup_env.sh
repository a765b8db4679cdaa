#!/usr/bin/env bash
# Create .venv (Python >= 3.11) and install mtpkit with its test extras. Sourced by demo.sh and test.sh.
# torch==2.13.0 is installed first only when no torch is present: on CPU-only machines with a local CPU wheel pip
# takes that file, and a GPU machine keeps (or gets) its CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -c 'import sys; assert sys.version_info >= (3, 11), "mtpkit needs Python >= 3.11"'
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
log=.venv/install.log
{ python -c 'import torch' 2>/dev/null || python -m pip install "torch==2.13.0"; python -m pip install -e ".[dev]"; } \
  >"$log" 2>&1 || { cat "$log"; echo "setup failed: see $log" >&2; exit 1; }
