"""The launch's checks: what accelerate was started with (processes, mixed precision, DeepSpeed,
FSDP), the trackers asked for, torch.compile, and a run folder every process shares. Each refusal
is one UsageError line; accelerate itself is made in uptrain/train/setup.py.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DistributedType

from uptrain.errors import UsageError
from uptrain.train.config import TrainConfig


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


def check_shared_run_dir(accelerator: Accelerator, run_dir: Path) -> None:
    """Refuse (UsageError, on every process) a run folder that some process does not share.

    Several processes write into the run folder (each its RNG state into a checkpoint, the
    global main the rest) and read what the global main wrote (teacher samples, checkpoints on
    resume); a run_dir on a machine's local disk would silently give checkpoints without the
    other machines' state. The global main writes a marker with a fresh name, every process
    looks for it, and the marker (and any folder made for it) is removed again. Nothing to check
    in one process.
    """
    if accelerator.num_processes == 1:
        return
    from accelerate.utils import broadcast_object_list, gather_object

    marker, made = None, None
    if accelerator.is_main_process:
        made = next((p for p in [*reversed(run_dir.parents), run_dir] if not p.exists()), None)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            marker = f".uptrain-shared-{uuid.uuid4().hex}"
            (run_dir / marker).write_text("written by process 0 to check that every process sees run_dir\n")
        except OSError as err:
            marker = f"error: {err}"
    marker = broadcast_object_list([marker])[0]
    if marker.startswith("error: "):
        raise UsageError(f"cannot write into run_dir {run_dir} ({marker.removeprefix('error: ')}); "
                         "choose a run_dir on a writable filesystem every machine shares")
    seen = gather_object([(accelerator.process_index, os.environ.get("GROUP_RANK", "?"), (run_dir / marker).is_file())])
    accelerator.wait_for_everyone()  # all have looked before the marker goes
    if accelerator.is_main_process:
        (run_dir / marker).unlink(missing_ok=True)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)  # the run has not started: leave no folder behind
    blind = [(rank, machine) for rank, machine, ok in seen if not ok]
    if blind:
        who = ", ".join(f"process {rank} (machine {machine})" for rank, machine in blind)
        raise UsageError(f"run_dir {run_dir} is not shared by all machines: {who} cannot see what process 0 wrote "
                         "there; put run_dir on a filesystem every machine mounts (checkpoints, teacher samples and "
                         "the final model are written there by several processes; caches need not be shared)")


def check_fsdp2(config, accelerator: Accelerator) -> None:
    """Refuse the launches and settings that `shard: fsdp2` does not cover (UsageError)."""
    kind = accelerator.distributed_type
    if kind not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise UsageError(f"shard=fsdp2 needs one process or a plain multi-process launch (accelerate launch "
                         f"--multi_gpu --num_processes N, or torchrun), got {kind.value}; for accelerate's own "
                         "FSDP/DeepSpeed leave shard unset")
    if accelerator.mixed_precision not in ("no", "bf16"):
        raise UsageError(f"shard=fsdp2 takes mixed_precision no or bf16, got {accelerator.mixed_precision} (fp16 "
                         "would need a sharded loss scaler); use bf16")


def check_compile(device_type: str) -> None:
    """Refuse `compile=true` (UsageError) where torch.compile's inductor cannot build kernels:
    on CPU it needs a C++ compiler, on a GPU Triton; otherwise the run fails inside its first step."""
    if device_type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception as err:  # inductor's InvalidCxxCompiler and the like
            raise UsageError(f"compile=true needs a C++ compiler for torch.compile on CPU and none works "
                             f"({type(err).__name__}; inductor tries $CXX, else g++); install g++ or set "
                             "compile=false") from None
    elif device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise UsageError("compile=true needs Triton for torch.compile on a GPU and it is not usable here; "
                             "pip install triton (it comes with CUDA builds of torch) or set compile=false")
