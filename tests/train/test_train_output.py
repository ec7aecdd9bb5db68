"""What the trainer prints while it runs: every validation it runs, and, where the output is a log
file or a pipe, plain progress lines at a steady interval instead of a tqdm bar.

Before: only the step-0 and the final validation were printed (those at eval.every only went to
metrics.jsonl); in a log file tqdm's carriage returns left 36-51 s without a newline, and the
demo's log was ~300 KB of bar states."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import DEMO, REPO, VALID_TXT, need_models, read_metrics, tiny_overrides, train_in_process


def test_every_validation_is_printed(tmp_path, capsys):
    need_models()
    run_dir = tmp_path / "run"
    train_in_process(tiny_overrides(run_dir, steps=6, **{"eval.every": 2, "eval.max_batches": 1, "threads": 1}))
    printed = capsys.readouterr().out.splitlines()
    validations = [r for r in read_metrics(run_dir) if "val_loss" in r]
    assert [r["step"] for r in validations] == [0, 2, 4, 6]
    for r in validations:  # each one printed, with the number metrics.jsonl holds
        line = f"step {r['step']}: val loss {r['val_loss']:.4f}, ppl {r['val_ppl']:.2f}"
        assert printed.count(line) == 1, (line, printed)


# A run written to a pipe, its validation slowed to SLOW_S (longer than the interval: the trainer
# must say it is still working), lines timed as they arrive.
_SLOWED = """
import sys, time
import uptrain.train.steps as steps
real = steps.validate_blocks
def slow(*args, **kwargs):
    time.sleep({slow})
    return real(*args, **kwargs)
steps.validate_blocks = slow
from uptrain.train.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def _slowed_run(args: list[str], every: float, slow: float) -> subprocess.Popen:
    """The trainer on configs/demo-cpu.yaml + `args`, its validation slowed by `slow` s, progress lines
    every `every` s, stdout and stderr to one pipe (a log file's view)."""
    env = {**os.environ, "UPTRAIN_PROGRESS_EVERY": str(every), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", _SLOWED.format(slow=slow), str(DEMO), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_a_log_file_gets_plain_lines_at_the_interval_and_no_carriage_returns(tmp_path):
    """UPTRAIN_PROGRESS_EVERY=1 (the tests' interval; 10 s by default), stdout and stderr to one pipe:
    no carriage return anywhere, a progress line at least every second (plus scheduling slack) from
    the first step to the last, also through a 3 s validation, and not one per step."""
    need_models()
    every, slow, steps = 1.0, 3.0, 40
    args = tiny_overrides(tmp_path / "run", steps=steps, **{"eval.every": 20, "eval.at_start": "false",
                                                            "eval.max_batches": 1, "log.progress_bar": "true",
                                                            "threads": 1})
    proc = _slowed_run(args, every, slow)
    timed = [(time.monotonic(), line) for line in iter(proc.stdout.readline, b"")]
    assert proc.wait(timeout=120) == 0, b"".join(line for _, line in timed).decode()[-3000:]
    output = b"".join(line for _, line in timed)
    assert b"\r" not in output, output.decode()[-3000:]
    lines = [(t, line.decode().rstrip("\n")) for t, line in timed]
    # the steps' lines (the final validation's own 'still working' lines come after the last step)
    progress = [i for i, (_, line) in enumerate(lines) if line.startswith("train: ")
                and not line.endswith(f"since step {steps}/{steps}")]
    assert progress and lines[progress[-1]][1].startswith(f"train: step {steps}/{steps}, loss "), lines
    first = next(i for i, (_, line) in enumerate(lines) if line.startswith(("train: ", "ETA: ")))  # training began
    last = progress[-1]
    gaps = [lines[i + 1][0] - lines[i][0] for i in range(first, last)]
    assert max(gaps) < every + 1.0, [(round(g, 2), lines[i][1]) for i, g in zip(range(first, last), gaps)]
    waiting = [line for _, line in lines if line.startswith("train: still working")]
    # the validation after step 20 (a step slower than the interval on a loaded machine says so too: allowed)
    assert sum("since step 20/40" in line for line in waiting) >= 2, lines
    steps_shown = sum(1 for i in progress if lines[i][1].startswith("train: step "))
    assert steps_shown <= (lines[last][0] - lines[first][0]) / every + 3, lines  # at the interval, not each step
    assert any(line.startswith("step 20: val loss ") for _, line in lines)


def test_the_step_0_and_final_validations_are_not_silent_in_a_log_file(tmp_path):
    """Before: the watcher ran only among the steps, so a big model's step-0 validation and its final
    validation and save (minutes on a 7B model) left a log file without a line."""
    need_models()
    every, slow, steps = 1.0, 3.0, 2
    args = tiny_overrides(tmp_path / "run", steps=steps, **{"eval.every": 0, "eval.at_start": "true",
                                                            "eval.max_batches": 1, "log.progress_bar": "true",
                                                            "threads": 1})
    proc = _slowed_run(args, every, slow)
    output = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0, output[-3000:]
    lines = output.splitlines()
    at_start = lines.index(next(line for line in lines if line.startswith("step 0: val loss ")))
    final = lines.index(next(line for line in lines if line.startswith(f"step {steps}: val loss ")))
    assert any(line.startswith("train: still working") and "since step 0/" in line for line in lines[:at_start]), lines
    assert any(line.startswith("train: still working") and f"since step {steps}/{steps}" in line
               for line in lines[at_start:final]), lines


def test_validation_runs_the_copy_probe_when_asked(tmp_path, capsys):
    """eval.copy_passages N: each validation also reads passages of the validation text twice
    (uptrain.measure.copy_probe in seq_len windows); val_copy_* in metrics.jsonl and in its line,
    at step 0 the start model's own probe on the same blocks, against the teacher its share kept."""
    import pytest
    import torch
    from transformers import AutoModelForCausalLM

    from train_helpers import GQA4
    from uptrain.measure.copy_probe import probe_model

    need_models()
    run_dir = tmp_path / "run"
    train_in_process(tiny_overrides(run_dir, steps=2, **{"eval.copy_passages": 3, "eval.max_batches": 1,
                                                         "distill.teacher": GQA4, "threads": 1}))
    printed = capsys.readouterr().out
    validations = [r for r in read_metrics(run_dir) if "val_loss" in r]
    assert [r["step"] for r in validations] == [0, 2]
    first = validations[0]
    from transformers import AutoTokenizer

    from uptrain.data import DataSource, documents
    from uptrain.data.blocks import token_blocks

    val = token_blocks(documents(DataSource(files=[str(VALID_TXT)])), AutoTokenizer.from_pretrained(GQA4), 64)
    model = AutoModelForCausalLM.from_pretrained(GQA4).eval()
    want = probe_model(model, [torch.tensor(r) for r in val.select(range(min(len(val), 64)))["input_ids"]], 64, 3)
    assert first["val_copy_second_loss"] == pytest.approx(want["copy_second_loss"], abs=1e-5)
    assert first["val_copy_top1"] == pytest.approx(want["copy_top1"])
    assert first.get("val_copy_gain_kept") == (1.0 if want["copy_gain"] > 0 else None)  # the teacher is the model
    line = f"step 0: val loss {first['val_loss']:.4f}"
    assert any(l.startswith(line) and "copy probe: loss" in l for l in printed.splitlines()), printed
