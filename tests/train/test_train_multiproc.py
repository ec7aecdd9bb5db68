"""Two real CPU processes (accelerate launch, gloo DDP) against one process, same global batch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tiny import weights
from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import (DEMO, GQA4, SGD, SGD_STEPS, free_port, launch_two_processes, need_models, read_metrics,
                           tiny_overrides, train_losses)
from uptrain.train.state.run_state import FINISHED_FILE, complete_checkpoints
from uptrain.train import train
from uptrain.train.config import load_config

STEPS = SGD_STEPS
_free_port = free_port  # imported from here by test_preempt.py and test_elastic.py


@pytest.fixture(scope="module")
def sgd_runs(tmp_path_factory, sgd_two_processes) -> tuple:
    """(one-process run folder, two-process run folder, two-process stdout): same global batch."""
    need_models()
    # One process: micro batch 4 x 2 accumulation steps = 8 sequences per optimizer step.
    single = tmp_path_factory.mktemp("sgd") / "single"
    train(load_config(DEMO, tiny_overrides(single, steps=STEPS, **SGD)))
    _forget_accelerate_state()
    # Two processes: micro batch 4 x 1 step x 2 processes = the same 8 sequences per step
    # (tests/conftest.py's session run, which test_multinode.py compares with two machines).
    double, stdout = sgd_two_processes
    return single, double, stdout


def _forget_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_two_processes_match_one_process_with_the_same_global_batch(sgd_runs):
    single, double, stdout = sgd_runs
    assert "x 2 processes" in stdout  # both ranks joined one process group

    # The same loss at every step: token sums are added over both processes before dividing.
    one, two = train_losses(single), train_losses(double)
    assert sorted(two) == list(range(1, STEPS + 1))
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=1e-5), step
    # The same validation blocks, all 3 of them, though they do not split evenly over 2 processes.
    val_one = [(r["val_loss"], r["val_tokens"]) for r in read_metrics(single) if "val_loss" in r]
    val_two = [(r["val_loss"], r["val_tokens"]) for r in read_metrics(double) if "val_loss" in r]
    assert [t for _, t in val_one] == [t for _, t in val_two] == [3 * 63] * 3
    assert [v for v, _ in val_two] == pytest.approx([v for v, _ in val_one], abs=1e-5)
    # Against the teacher too (the student starts as the teacher, exactly: KL 0 at step 0): summed over
    # both processes' blocks, not one process's share.
    for key in ("val_kl_to_teacher", "val_top1_agreement"):
        one_p, two_p = ([r[key] for r in read_metrics(run) if "val_loss" in r] for run in (single, double))
        assert len(one_p) == 3 and one_p[-1] > 1e-3 and two_p == pytest.approx(one_p, abs=1e-5), key

    # One checkpoint folder for the run, holding both ranks' RNG state and the data position.
    (checkpoint,) = complete_checkpoints(double)
    assert checkpoint.name == f"checkpoint-{STEPS:08d}"
    assert {p.name for p in checkpoint.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    position = {k: state[k] for k in ("step", "samples", "tokens", "processes")}
    assert position == {"step": STEPS, "samples": STEPS * 8, "tokens": STEPS * 8 * 64, "processes": 2}
    assert state["identity"]["seed"] == 0 and state["write_s"] >= 0
    assert not list((double / "checkpoints").glob(".tmp-*"))


def test_two_processes_normalise_gradients_like_one(sgd_runs):
    # DDP averages gradients over processes; the trainer's x world makes that sum / global tokens.
    # Without it the two-process gradient is half the one-process one: grad_norm and SGD show it.
    single, double, _ = sgd_runs
    norm_one = {r["step"]: r["grad_norm"] for r in read_metrics(single) if "grad_norm" in r}
    norm_two = {r["step"]: r["grad_norm"] for r in read_metrics(double) if "grad_norm" in r}
    assert sorted(norm_two) == sorted(norm_one) == list(range(1, STEPS + 1))
    for step in norm_one:
        assert norm_two[step] == pytest.approx(norm_one[step], rel=1e-4), step
    # Same final weights: without synchronised gradients rank 0 would have learnt from half the data.
    w_one = weights(single / "model")
    w_two = weights(double / "model")
    assert w_one.keys() == w_two.keys()
    start = weights(GQA4)
    moved = max((w_one[name] - start[name]).abs().max().item() for name in w_one if name in start)
    assert moved > 1e-3  # SGD moved the weights far more than the tolerance below
    for name in w_one:
        torch.testing.assert_close(w_two[name], w_one[name], atol=1e-5, rtol=1e-4, msg=name)


# Resuming on another process count (grad_accum adjusted) and its refusal: tests/train/test_elastic.py.


def test_streaming_two_processes_see_the_same_global_batches_as_one_and_resume(tmp_path, one_torch_thread):
    # A stream is read by the main process and its batches dispatched: process r gets the r-th of
    # each group of consecutive batches, so a step's global batch is the one-process step's.
    # Validation on 1 block: fewer blocks than processes, still scored (rank 1 runs an uncounted forward).
    need_models()
    stream = {"data.train.streaming": "true", "data.shuffle_buffer": 16, "eval.max_batches": 1, "eval.batch_size": 1}
    single = tmp_path / "single"
    train(load_config(DEMO, tiny_overrides(single, steps=4, **stream)))
    double = tmp_path / "double"
    args = tiny_overrides(double, steps=4, **{**stream, "batch.grad_accum": 1, "checkpoint.every": 2})
    proc = launch_two_processes(args)
    assert "x 2 processes" in proc.stdout and "streaming train blocks" in proc.stdout
    one, two = train_losses(single), train_losses(double)
    assert sorted(two) == sorted(one) == [1, 2, 3, 4]
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=1e-5), step
    val_one = [(r["val_loss"], r["val_tokens"]) for r in read_metrics(single) if "val_loss" in r]
    val_two = [(r["val_loss"], r["val_tokens"]) for r in read_metrics(double) if "val_loss" in r]
    assert [t for _, t in val_two] == [t for _, t in val_one] == [63, 63]
    assert [v for v, _ in val_two] == pytest.approx([v for v, _ in val_one], abs=1e-5)

    # Interrupted after the checkpoint of step 2: two processes resume the stream after the
    # 2 x 8 blocks consumed and reproduce the uninterrupted losses.
    shutil.rmtree(double / "model")  # as if the run had stopped before finishing:
    (double / FINISHED_FILE).unlink()  # no model, no finished mark
    shutil.rmtree(complete_checkpoints(double)[-1])
    assert complete_checkpoints(double)[-1].name == "checkpoint-00000002"
    launch_two_processes(args + ["resume=latest"])
    resumed = train_losses(double)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in resumed:
        assert resumed[step] == pytest.approx(two[step], abs=1e-6), step
