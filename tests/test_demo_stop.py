"""A stop at any moment of `python -m uptrain.demo` (and of the sweep's uptraining) ends it cleanly.

The demo converts, uptrains and scores in one process; the conversion's folders are written beside
their place and the trainer handles stop signals itself while `train()` runs. Whatever the moment,
from the imports to the uptraining's steps: exit 128 + the signal, one line, no traceback, no
half-written folder. Real processes, real signals.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conftest import EXAMPLE_MHA8, REPO, TRAIN_TXT, VALID_TXT

DEMO_ARGS = ["--stories", "2", "--calib-tokens", "1024", "--refine-steps", "30", "--tasks", "none",
             "budget.tokens=40960", "optim.warmup_steps=2", "log.progress_bar=false", "threads=1"]
LINE = re.compile(r"^uptrain\.(demo|sweep): (interrupted|stopped by SIG\w+); ")


def _caught(pid: int, sig: int) -> bool:
    """Whether process `pid` handles `sig` (/proc's SigCgt: Python's defaults do not catch SIGTERM)."""
    try:  # (before its exec the child has the test process's handlers: wait for the new program)
        if b"uptrain" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return bool(int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, flags=re.M).group(1), 16) >> (sig - 1) & 1)


def _stopped(command: list[str], signame: str, env: dict[str, str], wait_for: str | None) -> tuple[int, str]:
    """Run `command`; send `signame` once stderr shows `wait_for` (None: once the handlers exist,
    during the imports; "" : the process signals itself through a test hook). (exit code, stderr)."""
    proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if wait_for is None:
        while proc.poll() is None and not _caught(proc.pid, signal.SIGTERM):
            time.sleep(0.005)
        # the handlers must exist before the heavy imports: torch is not loaded yet
        assert b"libtorch" not in Path(f"/proc/{proc.pid}/maps").read_bytes()
        proc.send_signal(getattr(signal, signame))
    elif wait_for:
        seen = ""
        while proc.poll() is None and wait_for not in seen:
            seen = proc.stderr.readline()
        proc.send_signal(getattr(signal, signame))
    err = proc.communicate(timeout=300)[1]
    return proc.returncode, err


# (signal, what the test waits for, test hooks): the imports; the conversion's calibration and
# refinement (the pause hook); the uptraining's set-up (a phase) and its steps (after step 2).
MOMENTS = [
    ("SIGTERM", None, {}),
    ("SIGINT", "paused at calibrate", {"UPTRAIN_TEST_PAUSE_AT": "calibrate:60"}),
    ("SIGTERM", "paused at refine", {"UPTRAIN_TEST_PAUSE_AT": "refine:60"}),
    ("SIGTERM", "", {"UPTRAIN_TEST_SIGNAL_IN_SETUP": "models:SIGTERM"}),
    ("SIGUSR1", "", {"UPTRAIN_TEST_SIGNAL_AT": "2:0:SIGUSR1"}),
]


def test_a_stop_at_any_moment_ends_the_demo_in_one_line_without_half_written_folders(tmp_path):
    def run(k: int):
        signame, wait_for, env = MOMENTS[k]
        out = tmp_path / f"demo{k}"
        code, err = _stopped([sys.executable, "-m", "uptrain.demo", "--out", str(out), *DEMO_ARGS],
                             signame, env, wait_for)
        return out, signame, code, err

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(run, range(len(MOMENTS))))
    for out, signame, code, err in runs:
        assert code == 128 + getattr(signal, signame), (out.name, signame, err[-3000:])
        assert "Traceback" not in err and "terminate called" not in err, err[-3000:]
        assert LINE.match(err.strip().splitlines()[-1]), err[-2000:]
        left = sorted(str(p.relative_to(out)) for p in out.rglob("*")) if out.exists() else []
        assert not [n for n in left if ".partial-" in n or "partial-" in Path(n).name], left
        assert not (out / "uptrain" / "model").exists(), left  # the uptraining never finished


def test_a_stop_during_the_sweeps_uptraining_ends_it_in_one_line_and_the_rerun_continues(tmp_path):
    out = tmp_path / "sweep"
    command = [sys.executable, "-m", "uptrain.sweep", str(EXAMPLE_MHA8), "--data", str(VALID_TXT), "--stories", "2",
               "--kv-heads", "2", "--out", str(out), "--uptrain-tokens", "16384", "--train-data", str(TRAIN_TXT)]
    code, err = _stopped(command, "SIGTERM", {"UPTRAIN_TEST_SIGNAL_AT": "1:0:SIGTERM"}, "")
    assert code == 143 and "Traceback" not in err, err[-3000:]
    assert LINE.match(err.strip().splitlines()[-1]) and "rerun to continue" in err, err[-2000:]
    assert (out / "kv2" / "config.json").is_file()  # the conversion finished before the uptraining: kept
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mean kv2: kept from the earlier run" in done.stdout, done.stdout
    assert (out / "kv2-uptrained" / "model" / "config.json").is_file()


def test_a_demo_stopped_in_its_conversion_continues_from_the_kept_layers_as_its_stop_line_says(tmp_path):
    """Before: the stop line said "the same command continues from there", and the rerun emptied
    --out, kept layers and all, and refined every layer again."""
    out = tmp_path / "demo"
    command = [sys.executable, "-m", "uptrain.demo", "--out", str(out), *DEMO_ARGS]
    code, err = _stopped(command, "SIGTERM", {"UPTRAIN_TEST_PAUSE_AT": "kept-1:60"}, "paused at kept-1")
    assert code == 143 and "the same command continues from there" in err, err[-3000:]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "continues an interrupted conversion: layers 0-1 of 5" in done.stdout, done.stdout[-3000:]
    assert not [p for p in out.iterdir() if ".layers-" in p.name]  # the output in place: the kept layers go


def test_a_demo_stopped_in_its_uptraining_continues_from_its_checkpoint_and_ends_as_an_uninterrupted_one(tmp_path):
    """Before: the rerun emptied --out, converted again and trained from step 0, and the stop line said
    "the folder being written was removed". Now the stop line says what is kept and what the rerun does,
    the rerun keeps the conversion and resumes the uptraining, and its weights are an uninterrupted demo's."""
    out, whole = tmp_path / "demo", tmp_path / "whole"
    command = [sys.executable, "-m", "uptrain.demo", *DEMO_ARGS]
    code, err = _stopped([*command, "--out", str(out)], "SIGTERM", {"UPTRAIN_TEST_SIGNAL_AT": "2:0:SIGTERM"}, "")
    assert code == 143 and "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert LINE.match(line) and "keeps: convert" in line and "the same command continues from it" in line, line
    again = _rerun_equals_uninterrupted(command, out, whole, "uptrain")
    assert "kept from the earlier run" in again and "continues from checkpoint-00000002" in again
    assert "resuming from" in again and "calibrat" not in again.split("== uptrain")[0].split("kept")[-1]


