#!/usr/bin/env bash
# The prepared GPU check: a 1B-class Llama-shaped model (random weights, Llama 3.2 1B shapes)
# converted to 8 K/V heads and uptrained with bf16 + torch.compile on one process, with
# shard=fsdp2 over one process, and through configs/accelerate/fsdp2.yaml; prints tokens/s and
# MFU per run and writes runs/gpu-check/gpu_check.json. Under 5 minutes on one H100/H200.
# Without CUDA (or with GPU_CHECK_TINY=1) the same runs use a tiny shape on CPU (~1 minute),
# so the script is exercised by tests/test_gpu_check.py. Details: scripts/tools/gpu_check.py.
#   bash scripts/gpu_check.sh
# GPU_CHECK_PYTHON: a Python with uptrain's dependencies (default: .venv, set up by scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${GPU_CHECK_PYTHON:-}" ]; then
  bash scripts/setup.sh
  GPU_CHECK_PYTHON=.venv/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$GPU_CHECK_PYTHON" scripts/tools/gpu_check.py "$@"
