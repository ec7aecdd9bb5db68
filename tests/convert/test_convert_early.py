"""What needs no model is refused before torch is imported (`uptrain.convert.io.early`): one line, exit 2,
nothing written. Real processes under `python -X importtime`, which lists every module imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EXAMPLE_MHA8, REPO

CASES = {  # name -> (arguments after the checkpoint, the start of the one error line)
    "kv-heads not positive": (["--kv-heads", "0"], "error: --kv-heads must be positive, got 0"),
    "kv-heads not a divisor": (["--kv-heads", "3"],
                               "error: 3 does not divide the 8 K/V heads; valid --kv-heads: 1, 2, 4, 8"),
    "kv-heads above the model's": (["--kv-heads", "16"], "error: the checkpoint has 8 K/V heads (8 query heads); "
                                                        "pooling cannot make 16"),
    "the model's own count": (["--kv-heads", "8"], "error: --kv-heads 8 is the checkpoint's own K/V head count: "
                                                   "nothing to convert; use the checkpoint as it is, or pass fewer: "
                                                   "1, 2, 4"),
    "the model's own count, dry run": (["--kv-heads", "8", "--dry-run"], "error: --kv-heads 8 is the checkpoint's own"),
    "the model's own count, another dtype": (["--kv-heads", "8", "--dtype", "bfloat16"],
                                             "error: --kv-heads 8 is the checkpoint's own"),
    "calib file missing": (["--kv-heads", "4", "--method", "fit", "--calib", "no-such.txt"],
                           "error: --calib file no-such.txt does not exist"),
}


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "uptrain.convert", *args], cwd=cwd,
                          capture_output=True, text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def _imported(stderr: str) -> set[str]:
    """Top-level packages in `-X importtime`'s lines ('import time: self | cumulative | name')."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


def _refused(proc: subprocess.CompletedProcess, start: str) -> None:
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith(start), proc.stderr[-2000:]
    imported = _imported(proc.stderr)
    assert "uptrain" in imported  # importtime lines were read
    assert not imported & {"torch", "transformers", "safetensors", "numpy"}, sorted(imported)
    assert proc.stdout == ""


@pytest.mark.parametrize("case", list(CASES))
def test_refused_before_torch_is_imported(case, tmp_path):
    args, start = CASES[case]
    _refused(_run([str(EXAMPLE_MHA8), *args, "--out", str(tmp_path / "out")], REPO), start)
    assert not (tmp_path / "out").exists()


def test_a_missing_folder_and_a_folder_without_config_are_refused_before_torch(tmp_path):
    _refused(_run(["./no-such-model", "--kv-heads", "2", "--out", str(tmp_path / "o")], tmp_path),
             "error: checkpoint folder ./no-such-model does not exist")
    (tmp_path / "empty").mkdir()
    _refused(_run(["empty", "--kv-heads", "2", "--out", str(tmp_path / "o")], tmp_path),
             f"error: {tmp_path / 'empty'} has no config.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_an_existing_output_is_refused_before_torch(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    _refused(_run([str(EXAMPLE_MHA8), "--kv-heads", "4", "--method", "fit", "--out", str(out)], REPO),
             f"error: output {out} already exists; pass --force")
    assert [p.name for p in out.iterdir()] == ["keep"]
