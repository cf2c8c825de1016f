#!/usr/bin/env bash
# Installs kernel_api and its test dependencies into the current Python environment.
# Without torch present, torch 2.13.0 is installed first (on our CPU machines pip takes the
# local CPU build), so resolving the project does not pull gigabytes of CUDA wheels; a
# machine that already has torch (a GPU box with torch+cuda) keeps its own.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[dev]"
