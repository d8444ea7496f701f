#!/usr/bin/env bash
# The GPU check (issue 22): environment, host reads, forward costs of Qwen2.5-shaped random-weight models, the
# speedup and TTFA they predict, the case study calibrated to them, and the fast suite on the device; one JSON file.
# No network, no real weights, no venv needed: on a GPU machine its python3 with torch (and transformers) will do.
#
#   scripts/gpu-check.sh [--device cuda|cuda:N|cpu] [--json PATH] [--small] [--budget-s 480]
#
# --device cpu runs the small mode (seconds), as CI does. Everything else: scripts/gpu_check.py --help.
set -euo pipefail
cd "$(dirname "$0")/.."
# The interpreter: $SPECVOICE_PYTHON, else the project venv's, else python3 (the GPU machine's, which has torch).
py="${SPECVOICE_PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$py" scripts/gpu_check.py "$@"
