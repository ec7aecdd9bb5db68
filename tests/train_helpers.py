"""Shared paths and a tiny base configuration for the trainer tests (real stories260K, CPU).

Everything here is shipped (examples/) or built from it, so the trainer tests run in any clone.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BUILT, EXAMPLE_MHA8 as MHA8, REPO, TRAIN_TXT, VALID_TXT, built_gqa4

GQA4 = BUILT / "stories260K-gqa4"  # built by need_models() (= conftest.built_gqa4)
DEMO = REPO / "configs" / "demo-cpu.yaml"
TOKENS_PER_STEP = 64 * 4 * 2  # seq_len x micro_batch x grad_accum (one process)


def need_models() -> None:
    """Build GQA4 (the real stories260K, from examples/) on first use; a no-op afterwards."""
    assert built_gqa4() == GQA4


def tiny_overrides(run_dir: Path, steps: int = 4, **extra) -> list[str]:
    """Overrides of configs/demo-cpu.yaml for a run of `steps` tiny steps on real text."""
    base = {
        "model": GQA4, "run_dir": run_dir, "data.train.files": f"[{TRAIN_TXT}]",
        "data.val.files": f"[{VALID_TXT}]", "data.seq_len": 64, "batch.micro_batch": 4,
        "batch.grad_accum": 2, "budget.tokens": steps * TOKENS_PER_STEP, "optim.lr": 2e-3,
        "optim.warmup_steps": 2, "eval.every": 0, "eval.max_batches": 4, "checkpoint.every": 0,
        "log.log_with": "[]", "log.progress_bar": "false", "data.repeat_data": "false",
    }
    base.update(extra)
    return [f"{key}={value}" for key, value in base.items()]


# The run pair that several test files read (tests/conftest.py's session fixture `fsdp2_runs`):
# one process (micro batch 4 x grad_accum 2) and shard=fsdp2 on two processes (micro batch 2 x
# grad_accum 2, so the non-final micro batch runs with gradient sync off): the same 8 sequences a
# step, checkpoints at steps 2, 4 and 6 (for the resumes), validation on 3 blocks (uneven over 2
# processes). tests/train/test_train_fsdp2.py checks the pair against each other; test_elastic.py
# resumes copies of both on other process counts.
PAIR_STEPS = 6
PAIR_COMMON = {"eval.every": 2, "eval.batch_size": 3, "eval.max_batches": 1, "checkpoint.every": 2,
               "checkpoint.keep": 5, "log.every": 1, "threads": 1}
PAIR_SHARDED = {"shard": "fsdp2", "batch.micro_batch": 2, "batch.grad_accum": 2}


def pair_args(run_dir: Path, sharded: bool = False, **extra) -> list[str]:
    """The overrides of the pair's one-process run (`sharded`: of its shard=fsdp2 two-process run)."""
    return tiny_overrides(run_dir, steps=PAIR_STEPS, **{**PAIR_COMMON, **(PAIR_SHARDED if sharded else {}), **extra})


# Plain SGD (its update is proportional to the gradient, unlike AdamW's) with clipping above any
# gradient norm: a gradient off by the process count shows in the losses, grad_norm and weights.
# Validation: 3 blocks (eval.batch_size 3 x max_batches 1) do not split evenly over 2 processes;
# distilled from the MHA source, so the validation's KL and top-1 agreement are reduced over processes too.
# Two processes x micro batch 4 x grad_accum 1 = one process's 4 x 2. tests/conftest.py's session
# fixture `sgd_two_processes` makes the two-process run once: test_train_multiproc.py compares it with
# one process, test_multinode.py with two machines of one process each.
SGD_STEPS = 6
SGD = {"optim.name": "sgd", "optim.lr": 0.1, "optim.grad_clip": 1000.0, "eval.every": 3,
       "eval.batch_size": 3, "eval.max_batches": 1, "distill.teacher": MHA8}
SGD_TWO_PROCESSES = {**SGD, "batch.grad_accum": 1, "checkpoint.every": 3, "checkpoint.keep": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_processes(args: list[str]) -> subprocess.CompletedProcess:
    """`accelerate launch` two real CPU processes of the trainer on DEMO with `args`; must succeed."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(free_port()), "-m", "uptrain.train", str(DEMO), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(launch, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> training loss."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide state, so that the next in-process run builds its own."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each in-process run builds its own Accelerator: forget the process-wide state after a test."""
    yield
    reset_accelerate_state()


def train_in_process(overrides: list[str]) -> None:
    """Train configs/demo-cpu.yaml with `overrides` in this process, then reset accelerate's state
    (module-scoped fixtures run outside `fresh_accelerate_state`)."""
    from uptrain.train import train
    from uptrain.train.config import load_config

    try:
        train(load_config(DEMO, overrides))
    finally:
        reset_accelerate_state()


def stories_new_to_the_model(folder: Path, n_val_stories: int = 20) -> tuple[Path, Path]:
    """TinyStories in capitals as (train, val) .txt files: real text this model has never seen.

    stories260K saw only mixed-case TinyStories, so capitals (other tokens, same stories) give a
    loss that a few training steps lower measurably; the last `n_val_stories` are held out.
    """
    stories = TRAIN_TXT.read_text().upper().split("\n\n")
    train_txt, val_txt = folder / "train-upper.txt", folder / "val-upper.txt"
    train_txt.write_text("\n\n".join(stories[:-n_val_stories]))
    val_txt.write_text("\n\n".join(stories[-n_val_stories:]))
    return train_txt, val_txt
