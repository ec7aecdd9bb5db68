"""Shared paths and a tiny base configuration for the trainer tests (real stories260K, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
GQA4 = SHARED / "data" / "models" / "stories260K-gqa4"
MHA8 = SHARED / "data" / "models" / "stories260K-mha8"
TRAIN_TXT = SHARED / "data" / "corpora" / "tinystories-train-sample.txt"
VALID_TXT = SHARED / "data" / "corpora" / "tinystories-valid-sample.txt"
GPT2_TOKENIZER = SHARED / "data" / "tokenizers" / "gpt2"
DEMO = REPO / "configs" / "demo-cpu.yaml"
TOKENS_PER_STEP = 64 * 4 * 2  # seq_len x micro_batch x grad_accum (one process)


def need_shared() -> None:
    """Skip the calling test when ../shared (real models and text) is absent."""
    for path in (GQA4, MHA8, TRAIN_TXT, VALID_TXT):
        if not path.exists():
            pytest.skip(f"needs {path} (../shared is absent on this machine)")


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


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each in-process run builds its own Accelerator: forget the process-wide state after a test."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
