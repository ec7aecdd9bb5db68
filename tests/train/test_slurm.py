"""scripts/slurm/uptrain.sbatch on a real (one-node) Slurm cluster: preempted, requeued, resumed exactly.

The cluster is brought up on this machine by scripts/slurm/local_cluster.sh (munged, slurmctld and
slurmd on the loopback address; it installs slurm-wlm and munge with apt-get when missing and it
may). The template is submitted as a user would, on the tiny stories260K model with two CPU
processes (accelerate launch --multi_gpu over gloo), stopped by each real Slurm signal path in turn (the time-limit warning, then
`scancel --signal=USR1 --batch`), and must requeue itself after each stop and finish with the per-step
losses of an uninterrupted two-process run.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train_helpers import DEMO, REPO, need_models, tiny_overrides, train_losses

CLUSTER = REPO / "scripts" / "slurm" / "local_cluster.sh"
SBATCH = REPO / "scripts" / "slurm" / "uptrain.sbatch"
STATE = Path(os.environ.get("UPTRAIN_SLURM_STATE", "/tmp/uptrain-slurm"))
STEPS = 60  # ~0.1 s a step: long enough that a signal sent at step 2..4 lands well before the end
PROCS = 2


def _args(run_dir: Path, **extra) -> list[str]:
    # Two processes x micro_batch 4 x grad_accum 1: the same global batch as tiny_overrides' one process.
    return tiny_overrides(run_dir, steps=STEPS, **{"log.every": 1, "threads": 1, "batch.grad_accum": 1, **extra})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(slurm_conf: str | None = None, **extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}
    if slurm_conf:
        env["SLURM_CONF"] = slurm_conf
    return env


@pytest.fixture(scope="module")
def cluster():
    """SLURM_CONF of a running one-node cluster (stopped at the end if this fixture started it)."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster runs its daemons as root (SlurmUser=root): run the tests as root")
    was_up = all((STATE / f"{d}.pid").is_file() and _alive((STATE / f"{d}.pid").read_text()) for d in ("slurmctld", "slurmd"))
    up = _cluster_script("up")
    if up.returncode in (3, 4):  # 3: cannot install slurm-wlm/munge here, 4: a daemon did not start
        pytest.skip(f"no local Slurm cluster: {up.stderr.strip()[-1500:]}")
    assert up.returncode == 0, up.stderr
    conf = up.stdout.strip().splitlines()[-1].split("=", 1)[1]
    yield conf
    if not was_up:
        _cluster_script("down")


