"""Two real CPU processes (accelerate launch, gloo DDP) against one process, same global batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import DEMO, REPO, need_models, read_metrics, tiny_overrides, train_losses
from uptrain.train.run_state import complete_checkpoints
from uptrain.train import train
from uptrain.train.config import load_config

STEPS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_processes(args: list[str]) -> subprocess.CompletedProcess:
    """`accelerate launch` two real CPU processes of the trainer on DEMO with `args`; must succeed."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(_free_port()), "-m", "uptrain.train", str(DEMO), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(launch, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    need_models()
    # One process: micro batch 4 x 2 accumulation steps = 8 sequences per optimizer step.
    single = tmp_path / "single"
    train(load_config(DEMO, tiny_overrides(single, steps=STEPS)))

    # Two processes: micro batch 4 x 1 step x 2 processes = the same 8 sequences per step.
    double = tmp_path / "double"
    args = tiny_overrides(double, steps=STEPS, **{"batch.grad_accum": 1, "checkpoint.every": 3, "checkpoint.keep": 1})
    proc = launch_two_processes(args)
    assert "x 2 processes" in proc.stdout  # both ranks joined one process group

    # The same loss at every step: token sums are added over both processes before dividing.
    one, two = train_losses(single), train_losses(double)
    assert sorted(two) == list(range(1, STEPS + 1))
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=1e-5), step
    val_one = [r["val_loss"] for r in read_metrics(single) if "val_loss" in r]
    val_two = [r["val_loss"] for r in read_metrics(double) if "val_loss" in r]
    assert val_two == pytest.approx(val_one, abs=1e-5)

    # Same final weights: without synchronised gradients rank 0 would have learnt from half the data.
    w_one = load_file(single / "model" / "model.safetensors")
    w_two = load_file(double / "model" / "model.safetensors")
    assert w_one.keys() == w_two.keys()
    for name in w_one:
        torch.testing.assert_close(w_two[name], w_one[name], atol=1e-5, rtol=1e-4, msg=name)

    # One checkpoint folder for the run, holding both ranks' RNG state and the data position.
    (checkpoint,) = complete_checkpoints(double)
    assert checkpoint.name == f"checkpoint-{STEPS:08d}"
    assert {p.name for p in checkpoint.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state == {"step": STEPS, "samples": STEPS * 8, "tokens": STEPS * 8 * 64}
    assert not list((double / "checkpoints").glob(".tmp-*"))


def test_streaming_two_processes_see_the_same_global_batches_as_one(tmp_path, one_torch_thread):
    # A stream is read by the main process and its batches dispatched: process r gets the r-th of
    # each group of consecutive batches, so a step's global batch is the one-process step's.
    need_models()
    stream = {"data.train.streaming": "true", "data.shuffle_buffer": 16}
    single = tmp_path / "single"
    train(load_config(DEMO, tiny_overrides(single, steps=4, **stream)))
    double = tmp_path / "double"
    args = tiny_overrides(double, steps=4, **{**stream, "batch.grad_accum": 1})
    proc = launch_two_processes(args)
    assert "x 2 processes" in proc.stdout and "streaming train blocks" in proc.stdout
    one, two = train_losses(single), train_losses(double)
    assert sorted(two) == sorted(one) == [1, 2, 3, 4]
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=1e-5), step
