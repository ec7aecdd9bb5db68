"""scripts/paper/run.py on a clone: every input ships, the plan is printed, a missing input is one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

# What `git clone` gives run.py (no ../shared beside it; tmp_path has no "shared" sibling).
CLONED = ("scripts/paper", "configs", "examples", "results/paper")


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    root = tmp_path / "clone"
    for rel in CLONED:
        shutil.copytree(REPO / rel, root / rel, ignore=shutil.ignore_patterns("__pycache__"))
    assert not (root.parent / "shared").exists()
    return root


def run(clone: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")  # this checkout's uptrain
    return subprocess.run([sys.executable, "scripts/paper/run.py", *args], cwd=clone, env=env,
                          capture_output=True, text=True)


def test_check_on_a_clone_resolves_every_input_and_plans_every_step(clone):
    done = run(clone, "--check")
    assert done.returncode == 0, done.stderr
    assert "nothing to run: all 91 steps are done" in done.stdout  # the committed table is complete
    fresh = run(clone, "--check", "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    out = fresh.stdout
    assert "results: results/paper-fresh" in out and "91 of 91 steps to run" in out  # nothing reused
    assert "build stories260K-gqa4 from examples/stories260K-mha8" in out and "prepare data split" in out
    assert "pretrain the MHA reference" in out and "min (" in out.splitlines()[-1]
    reuse = run(clone, "--check", "--fresh", "--reference", "results/paper/reference-mha8")
    assert reuse.returncode == 0 and "pretrain" not in reuse.stdout and "90 of 91 steps to run" in reuse.stdout
    assert not (clone / "runs").exists() and not (clone / "results" / "paper-fresh").exists()  # --check writes nothing


@pytest.mark.parametrize("missing, named", [
    ("examples/data/paper/kjv-bible.txt.gz",
     "missing input examples/data/paper/kjv-bible.txt.gz (corpus kjv-bible.txt)"),
    ("examples/stories260K-mha8/model.safetensors", "missing input examples/stories260K-mha8/model.safetensors"),
])
def test_a_missing_input_is_one_line_and_exit_2(clone, missing, named):
    (clone / missing).unlink()
    proc = run(clone, "--fresh")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: " + named) and "git checkout" in proc.stderr
    assert not (clone / "runs").exists()  # refused before any work


def test_fresh_will_not_write_over_the_committed_table(clone):
    before = {p.name: p.read_bytes() for p in (clone / "results" / "paper").glob("*.json")}
    proc = run(clone, "--fresh", "--out", "results/paper")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--out" in proc.stderr
    assert before == {p.name: p.read_bytes() for p in (clone / "results" / "paper").glob("*.json")}


def test_fresh_first_steps_rebuild_stories260k_gqa4_and_score_it_as_committed(clone, tmp_path):
    proc = run(clone, "--fresh", "--only", "stories", "--out", str(tmp_path / "fresh"), "--max-steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = json.loads((tmp_path / "fresh" / "stories-gqa4.json").read_text())
    committed = json.loads((REPO / "results" / "paper" / "stories-gqa4.json").read_text())
    # committed from ../shared's original stories260K-gqa4; rebuilt here from the shipped copy
    assert fresh["val_tokens"] == committed["val_tokens"]
    assert fresh["val_loss"] == pytest.approx(committed["val_loss"], abs=1e-6)
