"""One CPU-threads setting per command: the choice from the load, every CLI honouring --threads,
and the busy-CPU check that flags a decode speed timed on an oversubscribed machine."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from uptrain import threads as th

from conftest import EXAMPLE_MHA8, VALID_TXT, built_gqa4


def _cases():
    rng = random.Random(0)
    for cpus in (1, 2, 4, 16, 32, 40, 64, 128):  # structured: real core counts
        for load in (0.0, 0.4, cpus / 2, cpus - 0.5, cpus, 3.0 * cpus):
            yield cpus, load, None, cpus, 1
    for _ in range(500):  # random
        cpus = rng.randint(1, 256)
        yield cpus, rng.uniform(0, 3 * cpus), rng.choice([None, None, rng.randint(1, 64)]), \
            rng.choice([None, rng.randint(1, cpus)]), rng.randint(1, 8)


def test_choose_threads_properties():
    for case in _cases():  # ~550 random and structured machines
        _check_choice(*case)


def _check_choice(cpus, load, requested, cap, processes):
    c = th.choose_threads(cpus, load, requested, cap, processes)
    if requested is not None:
        assert c.threads == requested and "as asked" in c.line
        return
    top = min(cpus, cap or cpus)
    assert 1 <= c.threads <= top  # never more than the cores, never none
    assert f"CPU threads: {c.threads} (" in c.line and "--threads" in c.line and f"{load:.1f}" in c.line
    # free CPUs shared by the processes, rounded: a loaded machine never gets more threads than it has free
    assert c.threads <= max(1, round((cpus - load) / processes + 0.01))
    # more load never gives more threads
    assert th.choose_threads(cpus, load + 1.0, None, cap, processes).threads <= c.threads
    if load == 0 and processes == 1:
        assert c.threads == top
    if load >= cpus:
        assert c.threads == 1


def test_omp_num_threads_is_honoured_and_requested_wins():
    assert th.choose_threads(8, 7.0, None, 8, env="3").threads == 3
    assert th.choose_threads(8, 7.0, 2, 8, env="3").threads == 2
    assert th.choose_threads(8, 0.0, None, 8, env="junk").threads == 8  # not a number: ignored


def test_the_issue_machine_gets_one_thread():
    """2 cores at load 4-12 (issue 22): one thread, and the line says why."""
    for load in (4.0, 12.0):
        c = th.choose_threads(2, load, None, 2)
        assert c.threads == 1 and "other jobs" in c.line


def test_busy_decision():
    assert th.busy_note(0.1, 2, 1) is None and th.busy_note(0.9, 2, 1) is None  # 1 thread beside 1 busy CPU fits
    assert th.busy_note(1.4, 2, 1).startswith("noisy: CPU busy")
    assert th.busy_note(0.2, 16, 16) is None and th.busy_note(1.0, 16, 16) is not None
    assert th.others_busy(3.0, 1.0, 2.0) == 1.0 and th.others_busy(1.0, 3.0, 2.0) == 0.0


def _burners(n: int, seconds: float) -> list[subprocess.Popen]:
    """n processes that keep a CPU busy for up to `seconds`, returned once each is burning (on a loaded machine
    a Python start can take longer than a short measurement: a busy-flag test timed before them saw none)."""
    code = f"import time\nt = time.time() + {seconds}\nprint('burning', flush=True)\nwhile time.time() < t: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for _ in range(n)]
    for p in procs:
        p.stdout.readline()
    return procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def test_cpu_monitor_sees_a_burner_started_a_moment_ago():
    procs = _burners(1, 60)  # a cap only: killed after the measurement
    try:
        time.sleep(0.3)
        with th.CpuMonitor() as m:
            time.sleep(1.5)
    finally:
        _stop(procs)
    assert m.others >= 0.6  # the burner kept (most of) a CPU busy; the load average would not show it yet


@pytest.mark.usefixtures("one_torch_thread")
def test_bench_flags_a_speed_timed_while_other_processes_kept_the_cpus_busy(tmp_path, capsys):
    from uptrain.measure import bench

    args = [str(built_gqa4()), "--context", "16", "--batch", "1", "--new-tokens", "20", "--warmup", "0",
            "--repeats", "2", "--threads", "1", "--json", str(tmp_path / "b.json")]
    procs = _burners(2 * th.machine_cpus(), 120)  # a cap only: killed when the bench returns (a slow start must not outlast them)
    try:
        time.sleep(0.3)
        assert bench.main(args) == 0
    finally:
        _stop(procs)
    out = capsys.readouterr().out
    (row,) = json.loads((tmp_path / "b.json").read_text())
    assert row["decode"][0]["busy"].startswith("noisy: CPU busy"), row["decode"][0]
    assert "noisy: CPU busy" in out


def _cli_runs(tmp_path: Path):
    mha, gqa, valid = str(EXAMPLE_MHA8), str(built_gqa4()), str(VALID_TXT)
    data = ["--data", valid, "--max-documents", "1", "--max-length", "64"]
    fast = ["--context", "8", "--batch", "1", "--new-tokens", "2", "--warmup", "0", "--repeats", "1"]
    return {
        "convert": ("uptrain.convert.__main__", [mha, "--kv-heads", "4", "--out", str(tmp_path / "c")]),
        "convert-calibrated": ("uptrain.convert.__main__", [
            mha, "--kv-heads", "4", "--out", str(tmp_path / "cc"), "--method", "fit", "--calib", valid,
            "--calib-tokens", "64"]),
        "eval": ("uptrain.measure.eval", [gqa, *data]),
        "bench": ("uptrain.measure.bench", [gqa, *fast]),
        "compare": ("uptrain.measure.compare", [mha, gqa, *data, *fast, "--json", str(tmp_path / "c.json")]),
        "methods": ("uptrain.measure.methods", [mha, "--kv-heads", "4", "--eval-data", valid, "--max-documents", "1",
                                                "--max-length", "16", "--stride", "8"]),
        "demo": ("uptrain.demo", ["--out", str(tmp_path / "demo"), "--skip-uptrain", "--stories", "1",
                                  "--method", "mean", "--grouping", "contiguous", "--refine-steps", "0",
                                  "--task-limit", "2"]),
    }


@pytest.fixture
def two_threads_before():
    """torch at 2 threads before the command (which is asked for 1), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["convert", "convert-calibrated", "eval", "bench", "compare", "methods", "demo"])
