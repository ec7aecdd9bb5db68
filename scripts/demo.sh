#!/usr/bin/env bash
# Set up .venv if needed, then run the main job on the embedded default:
# convert examples/stories260K-mha8 to 2 K/V heads, uptrain it, print losses and KV cache.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m uptrain.demo "$@"
