"""uptrain/stopping/: every command stops in one line from its first instruction, however it was
started (`python -m uptrain.X` or the `uptrain-X` console script), and a decided exit code stands.

Real processes, real signals; the console scripts are this environment's (`pip install -e .`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import EXAMPLE_MHA8, REPO, VALID_TXT
from test_demo_stop import _stopped

BIN = Path(sys.executable).parent
LINE = {"uptrain-demo": "uptrain.demo: ", "uptrain-sweep": "uptrain.sweep: ", "uptrain-convert": "uptrain.convert: "}


def _argv(script: str, out: Path) -> list[str]:
    if script == "uptrain-demo":
        return ["--out", str(out), "--tasks", "none"]
    if script == "uptrain-sweep":
        return [str(EXAMPLE_MHA8), "--data", str(VALID_TXT), "--out", str(out)]
    return [str(EXAMPLE_MHA8), "--kv-heads", "2", "--out", str(out)]


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("script", sorted(LINE))
def test_a_console_script_stops_in_one_line_during_its_imports(tmp_path, script, signame):
    """Before: `uptrain-demo` printed a 40-line traceback on Ctrl-C in its first seconds and exited
    143 silently on SIGTERM (`python -m uptrain.demo` printed one line)."""
    command = BIN / script
    assert command.is_file(), f"{command} is missing: install the package (bash scripts/setup.sh)"
    out = tmp_path / "out"
    code, err = _stopped([str(command), *_argv(script, out)], signame, {}, None)  # once handlers exist, before torch
    assert code == 128 + getattr(signal, signame), (script, signame, err[-3000:])
    assert err.count("\n") == 1 and err.startswith(LINE[script]) and "Traceback" not in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_signal_after_the_exit_code_is_decided_does_not_change_it(tmp_path):
    """A Ctrl-C while a finished command shuts down (atexit, torch's threads) leaves its exit code:
    before, a finished sweep's shutdown interrupted by Ctrl-C exited 130."""
    script = textwrap.dedent("""
        import atexit, os, signal, time
        from uptrain.stopping import at_once
        at_once.install("uptrain.test")
        atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.3)))
        at_once.finish(0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
