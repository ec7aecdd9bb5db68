"""Elastic resume: a checkpoint written by N processes continues on M (grad_accum adjusted so the
global batch, the steps and the LR schedule stay the run's), with the uninterrupted losses.

One chain per kind, each on a copy of a run of tests/conftest.py's session pair (`fsdp2_runs`, also
checked by test_train_fsdp2.py): DDP 1 -> 2 -> 1 (the one-process run, one two-process launch, one
resume in this process) and shard=fsdp2 2 -> 1 -> 2 (torch.distributed.checkpoint reshards on load;
one process is a torchrun launch, as fsdp2 needs a process group).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import DEMO, PAIR_STEPS as STEPS, REPO, pair_args, train_losses
from test_preempt import _env, _two_processes
from test_train_multiproc import _free_port
from uptrain.errors import UsageError
from uptrain.train.__main__ import main
from uptrain.train.state.run_state import FINISHED_FILE, complete_checkpoints


def _args(run_dir, sharded: bool = False, **extra) -> list[str]:
    # One process: micro batch 4 x grad_accum 2 = 8 sequences per step; sharded: 2 x 2 x 2
    # processes. Checkpoints every 2 steps.
    return pair_args(run_dir, sharded=sharded, **extra)


@pytest.fixture(scope="module")
def reference(fsdp2_runs):
    """The uninterrupted one-process run (its folder holds checkpoints 2, 4 and 6) and its losses."""
    single = fsdp2_runs[0]
    return single, train_losses(single)


def _interrupt(run_dir, keep_up_to: int) -> None:
    """As if the run had been stopped after checkpoint `keep_up_to`: later ones, model/ and the mark gone."""
    shutil.rmtree(run_dir / "model", ignore_errors=True)
    (run_dir / FINISHED_FILE).unlink(missing_ok=True)
    for checkpoint in complete_checkpoints(run_dir):
        if int(checkpoint.name.split("-")[-1]) > keep_up_to:
            shutil.rmtree(checkpoint)
    assert complete_checkpoints(run_dir)[-1].name == f"checkpoint-{keep_up_to:08d}"


def _same_losses(run_dir, reference: dict) -> None:
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():  # another reduction order across process counts: float tolerance
        assert losses[step] == pytest.approx(loss, abs=1e-5), step


def _torchrun_one(args: list[str]) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
              str(_free_port()), "-m", "uptrain.train", str(DEMO), *args]
    return subprocess.run(launch, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)


def test_ddp_one_to_two_to_one_process(tmp_path, reference, one_torch_thread, capsys):
    single, losses = reference
    run_dir = tmp_path / "run"
    shutil.copytree(single, run_dir)
    _interrupt(run_dir, 2)
    # 1 -> 2: the same command (grad_accum 2 in it) on two processes: grad_accum becomes 1.
    proc = _two_processes(_args(run_dir) + ["resume=latest"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "written by 1 process, resumed on 2: grad_accum 2 -> 1 keeps the global batch of 8" in proc.stdout, proc.stdout
    _same_losses(run_dir, losses)
    # 2 -> 1: checkpoint 4 of the two-process run, resumed by one process (grad_accum 1 -> 2).
    _interrupt(run_dir, 4)
    assert main([str(DEMO), *_args(run_dir, **{"batch.grad_accum": 1}), "resume=latest"]) == 0
    assert "written by 2 processes, resumed on 1: grad_accum 1 -> 2" in capsys.readouterr().out
    _same_losses(run_dir, losses)


def test_fsdp2_two_to_one_to_two_processes(tmp_path, reference, fsdp2_runs):
    # Sharded checkpoints (each rank its shards of weights and AdamW state) reshard on load.
    _, losses = reference
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp2_runs[1], run_dir)  # the two-process shard=fsdp2 run: micro batch 2 x 2 x 2 processes
    args = _args(run_dir, sharded=True)
    _same_losses(run_dir, losses)
    _interrupt(run_dir, 2)
    proc = _torchrun_one(args + ["resume=latest"])  # 2 -> 1
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "grad_accum 2 -> 4" in proc.stdout
    _same_losses(run_dir, losses)
    _interrupt(run_dir, 4)
    proc = _two_processes(args + ["resume=latest"])  # 1 -> 2
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_losses(run_dir, losses)


@pytest.mark.parametrize("processes,micro_batch,grad_accum", [(1, 4, 2), (2, 4, 1), (2, 2, 3), (3, 1, 4), (4, 8, 2),
                                                              (8, 1, 1), (6, 2, 5)])
def test_elastic_grad_accum_keeps_the_global_batch_or_names_the_counts_that_do(processes, micro_batch, grad_accum):
    from uptrain.train.plan.folders import elastic_grad_accum

    global_batch = processes * micro_batch * grad_accum
    state = {"step": 7, "samples": 7 * global_batch, "processes": processes}
    for world in range(1, 17):
        fits = global_batch % (micro_batch * world) == 0
        if fits:
            accum = elastic_grad_accum("ckpt", state, world, micro_batch, grad_accum)
            assert accum * micro_batch * world == global_batch
            continue
        with pytest.raises(UsageError) as err:
            elastic_grad_accum("ckpt", state, world, micro_batch, grad_accum)
        line = str(err.value)
        assert "\n" not in line and f"{global_batch} sequences" in line, line
        counts = [m for m in range(1, global_batch // micro_batch + 1) if global_batch % (micro_batch * m) == 0]
        assert f"resume on {', '.join(map(str, counts))} processes" in line, line
