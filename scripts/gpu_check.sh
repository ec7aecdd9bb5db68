#!/usr/bin/env bash
# The prepared GPU check: every GPU path; a 1B-class Llama-shaped model (random weights, Llama 3.2 1B shapes)
# converted to 8 K/V heads and uptrained with bf16 + torch.compile on one process, with
# shard=fsdp2 over one process, and through configs/accelerate/fsdp2.yaml; prints tokens/s and
# MFU per run, after the paths beside the trainer (a 7B-shaped layer through the quality path with
# --device cuda, the source's samples, eval), into runs/gpu-check/gpu_check.json. Budget: 8 minutes
# on one H100 (an estimate: not yet run on a GPU).
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
