"""The run plan: the config, the launch and the run folder's state turned into one immutable
`Plan`, every check made here, in this order, each with its one-line UsageError.

    check_run(config, accelerator)   before any data or weights: the launch (DeepSpeed, FSDP2,
                                     compile, a shared run_dir), the run folder (resume, overwrite)
                                     and a checkpoint's identity, elastic grad_accum, the budget,
                                     trainable stages, the models' facts, teacher-sample budget,
                                     the stop grace
    check_data(plan, config, data)   once the data is read: the validation size and the
                                     checkpoint's identity with the data's fingerprint

Set-up, the loop, resume and finish read the plan; none of them checks the raw config again.

Below the plan, the launch's checks: what accelerate was started with (processes, mixed
precision, DeepSpeed, FSDP), the trackers asked for, torch.compile, and a run folder every
process shares (accelerate itself is made in uptrain/train/setup.py, which asks the first of
them while it makes it). Then the budget the plan is made with: how the token budget becomes
optimizer steps and stages (no torch work), the check of the validation size made once the data
is read, and the lines the plan prints about threads, paths and the stop grace. What the run
folder and the models hold is checked in folders.py.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from transformers import PreTrainedTokenizerBase

from uptrain.errors import UsageError
from uptrain.threads import applied as applied_threads, apply_threads as apply_cpu_threads, keep_freed_memory
from uptrain.train.config import OptimConfig, TrainConfig, to_dict
from uptrain.train.plan.folders import (ModelFacts, ModelFolders, check_checkpoint_identity, check_models,
                                       check_run_dir, resolve_models, resume_checks, run_identity)
from uptrain.train.stop.preempt import stop_grace


@dataclass(frozen=True)
class Plan:
    """Everything checked about one run, before any data is read or weights load."""

    config: TrainConfig  # as checked; on an elastic resume, with the grad_accum that keeps the global batch
    config_dict: dict  # to_dict(config): run.yaml and the run's identity
    run_dir: Path
    world: int  # processes of the launch
    mixed_precision: str  # the launch's (accelerate's resolved value)
    resume_from: Path | None  # the checkpoint to continue from, None for a fresh run
    resumed: dict  # that checkpoint's trainer state ({} for a fresh run)
    total_tokens: int
    steps: int
    sequences_per_step: int  # global: micro_batch x grad_accum x processes
    tokens_per_step: int  # sequences_per_step x seq_len
    stage_ranges: tuple  # (first, end step, trainable) per trainable stage
    models: ModelFacts  # folders, family, shape, positions, vocabulary, final dtype: read once
    grace_s: float | None  # seconds between a stop signal and the kill (None: unknown)
    grace_source: str
    grace_warning: str | None
    lines: tuple[str, ...] = ()  # what the checks have to say in the plan (elastic resume)
    identity: dict = dataclasses.field(default_factory=dict)  # run_identity, once the data is known

    @property
    def folders(self) -> ModelFolders:
        """Local folders of model, tokenizer and teacher."""
        return self.models.folders

    def describe(self, data_config: TrainConfig, n_params: int, n_train: int | None, n_val: int) -> str:
        """Human-readable plan printed at the start of a run (`data_config`: the data actually read)."""
        b = self.config.batch
        return (
            f"plan: {self.steps} steps x {self.tokens_per_step:,} tokens = {self.steps * self.tokens_per_step:,} "
            f"tokens (budget {self.total_tokens:,}); {self.sequences_per_step} sequences/step = "
            f"micro_batch {b.micro_batch} x grad_accum {b.grad_accum} x {self.world} processes, seq_len "
            f"{self.config.data.seq_len}; model {n_params:,} params; data "
            f"{'streaming' if n_train is None else n_train} train blocks, {n_val} val blocks\n"
            f"val loss: the mean over the {n_val} val blocks, documents packed end to end into {self.config.data.seq_len}-"
            f"token blocks (a token sees only its block before it); uptrain.eval scores each document on its own "
            f"in windows of the model's context: the number to compare models with, usually lower\n"
            f"{cpu_threads_line(self.config.threads)}\n{paths_line(data_config)}"
        )


def check_run(config: TrainConfig, accelerator: Accelerator) -> tuple[Plan, PreTrainedTokenizerBase]:
    """(the checked plan, the student's tokenizer): every check that needs no data, in one place."""
    run_dir = Path(config.run_dir)
    world = accelerator.num_processes
    check_deepspeed(config, deepspeed_facts(accelerator))
    if config.shard == "fsdp2":
        check_fsdp2(config, accelerator)
    if config.compile:
        check_compile(accelerator.device.type)
    if config.bf16_attention and accelerator.device.type != "cpu":
        raise UsageError(f"bf16_attention=true is for CPU runs (this run is on {accelerator.device.type}); on a GPU "
                         "set mixed_precision: bf16 instead, or bf16_attention=false")
    check_shared_run_dir(accelerator, run_dir)  # before any process reads it: all must see one folder
    resume_from = check_run_dir(run_dir, to_dict(config), config.resume, config.overwrite)
    config, state, lines = resume_checks(config, resume_from, world, accelerator.mixed_precision)
    budget = plan_run(config, world)
    ranges = _stage_ranges(config, budget, world)
    facts, tokenizer = check_models(config, resolve_models(config))
    if config.data.train.teacher_samples is not None:
        check_samples_budget(config, budget.steps * budget.tokens_per_step)
    grace_s, grace_source, grace_warning = stop_grace(config.stop_grace_s, os.environ)
    plan = Plan(config, to_dict(config), run_dir, world, accelerator.mixed_precision, resume_from, state,
                budget.total_tokens, budget.steps, budget.sequences_per_step, budget.tokens_per_step, tuple(ranges),
                facts, grace_s, grace_source, grace_warning, tuple(lines))
    return plan, tokenizer


def check_data(plan: Plan, n_val_blocks: int, data_fingerprint: str | None) -> Plan:
    """The plan with the run's identity, once the data is read: the validation must score some
    token, and a resumed checkpoint must have been trained on the same data."""
    check_validation_size(plan.config, n_val_blocks)
    identity = run_identity(plan.config_dict, plan.mixed_precision, data_fingerprint)
    if plan.resume_from is not None:
        check_checkpoint_identity(plan.resume_from, plan.resumed, identity)
    return dataclasses.replace(plan, identity=identity)


def _stage_ranges(config: TrainConfig, budget: StepBudget, world: int) -> list:
    """(first, end step, trainable) per trainable stage ([] without stages)."""
    if not config.trainable_stages:
        return []
    if world > 1:  # DDP/FSDP fix the set of parameters with gradients when they wrap the model
        raise UsageError("trainable_stages runs in one process for now; use one process or a single trainable")
    return stage_steps(config.trainable_stages, budget.tokens_per_step, budget.steps, config.trainable)


# The launch's checks: what accelerate was started with, the trackers, compile, a shared run folder.

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


# The token budget as steps, and the plan's printed lines: what `check_run` is made with.

@dataclass(frozen=True)
class StepBudget:
    """How the token budget becomes optimizer steps."""

    total_tokens: int
    steps: int
    sequences_per_step: int  # global: micro_batch x grad_accum x processes
    tokens_per_step: int  # sequences_per_step x seq_len


def plan_run(config: TrainConfig, world: int) -> StepBudget:
    """Steps from the budget and the global batch; UsageError when it is below one step."""
    sequences = config.batch.micro_batch * config.batch.grad_accum * world
    per_step = sequences * config.data.seq_len
    total = config.budget.total_tokens()
    if total < per_step:
        raise UsageError(
            f"budget of {total:,} tokens is below one optimizer step of {per_step:,} tokens "
            f"(seq_len x micro_batch x grad_accum x {world} processes); raise the budget or shrink the batch"
        )
    steps = total // per_step
    if config.optim.warmup_steps > steps:
        raise UsageError(
            f"optim.warmup_steps={config.optim.warmup_steps} is more than the run's {steps} optimizer steps "
            f"({total:,} tokens / {per_step:,} per step); lower optim.warmup_steps or raise the budget"
        )
    if config.optim.schedule == "wsd" and config.optim.warmup_steps + wsd_decay_steps(steps, config.optim) > steps:
        raise UsageError(
            f"optim.warmup_steps={config.optim.warmup_steps} plus the wsd decay "
            f"({wsd_decay_steps(steps, config.optim)} steps, decay_fraction={config.optim.decay_fraction}) is more "
            f"than the run's {steps} optimizer steps; lower either or raise the budget"
        )
    return StepBudget(total, steps, sequences, per_step)


def check_samples_budget(config: TrainConfig, budget_tokens: int) -> None:
    """UsageError before any generation when the samples asked for cannot cover the budget without
    data.repeat_data (the exact check, on the packed blocks, follows the generation)."""
    ts = config.data.train.teacher_samples
    if ts is not None and not config.data.repeat_data and ts.tokens < budget_tokens:
        raise UsageError(
            f"data.train.teacher_samples.tokens {ts.tokens:,} is below the budget of {budget_tokens:,} tokens: "
            f"raise it to at least {budget_tokens:,}, or set data.repeat_data=true to train on the samples "
            "more than once (checked before generating)")


def stage_steps(stages: list, tokens_per_step: int, steps: int, final: str) -> list[tuple[int, int, str]]:
    """`trainable_stages` as (first step, end step, trainable) ranges of 0-based optimizer steps,
    the rest of the run (if any) with `final`; UsageError for a stage shorter than one step."""
    ranges, start = [], 0
    for i, stage in enumerate(stages):
        n = stage.tokens // tokens_per_step
        if n < 1:
            raise UsageError(f"trainable_stages[{i}] has {stage.tokens:,} tokens, less than one optimizer step of "
                             f"{tokens_per_step:,} tokens; give it more tokens")
        ranges.append((start, start + n, stage.trainable))
        start += n
    if start < steps:
        ranges.append((start, steps, final))
    return ranges


def wsd_decay_steps(total_steps: int, o: OptimConfig) -> int:
    """Steps of the final linear decay of the `wsd` schedule (at least 1)."""
    return max(1, round(o.decay_fraction * total_steps))


def check_validation_size(config: TrainConfig, n_val_blocks: int) -> int:
    """The number of validation blocks evaluated; UsageError when they would score no token.

    A validation over nothing would log val_loss 0 and perplexity 1, a perfect score, into the
    metrics and the model card.
    """
    batch = config.eval.batch_size or config.batch.micro_batch
    cap = config.eval.max_batches
    n_eval = n_val_blocks if cap is None else min(n_val_blocks, cap * batch)
    if n_eval * (config.data.seq_len - 1) <= 0:
        raise UsageError(
            f"validation would score no tokens: {n_val_blocks} validation blocks of {config.data.seq_len} tokens, "
            f"eval.max_batches={cap} x eval batch {batch}; give more validation text or raise eval.max_batches"
        )
    return n_eval


def apply_threads(threads: int | None) -> None:
    """Set torch's CPU threads per process: the `threads` config field, else OMP_NUM_THREADS, else
    the CPUs the load average leaves free shared among this machine's processes of the run
    (`uptrain.threads.choose_threads`; with more threads than free cores they wait on each other
    at every operation); and keep the memory each step frees for the next (`keep_freed_memory`)."""
    apply_cpu_threads(threads, processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    keep_freed_memory()


def cpu_threads_line(threads: int | None) -> str:
    """The plan's line: how many threads each process runs and why."""
    choice = applied_threads()
    if choice is None or choice.threads != torch.get_num_threads():
        return f"CPU threads per process: {torch.get_num_threads()}"
    how = f"({choice.why}; config: threads)" if threads is None else "(config: threads)"
    return f"CPU threads per process: {choice.threads} {how}"


def paths_line(config: TrainConfig) -> str:
    """Where the run reads and writes, resolved (a config's relative paths are relative to its file)."""
    def where(source) -> str:
        if source is None:
            return f"{config.data.val_fraction:.0%} of the training documents"
        return ", ".join(str(Path(f).resolve()) for f in source.files) or f"Hub dataset {source.dataset}"
    def folder(name: str) -> str:  # a local folder resolved, a Hub id as given
        return str(Path(name).resolve()) if Path(name).exists() else name
    teacher = f"; teacher {folder(config.distill.teacher)}" if config.distill.teacher else ""
    return (f"paths: model {folder(config.model)}{teacher}; run_dir {Path(config.run_dir).resolve()}; "
            f"train data {where(config.data.train)}; validation {where(config.data.val)}")


def grace_line(grace_s: float | None, source: str) -> str:
    """The plan's line on stop signals and the grace this run assumes."""
    grace = "unknown" if grace_s is None else f"{grace_s:g} s"
    return f"stop signals (SIGTERM, SIGUSR1, Ctrl-C): checkpoint after the step, exit 75; grace {grace} ({source})"
