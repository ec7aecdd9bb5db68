#!/usr/bin/env bash
# Set up (or update) the project's virtual environment in .venv: torch first, then uptrain.
# Idempotent: a second run only checks. Used by scripts/demo.sh and scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# torch first, and the right build of it: a plain `torch` requirement pulls the multi-GB CUDA
# build from PyPI. Without an NVIDIA driver we take the CPU build (PyTorch's CPU index, falling
# back to a plain install where that index cannot be reached, e.g. on machines that only see
# their own package mirror); with one, the default (CUDA) build. UPTRAIN_TORCH=cpu|cuda overrides.
# numpy comes along so torch does not warn "Failed to initialize NumPy" on first import.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  build=${UPTRAIN_TORCH:-}
  why="UPTRAIN_TORCH=$build"
  if [ -z "$build" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      build=cuda; why="an NVIDIA driver answers nvidia-smi"
    else
      build=cpu; why="no NVIDIA driver found"
    fi
  fi
  case "$build" in
    cpu|cuda) ;;
    *) echo "setup: UPTRAIN_TORCH must be cpu or cuda, got '$build'" >&2; exit 2 ;;
  esac
  echo "setup: installing torch 2.13.0, $build build ($why; set UPTRAIN_TORCH=cpu|cuda to choose)"
  pip_torch() { .venv/bin/python -m pip install "torch==2.13.0" numpy "$@" >> .venv/torch-install.log 2>&1; }
  if [ "$build" = cpu ]; then
    pip_torch --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple \
        --timeout 15 --retries 1 \
      || { echo "setup: PyTorch's CPU index not reachable; plain install instead"; pip_torch; } \
      || { tail -20 .venv/torch-install.log >&2; exit 1; }
  else
    pip_torch || { tail -20 .venv/torch-install.log >&2; exit 1; }
  fi
  .venv/bin/python -c "import torch; print('setup: torch', torch.__version__, '(CUDA ' + str(torch.version.cuda) + ')' if torch.version.cuda else '(CPU)')" \
    || { echo "torch did not install" >&2; exit 1; }
fi
if ! .venv/bin/python -c "import uptrain, pytest, xdist, transformers, accelerate, datasets, lm_eval, onnxruntime, onnxscript" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.uptrain-installed ]; then
  echo "setup: installing uptrain and its dependencies into .venv (log: .venv/install.log)"
  # eval: lm-evaluation-harness for --tasks, so tests/measure/test_tasks.py really runs it (~1 min more)
  # deploy: onnx, onnxruntime, onnxscript for tests/measure/test_deploy.py's ONNX check (~120 MB installed)
  .venv/bin/python -m pip install -e ".[test,tensorboard,eval,deploy]" > .venv/install.log 2>&1 \
    || { tail -20 .venv/install.log >&2; exit 1; }
  .venv/bin/python -c "import uptrain, pytest, xdist, transformers, accelerate, datasets, lm_eval, onnxruntime, onnxscript" \
    || { echo "uptrain did not install" >&2; exit 1; }
  touch .venv/.uptrain-installed
fi
