#!/usr/bin/env bash
# GPU smoke check (FSDP2 + vLLM sleep/wake, 2 GRPO iterations on a 0.5B-class model built
# here). Run on a machine with an NVIDIA GPU and the CUDA image's environment:
#   bash benchmarks/gpu_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# the repository's venv, else the image's (on PATH)
if [ -x .venv/bin/python ]; then PYTHON=${PYTHON:-.venv/bin/python}; else PYTHON=${PYTHON:-python}; fi
export VLLM_ENABLE_V1_MULTIPROCESSING=0   # the engine lives in the worker process (weights pushed in place)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
exec "$PYTHON" benchmarks/gpu_smoke.py "$@"