def _rerun_equals_uninterrupted(command: list[str], out: Path, whole: Path, step: str) -> str:
    """Rerun the stopped demo in `out` and run it whole in `whole`: both finish, print the same table, and
    `step`'s model is bit for bit the same (resumed, not trained again from step 0). The rerun's stdout."""
    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.run([*command, "--out", str(folder)], cwd=REPO, capture_output=True, text=True, timeout=600,
                           env=env) for folder in (out, whole)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-3000:] for r in runs]
    table = lambda text: [row for row in text.splitlines() if row.startswith("| ")]  # noqa: E731
    assert table(runs[0].stdout) == table(runs[1].stdout)
    ours, theirs = (load_file(folder / step / "model" / "model.safetensors") for folder in (out, whole))
    assert all(ours[k].equal(theirs[k]) for k in theirs)
    return runs[0].stdout


def test_a_stop_while_the_source_writes_samples_names_the_kept_batches(tmp_path):
    out = tmp_path / "demo"
    command = [sys.executable, "-m", "uptrain.demo", "--out", str(out), "--teacher-samples", "600000", "--stories", "2",
               "--tasks", "none", "threads=1"]
    proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    chunks = tmp_path / ".demo.teacher-samples" / "chunks"
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline and not (chunks.is_dir() and any(chunks.iterdir())):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert LINE.match(line) and re.search(r"\d+ sample batches kept in \S*\.demo\.teacher-samples", line), line
    assert "the same command continues from them" in line


def test_a_demo_stopped_in_its_uptrainings_set_up_keeps_the_conversion_and_the_rerun_trains_from_step_0(tmp_path):
    """A stop while the uptraining loads its models (no checkpoint yet): the line says the conversion is
    kept; the rerun takes it as it is and trains from the start, to the end."""
    out = tmp_path / "demo"
    command = [sys.executable, "-m", "uptrain.demo", "--out", str(out), *DEMO_ARGS]
    code, err = _stopped(command, "SIGTERM", {"UPTRAIN_TEST_SIGNAL_IN_SETUP": "models:SIGTERM"}, "")
    assert code == 143 and "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert LINE.match(line) and "keeps: convert" in line, line
    assert not list((out / "uptrain").glob("checkpoint-*")) if (out / "uptrain").exists() else True
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode == 0, again.stderr[-3000:]
    before_uptraining = again.stdout.split("== uptrain")[0]
    assert "kept from the earlier run" in before_uptraining and "calibrat" not in before_uptraining.split("kept")[-1]
    assert "continues from checkpoint" not in again.stdout and "resuming from" not in again.stdout
    assert (out / "uptrain" / "model" / "config.json").is_file()


def test_a_demo_stopped_in_its_context_tail_continues_from_its_checkpoint_and_ends_as_an_uninterrupted_one(tmp_path):
    """--context-tail's trainer run is a step of the demo like the uptraining: a stop in its steps says what
    is kept, the rerun keeps the conversion and the uptraining and resumes the tail, bit for bit."""
    out, whole = tmp_path / "demo", tmp_path / "whole"
    args = [a for a in DEMO_ARGS if not a.startswith("budget.tokens=")]  # 2 uptraining steps, 6 of the tail
    command = [sys.executable, "-m", "uptrain.demo", *args, "budget.tokens=4096", "--context-tail", "12288"]
    # step 4 is reached only by the tail (the uptraining has 2 steps)
    code, err = _stopped([*command, "--out", str(out)], "SIGTERM", {"UPTRAIN_TEST_SIGNAL_AT": "4:0:SIGTERM"}, "")
    assert code == 143 and "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert LINE.match(line) and "keeps: convert, uptrain" in line and "the context tail's last checkpoint" in line, line
    again = _rerun_equals_uninterrupted(command, out, whole, "context")
    assert "== uptrain: kept from the earlier run" in again
    assert "== context tail" in again and "continues from checkpoint-00000004" in again
    assert "resuming from" in again.split("== context tail")[1]  # the trainer's own resume, not step 0
