"""Preemption: real signals (SIGTERM, SIGUSR1, Ctrl-C, SIGKILL) at a random step, on one and two
processes and during a checkpoint write; `resume=latest` then reproduces the uninterrupted losses."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import DEMO, train_in_process, REPO, need_models, tiny_overrides, train_losses
from test_train_multiproc import _free_port
from uptrain.train.__main__ import main
from uptrain.train.state.run_state import PREEMPTED_FILE
from uptrain.stopping.codes import EXIT_INTERRUPTED, EXIT_PREEMPTED
from uptrain.train.state.run_state import FINISHED_FILE, complete_checkpoints

STEPS = 12  # a signal sent at step k <= 5 lands well before the end, however slow the machine
RNG = random.Random(21)  # the "random step" of each test, reproducible


def _launcher_exit_on_sigterm() -> int:
    """What `accelerate launch` itself exits with after SIGTERM, once its workers have stopped.

    Up to accelerate 1.15 torchrun's SignalException escapes (1); from 1.16 the launcher exits
    128 + the signal (143), the Unix convention. The workers' own exit (75) is ours and fixed.
    """
    import accelerate
    from packaging.version import Version
    return 1 if Version(accelerate.__version__) < Version("1.16") else 128 + signal.SIGTERM


def _args(run_dir, **extra) -> list[str]:
    return tiny_overrides(run_dir, steps=STEPS, **{"log.every": 1, "threads": 1, **extra})


def _two_process_args(run_dir, **extra) -> list[str]:  # 4 x 1 x 2 processes = the one process's 4 x 2
    return _args(run_dir, **{"batch.grad_accum": 1, **extra})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per-step losses of the uninterrupted one-process run."""
    need_models()
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    train_in_process(_args(run_dir))
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def _env(**hooks) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **hooks}


def _one_process(args: list[str], **hooks) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "uptrain.train", str(DEMO), *args], cwd=REPO, env=_env(**hooks),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _launch(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(_free_port()), "-m", "uptrain.train", str(DEMO), *args]


def _two_processes(args: list[str], **hooks) -> subprocess.CompletedProcess:
    return subprocess.run(_launch(args), cwd=REPO, env=_env(**hooks), capture_output=True, text=True, timeout=300)


def _logged_steps(run_dir) -> int:
    try:
        return max((json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()),
                   default=0)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def _check_stopped(run_dir, stderr: str, step: int) -> None:
    """Stopped after `step` with its checkpoint, the resume line last, no model, nothing half-written."""
    line = stderr.strip().splitlines()[-1]
    assert f"after step {step} of {STEPS}" in line and f"checkpoint-{step:08d}" in line, line
    assert line.endswith("resume=latest") and "uptrain.train" in line, line
    assert complete_checkpoints(run_dir)[-1].name == f"checkpoint-{step:08d}"
    assert json.loads((complete_checkpoints(run_dir)[-1] / "trainer_state.json").read_text())["step"] == step
    assert not (run_dir / "model").exists() and not (run_dir / FINISHED_FILE).exists()
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def _resume_matches(run_dir, args: list[str], reference: dict) -> None:
    assert main([str(DEMO), *args, "resume=latest"]) == 0
    resumed = train_losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert resumed[step] == pytest.approx(loss, abs=1e-5), step


def test_sigterm_at_a_random_step_checkpoints_stops_and_resumes_exactly(tmp_path, reference, one_torch_thread):
    # A real SIGTERM from outside, once metrics.jsonl shows step k: the process finishes the step
    # it is in, writes a checkpoint there (checkpoint.every=0: the only one), exits 75.
    k = RNG.randint(2, 4)
    run_dir = tmp_path / "run"
    args = _args(run_dir)
    proc = _one_process(args)
    while _logged_steps(run_dir) < k and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    stopped = _logged_steps(run_dir)
    assert k <= stopped < STEPS
    _check_stopped(run_dir, err, stopped)
    assert "Traceback" not in err
    _resume_matches(run_dir, args, reference)


