"""Two "machines" on this host (two concurrent launches of scripts/launch_multinode.sh, i.e.
`accelerate launch --num_machines 2 --machine_rank 0|1`, CPU/gloo) against one machine with the
same number of processes; and what each main-process decision means across machines.

Each machine gets its own datasets cache (HF_DATASETS_CACHE), as machines without a shared home
have; the run folder is shared, as the README requires.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny import weights
from train_helpers import (DEMO, REPO, SGD_STEPS, SGD_TWO_PROCESSES, need_models, read_metrics, tiny_overrides,
                           train_losses)
from uptrain.train.state.run_state import FINISHED_FILE, complete_checkpoints

SCRIPT = REPO / "scripts" / "launch_multinode.sh"
STEPS = SGD_STEPS
# tests/train_helpers.py's SGD run: plain SGD (its update is proportional to the gradient) with
# clipping above any gradient norm, micro batch 4 x 1 accumulation x 2 processes = 8 sequences per
# step; checkpoint at 3 and 6, the last one kept.
ARGS = SGD_TWO_PROCESSES
TIMEOUT = 240  # a launch whose ranks wait on each other forever fails here instead of hanging the suite


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    path = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))  # this tree's uptrain, in scripts too
    return {**env, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "PYTHONPATH": path, **extra}


def start_machines(args_per_machine: list[list[str]], tmp_path: Path, port: int) -> list[subprocess.Popen]:
    """Start scripts/launch_multinode.sh once per machine (concurrently), each with its own caches."""
    n = len(args_per_machine)
    procs = []
    for rank, args in enumerate(args_per_machine):
        cache = tmp_path / f"cache-machine{rank}"
        env = _env(NUM_MACHINES=str(n), MACHINE_RANK=str(rank), MAIN_PROCESS_IP="127.0.0.1",
                   MAIN_PROCESS_PORT=str(port), PROCS_PER_MACHINE="1",
                   HF_DATASETS_CACHE=str(cache / "datasets"), HF_HOME=str(cache / "hf"))
        procs.append(subprocess.Popen(["bash", str(SCRIPT), *args], cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of each process; all killed when one outlives TIMEOUT."""
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            out.append((p.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.communicate()
        pytest.fail(f"a machine was still running after {TIMEOUT} s (ranks waiting on each other)")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sgd_two_processes) -> tuple[Path, Path, list[tuple[int, str, str]], Path]:
    """(one machine x 2 processes, two machines x 1 process, the two machines' results, the folder
    of both). One machine is tests/conftest.py's session run (test_train_multiproc.py compares it
    with one process)."""
    need_models()
    tmp_path = tmp_path_factory.mktemp("multinode")
    one, two = sgd_two_processes[0], tmp_path / "two-machines"
    args = [str(DEMO), *tiny_overrides(two, steps=STEPS, **ARGS)]
    results = finish(start_machines([args, args], tmp_path, _free_port()))
    for code, _, err in results:
        assert code == 0, err[-3000:]
    return one, two, results, tmp_path


def test_two_machines_train_exactly_as_one_machine_with_as_many_processes(runs):
    one, two, results, _ = runs
    assert "x 2 processes" in results[0][1]  # both machines joined one process group of 2

    # Exactly equal, not within a tolerance: the same 2 ranks do the same arithmetic, and a sum
    # over 2 ranks (gloo's all-reduce) is a + b = b + a, so no order of reduction can change a bit.
    assert train_losses(two) == train_losses(one) and sorted(train_losses(two)) == list(range(1, STEPS + 1))
    drop_speed = [{k: v for k, v in r.items() if k != "tok_per_s"} for r in read_metrics(one)]
    # The metrics log is written by the global main process only: each record once, not once per machine.
    assert [{k: v for k, v in r.items() if k != "tok_per_s"} for r in read_metrics(two)] == drop_speed
    w_one, w_two = weights(one / "model"), weights(two / "model")
    assert w_one.keys() == w_two.keys()
    for name in w_one:
        assert torch.equal(w_two[name], w_one[name]), name

    # One checkpoint folder, written by both machines' processes into the shared run folder.
    (checkpoint,) = complete_checkpoints(two)
    (reference,) = complete_checkpoints(one)
    assert sorted(p.name for p in checkpoint.iterdir()) == sorted(p.name for p in reference.iterdir())
    assert {p.name for p in checkpoint.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    position = {k: state[k] for k in ("step", "samples", "tokens", "processes")}
    assert position == {"step": STEPS, "samples": STEPS * 8, "tokens": STEPS * 8 * 64, "processes": 2}
    # the same run identity as one machine's (the process layout is not identity; the data and settings are)
    assert state["identity"] == json.loads((reference / "trainer_state.json").read_text())["identity"]
    w_ckpt, w_ref = weights(checkpoint), weights(reference)
    assert w_ckpt.keys() == w_ref.keys() and all(torch.equal(w_ckpt[k], w_ref[k]) for k in w_ref)
    assert not list((two / "checkpoints").glob(".tmp-*"))
    assert (two / FINISHED_FILE).is_file() and not list(two.glob(".uptrain-*"))


def test_each_machine_builds_its_own_cache_when_caches_are_not_shared(runs):
    # The tokenized blocks live in each machine's datasets cache, not in the run folder: machine 1,
    # whose cache machine 0 never writes, built its own (its local main process, before its others).
    *_, base = runs
    for rank in (0, 1):
        cached = list((base / f"cache-machine{rank}" / "datasets").rglob("cache-*.arrow"))
        assert cached, f"machine {rank} has no tokenized blocks in its own cache"


def test_a_run_folder_that_machines_do_not_share_is_refused_before_anything_is_written(tmp_path):
    # The same run_dir path on two machines' local disks is two folders: here machine 1 gets
    # another folder. Checkpoints would then miss machine 1's RNG state, and machine 1 could not
    # read teacher samples; the run must stop at start with one line.
    need_models()
    shared, local = tmp_path / "run", tmp_path / "machine1-local-disk" / "run"
    machines = [[str(DEMO), *tiny_overrides(run_dir, steps=STEPS, **ARGS)] for run_dir in (shared, local)]
    results = finish(start_machines(machines, tmp_path, _free_port()))
    for code, _, err in results:
        assert code != 0
    last = [line for line in results[0][2].splitlines() if line.startswith("error:")]
    assert last and "not shared" in last[-1] and str(shared) in last[-1], results[0][2][-3000:]
    assert not shared.exists() and not local.exists()  # nothing written, not even the folders


ORDER_PROGRAM = """
import os, sys, time
from pathlib import Path
from uptrain.train.setup import caches_filled_in_turn, make_accelerator
from uptrain.train.config import load_config

config = load_config(sys.argv[1], sys.argv[2:])
accelerator = make_accelerator(config, Path(config.run_dir))
log = Path(os.environ["ORDER_LOG"])
with caches_filled_in_turn(accelerator):
    rank, local = accelerator.process_index, accelerator.local_process_index
    with open(log, "a") as f:
        f.write(f"enter {rank} {local}\\n")
    if accelerator.is_local_main_process:
        time.sleep(1)  # a cache being filled: the processes that go after it must not start meanwhile
    with open(log, "a") as f:
        f.write(f"leave {rank} {local}\\n")
accelerator.wait_for_everyone()
"""


def test_caches_are_filled_by_global_main_then_each_machines_local_main_then_the_rest(tmp_path):
    # Two machines x 2 processes. A cache the machines share is filled once (process 0 first); a
    # cache of machine 1 alone is filled once too (its local main next), then everyone else reads.
    program = tmp_path / "order.py"
    program.write_text(ORDER_PROGRAM)
    log = tmp_path / "order.log"
    port, procs = _free_port(), []
    for rank in (0, 1):  # accelerate launch itself, as a user without the script types it
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "4",
                  "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
                  "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no",
                  str(program), str(DEMO), f"run_dir={tmp_path / 'run'}", "log.log_with=[]"]
        procs.append(subprocess.Popen(launch, cwd=REPO, env=_env(ORDER_LOG=str(log)), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for code, _, err in finish(procs):
        assert code == 0, err[-3000:]
    events = [tuple(line.split()) for line in log.read_text().splitlines()]
    when = {(kind, int(rank)): i for i, (kind, rank, _) in enumerate(events)}
    assert len(when) == 8, events
    local_main = {int(rank) for kind, rank, local in events if local == "0"}
    assert local_main == {0, 2}  # process 2 is machine 1's first
    assert all(when[("leave", 0)] < when[("enter", r)] for r in (1, 2, 3)), events
    assert when[("leave", 2)] < when[("enter", 3)], events  # machine 1's other process waits for its local main
