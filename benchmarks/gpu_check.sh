#!/usr/bin/env bash
# One-GPU check (one H200, 15 minutes of device time): bf16 step time and MFU of 1B- and 8B-shaped layers vs
# torch fully_shard, pinned-memory checkpoint staging, CUDA memory metrics -> benchmarks/results/gpu_check.json.
# Installs nothing: it runs the repository's own environment (.venv when present, else python3 with the
# project installed). Stops after 8 minutes whatever happens. `benchmarks/gpu_check.sh --dry-run` checks the
# script on the CPU with tiny shapes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}  # PYTHON=... picks another interpreter with the project installed
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
exec timeout --signal=INT --kill-after=20 480 "$PY" -m benchmarks.gpu_check "$@"
