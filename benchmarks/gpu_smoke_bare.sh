#!/usr/bin/env bash
# Bare-machine GPU smoke check: needs only python3 with torch, transformers, safetensors and
# fsspec (no Ray, vLLM, tensordict or zarr; no network). One PASS/FAIL/SKIP line per step;
# see benchmarks/gpu_smoke_bare.py. On one GPU it runs in a few minutes:
#   bash benchmarks/gpu_smoke_bare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/gpu_smoke_bare.py "$@"