def test_second_ctrl_c_stops_at_once_keeping_the_last_complete_checkpoint(tmp_path, reference, one_torch_thread):
    # A first Ctrl-C after step k asks for a checkpoint at k; a second Ctrl-C, 1.5 s later, arrives
    # while that checkpoint is being written: the process stops at once (130), the half-written
    # checkpoint is never listed, the last complete one (every 2 steps) is kept and named.
    k = RNG.choice([3, 5])
    run_dir = tmp_path / "run"
    args = _args(run_dir, **{"checkpoint.every": 2, "checkpoint.keep": 5})
    proc = _one_process(args, UPTRAIN_TEST_SIGNAL_AT=f"{k}:0:SIGINT", UPTRAIN_TEST_SIGNAL_IN_CHECKPOINT=f"{k}:SIGINT:1.5")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
    line = err.strip().splitlines()[-1]
    kept = f"checkpoint-{k - 1:08d}"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert kept in line and line.endswith("resume=latest"), line
    assert complete_checkpoints(run_dir)[-1].name == kept
    assert (run_dir / "checkpoints" / f".tmp-checkpoint-{k:08d}").is_dir()  # the interrupted write, not listed
    _resume_matches(run_dir, args, reference)


def test_sigkill_during_a_checkpoint_write_leaves_the_previous_checkpoint(tmp_path):
    # Killed (no handler can run) while writing checkpoint 4: checkpoint 2 stays the latest.
    need_models()
    run_dir = tmp_path / "run"
    args = _args(run_dir, **{"checkpoint.every": 2, "checkpoint.keep": 1})
    proc = _one_process(args, UPTRAIN_TEST_SIGNAL_IN_CHECKPOINT="4:SIGKILL")
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert [p.name for p in complete_checkpoints(run_dir)] == ["checkpoint-00000002"]