def _cluster_script(step: str) -> subprocess.CompletedProcess:
    """`scripts/slurm/local_cluster.sh STEP` on this test's state folder."""
    return subprocess.run(["bash", str(CLUSTER), step], env={**os.environ, "UPTRAIN_SLURM_STATE": str(STATE)},
                          capture_output=True, text=True, timeout=900)


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (ValueError, OSError):
        return False


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per-step losses of the same run, uninterrupted, launched the plain way (no Slurm), two processes."""
    need_models()
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(PROCS),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), "-m", "uptrain.train", str(DEMO), *_args(run_dir)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def _job(conf: str, job: str) -> dict:
    """scontrol show job's fields (JobState, Restarts, ...)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], env=_env(conf), capture_output=True, text=True,
                         timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait_for(what: str, check, timeout: float, log: Path, period: float = 0.05, conf: str | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(period)
    text = log.read_text() if log.exists() else "(no log: the job never started)"
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; {_queue(conf)}job log:\n{text[-4000:]}")


def _queue(conf: str | None) -> str:
    """The queue and the node as Slurm sees them (why a job waits), for a failure message."""
    if conf is None:
        return ""
    run = lambda *cmd: subprocess.run(cmd, env=_env(conf), capture_output=True, text=True, timeout=30).stdout
    return f"queue:\n{run('squeue', '-o', '%i %T %r %M')}node: {run('sinfo', '-h', '-N', '-o', '%N %t')}"


def _logged_steps(run_dir: Path) -> int:
    try:
        return max((json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()),
                   default=0)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def _submit(conf: str, run_dir: Path, log: Path, args: list[str], *sbatch_opts: str, **env) -> str:
    # What a user types (plus where the log goes), from the repository root; the job inherits the
    # environment: the CPU fallback of two processes on the node, this Python, a free port.
    cmd = ["sbatch", "--parsable", f"--output={log}", *sbatch_opts, str(SBATCH), str(DEMO), *args]
    env = _env(conf, UPTRAIN_PROCS_PER_NODE=str(PROCS), UPTRAIN_PYTHON=sys.executable,
               UPTRAIN_MAIN_PORT=str(_free_port()), **env)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _grace(script: Path, **env) -> subprocess.CompletedProcess:
    """`bash SCRIPT --grace` (what the job would use), with `env` on top of this environment."""
    clean = {k: v for k, v in os.environ.items() if k not in ("SBATCH_SIGNAL", "UPTRAIN_GRACE_S")}
    return subprocess.run(["bash", str(script), "--grace"], env={**clean, **env}, capture_output=True, text=True,
                          timeout=30)


def _with_header(tmp_path: Path, name: str, old: str, new: str) -> Path:
    copy = tmp_path / name
    text = SBATCH.read_text()
    assert text.count(old) == 1, old
    copy.write_text(text.replace(old, new))
    return copy


def test_the_grace_is_the_signal_lead_time_sbatch_reads_and_nothing_else(tmp_path):
    # One owner: the --signal lead time, read where sbatch reads it (SBATCH_SIGNAL beats the header's
    # directive); checked over a range of lead times, both signal targets and Slurm's 60 s default.
    header = "#SBATCH --signal=B:USR1@300"
    assert _grace(SBATCH).stdout.strip() == f"grace 300s ({header} in the script)"
    for seconds in (1, 30, 45, 299, 600, 3600, 86400):
        copy = _with_header(tmp_path, f"at{seconds}.sbatch", header, f"#SBATCH --signal B:USR1@{seconds}")
        assert _grace(copy).stdout.strip() == f"grace {seconds}s (#SBATCH --signal=B:USR1@{seconds} in the script)"
        for spec in (f"B:USR1@{seconds}", f"R:USR1@{seconds}", f"USR1@{seconds}", f"10@{seconds}"):
            assert _grace(copy, SBATCH_SIGNAL=spec).stdout.strip() == f"grace {seconds}s (SBATCH_SIGNAL={spec})"
    assert _grace(SBATCH, SBATCH_SIGNAL="B:USR1").stdout.strip() == "grace 60s (SBATCH_SIGNAL=B:USR1)"
    later = _with_header(tmp_path, "later.sbatch", header, f"{header}\n#SBATCH --signal=B:USR1@900")
    assert _grace(later).stdout.startswith("grace 900s")  # sbatch: the last directive wins
    after = _with_header(tmp_path, "after.sbatch", "set -uo pipefail", "set -uo pipefail\n#SBATCH --signal=B:USR1@5")
    assert _grace(after).stdout.startswith("grace 300s")  # a directive after the first command is a comment
    # unusable: no directive, a zero or malformed lead time, the old second place set to another value
    for bad, env in [(_with_header(tmp_path, "none.sbatch", header, "#"), {}), (SBATCH, {"SBATCH_SIGNAL": "B:USR1@0"}),
                     (SBATCH, {"SBATCH_SIGNAL": "B:USR1@5m"}), (SBATCH, {"UPTRAIN_GRACE_S": "600"})]:
        proc = _grace(bad, **env)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and not proc.stdout, (env, proc)
        assert "error: " in proc.stderr and "--signal" in proc.stderr, proc.stderr
    assert _grace(SBATCH, UPTRAIN_GRACE_S="300").returncode == 0  # the same value: harmless


def test_a_job_uses_the_grace_slurm_was_given_through_sbatch_signal(cluster, tmp_path):
    # A real submission with SBATCH_SIGNAL (it beats the header, and the job inherits it): the job
    # says the grace it hands on. A finished run: the job ends there, cheaply.
    need_models()
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    run_dir.mkdir()
    (run_dir / "finished.json").write_text("{}")
    job = _submit(cluster, run_dir, log, _args(run_dir), SBATCH_SIGNAL="B:USR1@45")
    _wait_for("the job to end", lambda: _job(cluster, job).get("JobState") in ENDED, 120, log, period=0.5,
              conf=cluster)
    text = log.read_text()
    assert _job(cluster, job)["JobState"] == "COMPLETED", text
    assert "restart 0]: grace 45s (SBATCH_SIGNAL=B:USR1@45)" in text and "already finished" in text, text


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _wait_for_requeue(conf: str, job: str, log: Path, restarts: int = 1) -> None:
    """Until the job has been requeued `restarts` times; fails at once if it ended instead."""
    def requeued():
        fields = _job(conf, job)
        if fields.get("JobState") in ENDED and fields.get("Restarts") == str(restarts - 1):
            raise AssertionError(f"job ended without requeue {restarts}: {fields.get('JobState')}, ExitCode "
                                 f"{fields.get('ExitCode')}; job log:\n{log.read_text()[-4000:]}")
        return fields.get("Restarts") == str(restarts)
    _wait_for(f"the job to requeue itself (restart {restarts})", requeued, 120, log, period=0.2, conf=conf)


def test_time_limit_warning_and_usr1_to_the_batch_shell_each_checkpoint_requeue_and_resume_exactly(
        cluster, reference, tmp_path):
    # One job, stopped twice, by each of the two real Slurm paths in turn; it must requeue itself
    # after each and end with the per-step losses of the uninterrupted two-process run.
    #
    # 1. The real time-limit path: slurmctld itself sends the header's USR1 (B:USR1@300) once less
    # than 300 s are left. The job starts without a limit; once the run is in its step-2 checkpoint
    # (held there by a test hook until the warning arrives, at most 70 s, so that two of
    # slurmctld's 30 s time-limit sweeps find it running, however loaded the machine), the limit
    # is cut to 4 min. After the requeue the limit
    # is lifted again (else the restart would be warned again at once).
    # 2. In the restart: `scancel --signal=USR1 --batch`, what --signal=B:USR1@GRACE does before the
    # time limit, by hand. The batch shell traps it and passes it to the step; the run checkpoints,
    # the job requeues itself a second time and finishes.
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    job = _submit(cluster, run_dir, log, _args(run_dir, **{"checkpoint.every": 2}),
                  UPTRAIN_TEST_SIGNAL_IN_CHECKPOINT="2:none:70:until-stop")
    _wait_for("the step-2 checkpoint write", lambda: (run_dir / "checkpoints" / ".tmp-checkpoint-00000002").is_dir()
              or _logged_steps(run_dir) > 2, 180, log, conf=cluster)
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=4"], env=_env(cluster), check=True, timeout=30)
    _wait_for_requeue(cluster, job, log, restarts=1)
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=UNLIMITED"], env=_env(cluster), check=True,
                   timeout=30)
    text = log.read_text()
    assert "restart 0]: got SIGUSR1: passing SIGUSR1 to the training step" in text, text[-4000:]
    # the grace: the header's lead time, handed to the trainer (its plan line) by the script alone
    assert "restart 0]: grace 300s (#SBATCH --signal=B:USR1@300 in the script)" in text, text[-4000:]
    assert "grace 300 s (UPTRAIN_STOP_GRACE_S)" in text, text[-4000:]
    first = re.findall(r"stopped by SIGUSR1 after step (\d+) of", text)
    assert len(first) == 1 and 2 <= int(first[0]) < STEPS - 10, text[-4000:]

    k = int(first[0]) + 3  # logged by the restart itself, well before the end
    _wait_for(f"step {k} in metrics.jsonl", lambda: _logged_steps(run_dir) >= k, 180, log, conf=cluster)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=_env(cluster), check=True, timeout=30)
    _wait_for_requeue(cluster, job, log, restarts=2)
    assert "restart 1]: got SIGUSR1: passing SIGUSR1 to the training step" in log.read_text(), log.read_text()[-4000:]

    _wait_for("the requeued job to end", lambda: _job(cluster, job).get("JobState") in ENDED, 150, log, period=0.5,
              conf=cluster)
    fields, text = _job(cluster, job), log.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "2", (fields, text[-4000:])
    stopped = [int(s) for s, of in re.findall(r"stopped by SIGUSR1 after step (\d+) of (\d+)", text) if int(of) == STEPS]
    assert len(stopped) == 2, text[-4000:]  # said once per stop, by rank 0
    assert stopped[0] == int(first[0]) and k <= stopped[1] < STEPS, (stopped, text[-4000:])
    for step in stopped:  # each restart resumed from the checkpoint its stop wrote
        assert f"resuming from {run_dir / 'checkpoints' / f'checkpoint-{step:08d}'} at step {step}" in text, text[-4000:]
    assert "restart 2]: run finished" in text, text[-4000:]
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for s, loss in reference.items():
        assert losses[s] == pytest.approx(loss, abs=1e-5), s
    assert not (run_dir / "preempted.json").exists()


