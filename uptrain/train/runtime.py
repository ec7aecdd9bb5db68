"""What the launcher decides: the Accelerator (devices, processes, mixed precision, trackers), and
the caches filled in turn. Which trainer settings hold under the launch is checked in the plan
(uptrain/train/plan/launch.py; its names are re-exported here).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from uptrain.train.config import TrainConfig
from uptrain.train.plan.launch import (  # noqa: F401 (public here too)
    DeepSpeedFacts, _deepspeed_launch, check_deepspeed, check_launch_honoured, check_shared_run_dir, check_trackers,
    deepspeed_facts,
)


def make_accelerator(config: TrainConfig, run_dir: Path) -> Accelerator:
    """An Accelerator for this machine; trackers named in log.log_with.

    Mixed precision: an explicit `mixed_precision` in the run config wins; unset (None), accelerate
    takes the launcher's (`accelerate launch --mixed_precision` / the accelerate config file, passed
    as ACCELERATE_MIXED_PRECISION), else "no".
    """
    check_trackers(config.log.log_with)
    cpu, handlers = not torch.cuda.is_available(), []
    if cpu and _deepspeed_launch(os.environ):
        # cpu=True would make accelerate drop DeepSpeed (MULTI_CPU + DDP). With cpu=False and no
        # CUDA, accelerate finds no backend and counts 1 process while DeepSpeed sees the world:
        # name gloo, so DeepSpeed's init_distributed joins one gloo group and accelerate counts it.
        cpu, handlers = False, [InitProcessGroupKwargs(backend="gloo")]
    accelerator = Accelerator(
        # Without cpu=True on a machine without CUDA, `accelerate launch --multi_gpu` ranks would
        # not join one process group: each would silently train alone.
        cpu=cpu,
        mixed_precision=config.mixed_precision,
        log_with=config.log.log_with or None,
        project_dir=str(run_dir),
        kwargs_handlers=handlers or None,
    )
    check_launch_honoured(os.environ, accelerator.distributed_type)
    return accelerator


@contextlib.contextmanager
def caches_filled_in_turn(accelerator: Accelerator) -> Iterator[None]:
    """Run the body (work that fills a per-machine cache, e.g. tokenization into the datasets
    cache) in three turns: the global main process; then the local main process of every other
    machine; then all the others, who read what their machine's cache now holds.

    A cache shared by all machines (HF_HOME on a shared disk) is so filled once, by process 0,
    and a cache of one machine's own once, by that machine's local main: never two processes
    filling one cache at the same time. (The global main alone first, as before, let all the
    processes of every other machine fill their machine's cache at once.) Each turn ends with a
    barrier of all processes.
    """
    with accelerator.main_process_first(), accelerator.local_main_process_first():
        yield