def test_sigusr1_on_one_of_two_processes_stops_both_at_the_same_step_and_resumes(tmp_path, reference):
    # The signal reaches rank 1 only (as when a scheduler signals one task): both ranks agree on
    # the step, write one checkpoint together and exit 75; two processes then resume exactly.
    k = RNG.randint(2, 5)
    run_dir = tmp_path / "run"
    args = _two_process_args(run_dir)
    proc = _two_processes(args, UPTRAIN_TEST_SIGNAL_AT=f"{k}:1:SIGUSR1")
    assert f"exitcode  : {EXIT_PREEMPTED}" in proc.stderr, proc.stderr[-3000:]  # torchrun's report of the workers
    assert f"stopped by SIGUSR1 after step {k} of {STEPS}" in proc.stderr, proc.stderr[-3000:]
    assert _logged_steps(run_dir) == k
    (checkpoint,) = complete_checkpoints(run_dir)
    assert checkpoint.name == f"checkpoint-{k:08d}"
    assert {p.name for p in checkpoint.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}
    resumed = _two_processes(args + ["resume=latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = train_losses(run_dir)
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, abs=1e-5), step


def test_one_ctrl_c_delivered_twice_is_one_press_and_a_later_second_press_stops_at_once():
    # A terminal sends Ctrl-C to the launcher and its workers, and the launcher forwards it again:
    # SIGINTs within SAME_PRESS_S are one press (checkpoint and stop); one later stops at once.
    from uptrain.stopping.codes import SAME_PRESS_S
    from uptrain.train.stop.preempt import StopRequest

    before = signal.getsignal(signal.SIGTERM)
    with StopRequest().installed() as stop:
        stop.setup_done()  # in the loop (during set-up a first Ctrl-C stops at once: test_setup_stop.py)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        except KeyboardInterrupt:
            pytest.fail("one Ctrl-C delivered twice stopped at once")
        assert stop.agreed(1) == signal.SIGINT
        time.sleep(SAME_PRESS_S + 0.2)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here, in the main thread
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handlers are back


def test_a_stop_whose_checkpoint_would_overrun_the_grace_keeps_the_last_one_and_resumes(tmp_path, reference):
    # Checkpoint 2 takes over 4 s (a slow write); the grace is 3 s. A SIGTERM after step 3: a
    # checkpoint there would be killed half-way, so none is started; the process still exits 75
    # naming checkpoint 2 (preempted.json too, so a launch script requeues), and resume=latest
    # redoes step 3 to the uninterrupted losses.
    run_dir = tmp_path / "run"
    args = _args(run_dir, **{"checkpoint.every": 2, "checkpoint.keep": 5, "stop_grace_s": 3})
    proc = _one_process(args, UPTRAIN_TEST_SIGNAL_IN_CHECKPOINT="2:none:4", UPTRAIN_TEST_SIGNAL_AT="3:0:SIGTERM")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "grace 3 s (stop_grace_s)" in out
    # the write sleeps 4 s, plus the real write (seconds more on a loaded machine)
    took = re.search(r"warning: checkpoint 2 took (\d+\.\d+) s", out)
    assert took and float(took[1]) >= 4 and "more than the 3 s stop grace" in out, out
    takes = re.search(r"no checkpoint at step 3: a write takes ~(\d+\.?\d*)", out)
    assert takes and float(takes[1]) >= 4, out
    line = err.strip().splitlines()[-1]
    assert "stopped by SIGTERM after step 3 of 12" in line and "checkpoint-00000002 kept" in line, line
    assert [p.name for p in complete_checkpoints(run_dir)] == ["checkpoint-00000002"]
    mark = json.loads((run_dir / PREEMPTED_FILE).read_text())
    assert mark["step"] == 3 and mark["checkpoint"].endswith("checkpoint-00000002")
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    _resume_matches(run_dir, args, reference)


@pytest.mark.parametrize("rest_s", [3, 0])
def test_a_stop_signalled_early_in_a_long_step_counts_the_grace_from_the_signal(tmp_path, rest_s):
    # The decision's call site (`steps._stop_checkpoint`): the signal comes early in step 3, whose rest
    # takes 3 s of a 4 s grace, and checkpoint 2 took over 2 s. A write would fit the whole grace but
    # not the ~1 s left, so none is started and checkpoint 2 is named. Red when the step passes no time
    # since the signal (the deciding function alone is tested below).
    need_models()
    run_dir = tmp_path / "run"
    args = _args(run_dir, **{"checkpoint.every": 2, "checkpoint.keep": 5, "stop_grace_s": 4})
    proc = _one_process(args, UPTRAIN_TEST_SIGNAL_IN_CHECKPOINT="2:none:2",
                        UPTRAIN_TEST_SIGNAL_AT=f"3:0:SIGTERM:{rest_s}")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    if rest_s == 0:  # the other side of the edge: the whole grace is left, the write fits, it is made
        assert "no checkpoint at step 3" not in out, out
        assert [p.name for p in complete_checkpoints(run_dir)][-1] == "checkpoint-00000003"
        return
    decided = re.search(r"no checkpoint at step 3: a write takes ~(\d+\.?\d*) s, (\d+\.\d) s are left of the 4 s", out)
    assert decided and float(decided[1]) >= 2 and float(decided[2]) <= 1.5, out
    assert [p.name for p in complete_checkpoints(run_dir)] == ["checkpoint-00000002"]


def test_sigterm_to_the_launcher_during_a_45_s_checkpoint_completes_it_when_the_grace_is_raised(tmp_path, reference,
                                                                                                 one_torch_thread):
    # torchrun (under accelerate launch) SIGKILLs its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT s after
    # forwarding a SIGTERM (default 30: this checkpoint was lost). Raised to the grace, as
    # scripts/slurm/uptrain.sbatch does, the 45 s write completes, both workers exit 75 with the
    # checkpoint named, and the run resumes from it to the uninterrupted losses. The resume runs in
    # this process (elastic, 2 -> 1: test_elastic.py): that two processes resume a two-process stop
    # exactly is the SIGUSR1 test's claim above, and a second launch here would only repeat it.
    # One launch for what signals on two processes promise: this one (the launcher forwards SIGTERM to
    # both workers while they write: the write completes, the stop is said once, nothing half-written)
    # and the SIGUSR1 one (one rank signalled at a random step: both agree on it, and resume).
    need_models()
    run_dir = tmp_path / "run"
    args = _two_process_args(run_dir, **{"checkpoint.every": 2})
    env = _env(UPTRAIN_TEST_SIGNAL_IN_CHECKPOINT="2:none:45", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="120")
    proc = subprocess.Popen(_launch(args), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writing = run_dir / "checkpoints" / ".tmp-checkpoint-00000002"
    while not writing.is_dir() and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(2)  # inside the write: the state files are being written, the slow part follows
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == _launcher_exit_on_sigterm(), err[-3000:]  # the workers exited 75 after the write
    assert "Unable to shutdown process" not in err and "forcefully exiting" not in err, err[-3000:]
    assert "grace 120 s (torchrun's shutdown timeout)" in out, out[-2000:]
    assert err.count("stopped by SIGTERM after step 2 of 12") == 1, err[-3000:]  # said once, by rank 0
    assert [p.name for p in complete_checkpoints(run_dir)] == ["checkpoint-00000002"]
    assert _logged_steps(run_dir) == 2 and not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert not (run_dir / "model").exists()
    assert json.loads((run_dir / PREEMPTED_FILE).read_text())["checkpoint"].endswith("checkpoint-00000002")
    _resume_matches(run_dir, args, reference)


def test_the_grace_comes_from_the_config_the_launch_script_or_torchrun_and_a_short_torchrun_is_named():
    from uptrain.train.stop.preempt import stop_grace

    torchrun = {"TORCHELASTIC_RUN_ID": "x"}
    assert stop_grace(None, {}) == (None, "no deadline known (set stop_grace_s to the scheduler's grace)", None)
    assert stop_grace(120, {})[:2] == (120.0, "stop_grace_s")
    assert stop_grace(None, {"UPTRAIN_STOP_GRACE_S": "300"})[:2] == (300.0, "UPTRAIN_STOP_GRACE_S")
    grace, source, warning = stop_grace(None, torchrun)  # torchrun's default: 30 s, and how to raise it
    assert grace == 30.0 and "its default; raise it with TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in source and warning is None
    assert stop_grace(None, {**torchrun, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"})[0] == 90.0
    # a grace longer than torchrun's own timeout: torchrun kills first, so that is the deadline, and it is said
    grace, _, warning = stop_grace(300, {**torchrun, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "30"})
    assert grace == 30.0 and "launch with TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300" in warning
    assert stop_grace(300, {**torchrun, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "300"}) == (300.0, "stop_grace_s", None)


def test_a_stop_checkpoint_is_skipped_exactly_when_the_last_write_is_longer_than_what_is_left_of_the_grace():
    # Over the whole range of "what is left": from the whole grace (the signal came just now) to
    # none and past it (a long step used it up), writes just under and just over what is left, each
    # also under the whole grace: the whole grace is never the measure once any of it is used.
    from uptrain.train.stop.preempt import checkpoint_overruns, seconds_left

    rng = random.Random(5)
    for grace in (1.0, 3.0, 30.0, 300.0, 3600.0):
        for used in [0.0, 1e-3, grace * 0.999, grace, grace * 1.5, *(rng.uniform(0, grace) for _ in range(50))]:
            left = grace - used
            assert seconds_left(grace, used) == pytest.approx(left)
            for write in (0.0, left * 0.5, left - 1e-6, left + 1e-6, (left + grace) / 2, grace * 0.999, grace * 2):
                if write < 0:
                    continue
                assert checkpoint_overruns(write, grace, used) == (write > left), (grace, used, write)
    # unknowns: no deadline, no signal yet, or no write measured: the checkpoint is tried
    assert not checkpoint_overruns(5.0, None, 1.0) and not checkpoint_overruns(5.0, 3.0, None)
    assert not checkpoint_overruns(None, 3.0, 2.9) and seconds_left(None, 1.0) is None
