#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite (what .ci/run runs).
# Files run on UPTRAIN_TEST_WORKERS pytest-xdist workers (default 3), the longest first (tests/conftest.py):
# many tests wait on real processes, signals and a scheduler, so 3 workers keep 2 cores busy. Each file
# stays on one worker (--dist loadfile), so a module's fixtures are made once. Extra arguments go to
# pytest (e.g. `bash scripts/test.sh -n 0 tests/convert` runs those files in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -n "${UPTRAIN_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"