def test_every_command_runs_the_threads_it_was_given_and_says_so(name, tmp_path, capsys, two_threads_before):
    import importlib

    module, argv = _cli_runs(tmp_path)[name]
    assert importlib.import_module(module).main([*argv, "--threads", "1"]) == 0
    # the pooled copy path builds in a worker thread, where it sets them (OpenMP's count is per thread)
    assert torch.get_num_threads() == 1 or name == "convert"
    captured = capsys.readouterr()
    assert "CPU threads: 1 (as asked)" in captured.err + captured.out, captured  # convert: beside its plan
    if name == "compare":  # the evaluation ran with them too, not only the decode timing
        src, _ = json.loads((tmp_path / "c.json").read_text())
        assert src["eval"]["threads"] == 1 and src["bench"]["threads"] == 1


def test_without_threads_a_command_says_what_it_chose_and_why(tmp_path, capsys, one_torch_thread, monkeypatch):
    from uptrain.measure import eval as ev

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    module, argv = _cli_runs(tmp_path)["eval"]
    assert ev.main(argv) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("CPU threads:"))
    assert "load average" in line and torch.get_num_threads() == int(line.split()[2])



# The trainer's step on the bundled model: the source's logits, the student's forward and backward of the KL
_FAULTS = """
import resource, sys, torch
from transformers import AutoModelForCausalLM
from uptrain.threads import keep_freed_memory
from uptrain.train.model.losses import kd_loss_sum
print(keep_freed_memory() if sys.argv[1] == "keep" else "-")
torch.set_num_threads(1)
student, teacher = AutoModelForCausalLM.from_pretrained(sys.argv[2]), AutoModelForCausalLM.from_pretrained(sys.argv[2])
ids = torch.randint(3, 512, (8, 128), generator=torch.Generator().manual_seed(0))
def step():
    with torch.no_grad():
        target = teacher(input_ids=ids).logits
    kd_loss_sum(student(input_ids=ids).logits, target, 1.0).backward()
for _ in range(3):  # warm-up: the allocator reaches its steady state
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator settings: Linux only")
def test_a_training_process_keeps_the_memory_its_steps_free():
    """Freed activations stay with the process for the next step (`keep_freed_memory`, called by the trainer's
    set-up): the page faults of 10 distillation steps fall at least fivefold (measured: ~19,000-24,000 to 600-2,100;
    the kept run's count varies with the machine's load, the plain run's does not fall below ~19,000).
    A user's MALLOC_* setting wins (nothing applied)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def run(mode: str, **extra: str) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode, str(EXAMPLE_MHA8)], capture_output=True, text=True,
                             check=True, env={**env, **extra}).stdout.split()
        return out[0], int(out[-1])

    applied, kept = run("keep")
    _, plain = run("plain")
    assert applied == "True" and plain > 5 * max(kept, 500), (kept, plain)
    assert run("keep", MALLOC_TRIM_THRESHOLD_="131072")[0] == "False"
