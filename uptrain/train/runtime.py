"""What the launcher decides: the Accelerator (devices, processes, mixed precision, trackers)."""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator

from uptrain.errors import UsageError
from uptrain.train.config import TrainConfig


def make_accelerator(config: TrainConfig, run_dir: Path) -> Accelerator:
    """An Accelerator for this machine; trackers named in log.log_with."""
    if "wandb" in config.log.log_with:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UsageError("log.log_with asks for wandb but it is not installed; pip install wandb") from None
    return Accelerator(
        # Without cpu=True on a machine without CUDA, `accelerate launch --multi_gpu` ranks would
        # not join one process group: each would silently train alone.
        cpu=not torch.cuda.is_available(),
        mixed_precision=config.mixed_precision,
        log_with=config.log.log_with or None,
        project_dir=str(run_dir),
    )