def _wrap(conf: str, log: Path, command: str) -> str:
    """Submit `command` as a job that needs the whole node (as the template's jobs do); its id."""
    proc = subprocess.run(["sbatch", "--parsable", "--exclusive", f"--output={log}", "--wrap", command],
                          env=_env(conf), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def test_a_cluster_stopped_mid_job_starts_again_with_an_empty_queue(cluster, tmp_path):
    # The cluster is stopped while a job runs and another waits (a CI run cut off, a second
    # checkout's tests ending): started again, it must bring neither back. A recovered running job
    # would count as running on the exclusive node, and every new job would wait behind it (CI
    # failed that way once); a recovered waiting one would take the node first.
    running = _wrap(cluster, tmp_path / "running.log", "sleep 600")
    waiting = _wrap(cluster, tmp_path / "waiting.log", "sleep 600")
    _wait_for("one job running, one waiting", lambda: (_job(cluster, running).get("JobState"),
              _job(cluster, waiting).get("JobState")) == ("RUNNING", "PENDING"), 60, tmp_path / "running.log",
              period=0.2, conf=cluster)
    # Everything Slurm runs dies at once (a container restarted, a machine rebooted; /tmp survives).
    for name in ("slurmctld", "slurmd"):
        os.kill(int((STATE / f"{name}.pid").read_text()), 9)
    subprocess.run(["pkill", "-9", "slurmstepd"], timeout=30)
    subprocess.run(["pkill", "-9", "-f", "^sleep 600$"], timeout=30)
    _wait_for("the daemons to die", lambda: not any(_alive((STATE / f"{n}.pid").read_text())
                                                      for n in ("slurmctld", "slurmd")), 30, tmp_path / "running.log")
    up = _cluster_script("up")
    assert up.returncode == 0, up.stderr
    queue = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=_env(cluster), capture_output=True, text=True,
                           timeout=30).stdout
    assert queue.strip() == "", queue
    log = tmp_path / "next.log"
    job = _wrap(cluster, log, "echo ran")
    _wait_for("the next job to end", lambda: _job(cluster, job).get("JobState") in ENDED, 60, log, period=0.2,
              conf=cluster)
    assert _job(cluster, job)["JobState"] == "COMPLETED" and log.read_text().strip() == "ran"
