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
# A plain `torch` requirement would pull a multi-GB CUDA build; take the CPU build 2.13.0
# (on this workplace's machines it lies on disk) unless some torch is already installed.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch 2.13.0 (CPU build) into .venv"
  .venv/bin/python -m pip install "torch==2.13.0" > .venv/torch-install.log 2>&1 \
    || { tail -20 .venv/torch-install.log >&2; exit 1; }
  .venv/bin/python -c "import torch" || { echo "torch did not install" >&2; exit 1; }
fi
if ! .venv/bin/python -c "import uptrain, pytest, transformers, accelerate, datasets" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.uptrain-installed ]; then
  echo "setup: installing uptrain and its dependencies into .venv (log: .venv/install.log)"
  .venv/bin/python -m pip install -e ".[test,tensorboard]" > .venv/install.log 2>&1 \
    || { tail -20 .venv/install.log >&2; exit 1; }
  .venv/bin/python -c "import uptrain, pytest, transformers, accelerate, datasets" \
    || { echo "uptrain did not install" >&2; exit 1; }
  touch .venv/.uptrain-installed
fi
