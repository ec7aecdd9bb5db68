"""What the launcher decides: the Accelerator (devices, processes, mixed precision, trackers),
and which trainer settings hold under it (DeepSpeed changes when the update happens).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from uptrain.errors import UsageError
from uptrain.train.config import TrainConfig


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
    """The main process first: it fills the datasets cache; the others then read it."""
    with accelerator.main_process_first():
        yield


def check_trackers(log_with: list[str]) -> None:
    """Refuse (UsageError) a tracker in `log.log_with` whose package cannot be imported.

    accelerate only warns and drops such a tracker, so the run would log nothing to it.
    tensorboard is imported as accelerate's TensorBoard tracker imports it (torch.utils.tensorboard,
    else tensorboardX).
    """
    if "tensorboard" in log_with:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            try:
                import tensorboardX  # noqa: F401
            except ImportError:
                raise UsageError("log.log_with asks for tensorboard but it is not installed; pip install tensorboard "
                                 "(or uptrain[tensorboard]), or set log.log_with=[] to log to metrics.jsonl only") from None
    if "wandb" in log_with:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UsageError("log.log_with asks for wandb but it is not installed; pip install wandb") from None


def _deepspeed_launch(env) -> bool:
    """A process started by `accelerate launch --use_deepspeed` (a rank: LOCAL_RANK set)."""
    return (str(env.get("ACCELERATE_USE_DEEPSPEED", "false")).lower() in ("true", "1")
            and int(env.get("LOCAL_RANK", -1)) != -1)


def check_launch_honoured(env, kind: DistributedType) -> None:
    """Refuse (UsageError) a launch whose FSDP or DeepSpeed accelerate silently dropped.

    With cpu=True (no CUDA) accelerate reports MULTI_CPU under `--use_fsdp` and `--use_deepspeed`
    and wraps the model in DDP: every rank would hold the whole model, unlike what was asked.
    """
    for flag, name, expected in (("ACCELERATE_USE_FSDP", "FSDP", DistributedType.FSDP),
                                 ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed", DistributedType.DEEPSPEED)):
        if str(env.get(flag, "false")).lower() in ("true", "1") and kind != expected:
            raise UsageError(f"the launch asks for {name} but accelerate runs {kind.value} (on CPU it drops {name} "
                             "and wraps the model in DDP); on CPU launch with --multi_gpu --num_processes N and set "
                             "shard=fsdp2 for a sharded model, or leave the launch plain")


@dataclass
class DeepSpeedFacts:
    """What the trainer needs to know of a DeepSpeed launch (from its resolved config)."""

    zero_stage: int
    gradient_clipping: float | str | None  # the DeepSpeed config's value; None: absent (no clipping)


def deepspeed_facts(accelerator: Accelerator) -> DeepSpeedFacts | None:
    """The DeepSpeed facts of this launch, or None when it is not a DeepSpeed one."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    return DeepSpeedFacts(int(ds.get("zero_optimization", {}).get("stage", 0)), ds.get("gradient_clipping"))


def check_deepspeed(config: TrainConfig, ds: DeepSpeedFacts | None) -> None:
    """Refuse (UsageError) the settings that DeepSpeed would silently change.

    Under DeepSpeed, `accelerator.backward` runs the engine's backward *and* its optimizer step:
    the trainer's own accumulation would step every micro batch, its clipping never runs (the
    DeepSpeed config's gradient_clipping does), and the NaN guard can only stop the run after the
    bad update (the last checkpoint, written before it, is still good). Under ZeRO-3, a teacher
    loaded with from_pretrained is partitioned by zero.Init yet called outside any engine.
    """
    if ds is None:
        return
    if config.batch.grad_accum > 1:
        raise UsageError("with DeepSpeed set batch.grad_accum=1 and raise batch.micro_batch instead "
                         "(DeepSpeed steps inside backward, so the trainer cannot accumulate)")
    if config.distill.teacher and ds.zero_stage == 3:
        raise UsageError("distill.teacher is not supported under DeepSpeed ZeRO-3 (the teacher would be "
                         "partitioned and called outside the engine); use ZeRO stage 1/2 or FSDP "
                         "(configs/accelerate/fsdp2.yaml)")
    clip = ds.gradient_clipping
    if isinstance(clip, str):  # "auto" left unresolved: the value that applies is unknown
        raise UsageError(f"the DeepSpeed config's gradient_clipping is {clip!r}; set it to a number equal "
                         f"to optim.grad_clip ({config.optim.grad_clip})")
    if float(clip or 0.0) != config.optim.grad_clip:
        raise UsageError(f"under DeepSpeed its config's gradient_clipping ({float(clip or 0.0)}) clips gradients, "
                         f"not optim.grad_clip ({config.optim.grad_clip}); set optim.grad_clip={float(clip or 0.0)} "
                         "or change gradient_clipping in the DeepSpeed config")
