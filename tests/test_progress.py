"""The suite reports progress per test file with the time so far and the expected total (issue 22.8)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_each_file_prints_a_progress_line_with_the_expected_duration():
    files = ["tests/train/test_eta.py", "tests/progress_sample.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files,
                           "-k", "format_eta or sample"],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = proc.stdout
    assert re.search(r"2 test files, 3 tests \(the whole suite: about \d+ min on an idle 2-core machine\)", out), out
    lines = re.findall(r"^\[(\d)/2\] (\S+) (\d+) tests? in [\d.]+ s \(\d+:\d\d so far\)$", out, re.M)
    assert lines == [("1", "tests/train/test_eta.py", "1"), ("2", "tests/progress_sample.py", "2")], out
