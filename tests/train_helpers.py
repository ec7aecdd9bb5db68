"""Shared paths and a tiny base configuration for the trainer tests (real stories260K, CPU).

Everything here is shipped (examples/) or built from it, so the trainer tests run in any clone.
"""

from __future__ import annotations

import json
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
