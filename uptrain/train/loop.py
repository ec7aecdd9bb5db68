"""The uptraining run, top to bottom: set up, resume, loop, finish (the CLI is __main__.py).

    train(config)
      setup_run      checks (config, run folder, models, budget, data) before any weights load,
                     then model, teacher, optimizer, data loader, trackers
      resume_state   the checkpoint's weights, optimizer, RNG and data position (if resuming; on
                     another process count grad_accum keeps the global batch: setup_run)
      train_steps    the loop: forward, backward, step, log, eval, checkpoint, and on a stop signal
                     (SIGTERM/SIGUSR1/Ctrl-C, agreed by all processes) a checkpoint and Preempted
      finish_run     final validation, model folder with its card, loss plot

One readable loop in the spirit of nanoGPT; accelerate handles devices, processes, mixed
precision, state saving and trackers. See uptrain/train/config.py for every config field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from uptrain.train.config import TrainConfig, to_dict
from uptrain.train.health import StepHealth, TrainingDiverged, check_finite  # noqa: F401 (TrainingDiverged: public here)
from uptrain.train.eta import EtaTracker, format_eta
from uptrain.train.losses import kd_loss_sum, lm_loss_sum
from uptrain.train.report import MetricsLog, plot_losses, save_final_model, write_held_out
from uptrain.train.run_state import (
    PREEMPTED_FILE, RUN_FILE, check_checkpoint_identity, check_run_dir, checkpoint_state, complete_checkpoints, elastic_grad_accum,
    clear_run_dir, load_checkpoint, mark_finished, save_checkpoint,
)
from uptrain.train.runtime import check_deepspeed, check_shared_run_dir, deepspeed_facts, make_accelerator
from uptrain.train import shard
from uptrain.train.identity import run_identity
from uptrain.train.preempt import Preempted, StopRequest, signal_name, stop_grace
from uptrain.train.setup import (
    ModelFolders, RunPlan, apply_threads, build_data, check_models, check_validation_size, lr_at, make_optimizer,
    final_model_dtype, plan_run, resolve_models,
)
from uptrain.train.teacher_samples import check_samples_budget, ensure_teacher_samples
from uptrain.errors import UsageError
from uptrain.train.trainable import (apply_trainable, param_numel, set_trainable, stage_steps, stages_line,
                                     trainable_at, trainable_line)
from uptrain.train.validate import validate_blocks


@dataclass
class Run:
    """Everything one run holds from set-up to finish (what nanoGPT keeps in globals)."""

    config: TrainConfig
    accelerator: Accelerator
    plan: RunPlan
    run_dir: Path
    resume_from: Path | None  # the checkpoint to continue from, None for a fresh run
    tokenizer: PreTrainedTokenizerBase
    val_blocks: Any  # datasets.Dataset of validation blocks
    model: torch.nn.Module
    teacher: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    loader: DataLoader
    metrics: MetricsLog
    folders: ModelFolders  # local folders of model, tokenizer, teacher (a Hub id resolved to its cache)
    save_dtype: torch.dtype  # of the final model/
    trainable_ranges: list = dataclasses.field(default_factory=list)  # (first, end step, trainable) per stage
    identity: dict = dataclasses.field(default_factory=dict)  # uptrain.train.identity.run_identity, in every checkpoint
    grace_s: float | None = None  # seconds between a stop signal and the kill (None: unknown)
    checkpoint_s: float | None = None  # how long the last checkpoint took to write (a resumed run: its checkpoint's)

    def log(self, record: dict) -> None:
        """One metrics record to metrics.jsonl and to the trackers."""
        self.metrics.write(record)
        self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def validate(self) -> dict:
        """Validation loss and perplexity of the model now (all processes take part)."""
        c = self.config
        return validate_blocks(self.model, self.val_blocks, self.accelerator,
                               c.eval.batch_size or c.batch.micro_batch, c.eval.max_batches)


def train(config: TrainConfig) -> dict:
    """Run the training described by `config`; return the final metrics."""
    # SIGTERM/SIGUSR1/Ctrl-C: during set-up, StoppedInSetup at once; then a checkpoint after the step
    with StopRequest().installed() as stop:
        run = setup_run(config, stop)
        stop.connect(run.accelerator.process_index, run.accelerator.num_processes)
        stop.enter("checkpoint load" if run.resume_from else "step-0 evaluation")
        start_step, batches = resume_state(run)
        if start_step == 0 and config.eval.at_start:
            first = run.validate()
            run.log({"step": 0, **first})  # the alpha = 0 point: the converted model before training
            run.accelerator.print(f"step 0: val loss {first['val_loss']:.4f}, ppl {first['val_ppl']:.2f}")
        stop.setup_done()
        try:
            last_record = train_steps(run, start_step, batches, stop)
        except Preempted:
            run.accelerator.end_training()  # trackers flush what the steps logged
            raise
        return finish_run(run, last_record)


def setup_run(config: TrainConfig, stop: StopRequest | None = None) -> Run:
    """Check everything, then build model, teacher, optimizer and loader (nothing trained yet).

    `stop`: told which phase set-up is in (a stop signal meanwhile raises StoppedInSetup)."""
    enter = stop.enter if stop is not None else (lambda phase: None)
    enter("checks")
    run_dir = Path(config.run_dir)
    accelerator = make_accelerator(config, run_dir)
    world = accelerator.num_processes

    # --- checks first: config, run folder, models, budget, data; all before weights load ---
    apply_threads(config.threads)
    check_deepspeed(config, deepspeed_facts(accelerator))
    if config.shard == "fsdp2":
        shard.check_fsdp2(config, accelerator)
    if config.compile:
        shard.check_compile(accelerator.device.type)
    check_shared_run_dir(accelerator, run_dir)  # before any process reads it: all must see one folder
    resume_from = check_run_dir(run_dir, to_dict(config), config.resume, config.overwrite)
    config, state, lines = _resume_checks(config, resume_from, accelerator)
    plan = plan_run(config, world)
    ranges = []
    if config.trainable_stages:
        if world > 1:  # DDP/FSDP fix the set of parameters with gradients when they wrap the model
            raise UsageError("trainable_stages runs in one process for now; use one process or a single trainable")
        ranges = stage_steps(config.trainable_stages, plan.tokens_per_step, plan.steps, config.trainable)
    config_dict = to_dict(config)
    folders = resolve_models(config)
    tokenizer = check_models(config, folders)
    final_dtype, dtype_line = final_model_dtype(config, folders)
    data_config = config
    if config.data.train.teacher_samples is not None:  # the teacher writes the training text (once per run)
        check_samples_budget(config, plan.steps * plan.tokens_per_step)
        enter("teacher-samples generation")
        source, samples_line = ensure_teacher_samples(config, tokenizer, accelerator, folders.teacher)
        data_config = dataclasses.replace(config, data=dataclasses.replace(config.data, train=source))
        lines.append(samples_line)
    set_seed(config.seed)
    enter("data tokenization")
    data = build_data(data_config, tokenizer, plan, accelerator, state.get("samples", 0))
    check_validation_size(config, len(data.val))
    identity = run_identity(config_dict, accelerator.mixed_precision, data.fingerprint)
    if resume_from is not None:
        check_checkpoint_identity(resume_from, state, identity)
    grace_s, grace_source, grace_warning = stop_grace(config.stop_grace_s, os.environ)
    accelerator.wait_for_everyone()  # every rank has passed the checks before anything is removed
    if accelerator.is_main_process:
        _write_run_folder(config, run_dir, config_dict, data.held_out)

    # --- model, optional teacher, optimizer, loader ---
    enter("models loading")
    model, teacher, optimizer, loader = _build_training(config, folders, accelerator, data.train)
    n_params = sum(param_numel(p) for p in accelerator.unwrap_model(model).parameters())
    n_trained = sum(param_numel(p) for p in accelerator.unwrap_model(model).parameters() if p.requires_grad)
    accelerator.print(plan.describe(data_config, world, n_params, data.n_available, len(data.val)))
    for line in [*lines, dtype_line, trainable_line(config.trainable, n_trained, n_params),
                 *([stages_line(ranges)] if ranges else []), grace_line(grace_s, grace_source),
                 *([grace_warning] if grace_warning else [])]:
        accelerator.print(line)
    metrics = MetricsLog(run_dir / "metrics.jsonl", accelerator.is_main_process)
    return Run(config, accelerator, plan, run_dir, resume_from, tokenizer, data.val,
               model, teacher, optimizer, loader, metrics, folders, final_dtype, ranges, identity,
               grace_s, state.get("write_s"))


def _resume_checks(config: TrainConfig, resume_from: Path | None,
                   accelerator: Accelerator) -> tuple[TrainConfig, dict, list[str]]:
    """(config, the checkpoint's trainer state or {}, lines for the plan) of a run that may resume.

    The checkpoint's recorded identity is compared with the settings first (before any data is
    read; the data's fingerprint once it is known, in setup_run). Elastic resume: on another
    process count, grad_accum keeps the checkpoint's global batch (the returned config has it)."""
    if resume_from is None:
        return config, {}, []
    world = accelerator.num_processes
    state = checkpoint_state(resume_from)
    recorded_data = (state.get("identity") or {}).get("data_fingerprint")
    check_checkpoint_identity(resume_from, state, run_identity(to_dict(config), accelerator.mixed_precision,
                                                               recorded_data))
    accum = elastic_grad_accum(resume_from, state, world, config.batch.micro_batch, config.batch.grad_accum)
    if accum == config.batch.grad_accum:
        return config, state, []
    written = state.get("processes", "?")
    line = (f"checkpoint written by {written} process{'es' * (written != 1)}, resumed on {world}: "
            f"grad_accum {config.batch.grad_accum} -> {accum} keeps the global batch of "
            f"{accum * world * config.batch.micro_batch} sequences")
    return dataclasses.replace(config, batch=dataclasses.replace(config.batch, grad_accum=accum)), state, [line]


def _write_run_folder(config: TrainConfig, run_dir: Path, config_dict: dict, held_out) -> None:
    """The run folder as this start begins it (main process): cleared with overwrite, run.yaml
    written whole (a stop signal may come at any moment), the last stop's mark removed (this start
    continues that run), the held-out documents written for uptrain.eval."""
    if config.overwrite:
        clear_run_dir(run_dir, config.log.project)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / PREEMPTED_FILE).unlink(missing_ok=True)
    tmp = run_dir / f".{RUN_FILE}.tmp"
    tmp.write_text(yaml.safe_dump(config_dict, sort_keys=False))
    os.replace(tmp, run_dir / RUN_FILE)
    if held_out is not None:
        write_held_out(run_dir, held_out["text"])


def _build_training(config: TrainConfig, folders: ModelFolders, accelerator: Accelerator, train_blocks):
    """(model, teacher, optimizer, loader), prepared by accelerate (the model sharded first with shard=fsdp2)."""
    model, teacher = _load_models(config, folders, accelerator)
    if config.shard == "fsdp2":  # sharded by the trainer, before the optimizer sees the parameters
        model = shard.shard_model(model, accelerator, config.gradient_checkpointing, config.compile)
    optimizer = make_optimizer(model, config.optim)
    # Blocks are already in run order; accelerate gives process r every world-th batch, so one
    # step sees the same global batch whatever the number of processes. A stream (an
    # IterableDataset) is read by the main process only and its batches dispatched the same way:
    # process r gets the r-th of each group of `world` consecutive batches. A streaming source
    # cannot skip batches in the loader: the stream itself starts after the blocks the interrupted
    # run consumed (build_data's skip_blocks, the checkpoint's data position).
    dataset = train_blocks if config.data.train.streaming else train_blocks.with_format("torch")
    loader = DataLoader(dataset, batch_size=config.batch.micro_batch, shuffle=False)
    if config.shard == "fsdp2":  # accelerate would wrap the model in DDP: it prepares the loader only
        loader = accelerator.prepare(loader)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return model, teacher, optimizer, loader


def grace_line(grace_s: float | None, source: str) -> str:
    """The plan's line on stop signals and the grace this run assumes."""
    grace = "unknown" if grace_s is None else f"{grace_s:g} s"
    return f"stop signals (SIGTERM, SIGUSR1, Ctrl-C): checkpoint after the step, exit 75; grace {grace} ({source})"


def _load_models(config: TrainConfig, folders: ModelFolders,
                 accelerator: Accelerator) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The model to train (fp32 master weights) and the frozen teacher, if distilling."""
    model = AutoModelForCausalLM.from_pretrained(folders.model, dtype=torch.float32)
    # frozen parameters: requires_grad False, not in the optimizer
    apply_trainable(model, config.trainable, *(s.trainable for s in config.trainable_stages))
    model.train()  # from_pretrained returns eval mode: no dropout (a resumed run skips the step-0 eval)
    sharded = config.shard == "fsdp2"  # shard_model applies checkpointing and compile per decoder layer
    if config.gradient_checkpointing and not sharded:
        # Recompute activations in backward: less memory, more compute (renamed in transformers 5.x).
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        model.config.use_cache = False
    if config.compile and not sharded:
        model = torch.compile(model)
    teacher = None
    if folders.teacher is not None:
        teacher_dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
        teacher = AutoModelForCausalLM.from_pretrained(folders.teacher, dtype=teacher_dtype).to(accelerator.device)
        teacher.requires_grad_(False).eval()  # frozen: only a source of target distributions
    return model, teacher


def resume_state(run: Run) -> tuple[int, Iterator[dict]]:
    """Restore the checkpoint (weights, optimizer, RNG) if resuming.

    Returns the first step to run and the iterator of the run's remaining micro batches.
    """
    start_step = checkpoint_state(run.resume_from)["step"] if run.resume_from is not None else 0
    accum = run.config.batch.grad_accum
    # Skip what the interrupted run already consumed: the data order is fixed by the seed (a
    # stream was already started after the consumed blocks in setup_run).
    skip = start_step and not run.config.data.train.streaming
    batches = iter(run.accelerator.skip_first_batches(run.loader, start_step * accum) if skip else run.loader)
    if run.resume_from is not None:
        # Starting a data iterator draws from the RNG (the DataLoader's base seed; accelerate may
        # synchronise RNG states over processes): start it *before* restoring the checkpoint's
        # RNG states, so step start_step + 1 draws the dropout masks the uninterrupted run drew.
        first = next(batches, None)
        batches = itertools.chain([] if first is None else [first], batches)
        load_checkpoint(run.accelerator, run.resume_from, _sharded_io(run, shard.load_sharded))
        run.accelerator.print(f"resuming from {run.resume_from} at step {start_step}")
    run.metrics.truncate_after(start_step if run.resume_from else -1)  # records past the checkpoint are redone
    flat = _flat(to_dict(run.config))
    run.accelerator.init_trackers(run.config.log.project, config={
        k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat.items()})
    return start_step, batches


def train_steps(run: Run, start_step: int, batches: Iterator[dict], stop: StopRequest | None = None) -> dict:
    """Optimizer steps `start_step` .. plan.steps - 1 on `batches`; return the last metrics record.

    Each step, top to bottom: the stage and learning rate; forward and backward of its micro
    batches, the gradient norm clipped; at a sync point the losses read back from the device and
    checked (the one finite check, before the update, so a bad step is never applied or saved);
    the update; progress; the metrics record, evaluation and checkpoint when due; a stop.

    Losses stay on the device between sync points (uptrain/train/health.py): every log.every
    steps, before each evaluation and checkpoint, at the last step, and at a step a stop signal
    ends. Raises Preempted (on every process, after a checkpoint) when `stop` reports a stop signal.
    """
    config, plan, accelerator = run.config, run.plan, run.accelerator
    sharded = shard.is_sharded(run.model)  # shard=fsdp2; FSDP2 averages gradients like DDP: x world holds
    health, progress, record = StepHealth(accelerator.device), _Progress(run, start_step), {}
    stages = _Stages(run)
    for step in range(start_step, plan.steps):
        done = step + 1
        stages.enter(step)
        lr = _set_lr(run, step)
        window = [next(batches)["input_ids"] for _ in range(config.batch.grad_accum)]  # each [micro_batch, seq_len]
        sums, global_tokens = _forward_backward(run, window, sharded)
        # fp16's loss scaler makes inf gradients on purpose and skips those steps itself.
        health.record(step, accelerator.reduce(sums, reduction="sum") / global_tokens, _clipped_grad_norm(run),
                      check_norm=accelerator.scaler is None)
        due = _Due(config, done, plan.steps)
        # A stop signal ends the run after this step, the same step on every rank (a host all-reduce
        # of the flag), with a checkpoint. A step with work due asks after that work (a signal during
        # its evaluation or checkpoint write counts); any other step asks now, so that a stop makes it
        # a sync point and its health is checked here too, before the update.
        signum = stop.agreed(done) if stop is not None and not due.any else 0
        stats = None
        if due.any or signum:  # a sync point
            stats = health.read()
            check_finite(stats, step, run.run_dir, updated=False,
                         deepspeed=accelerator.distributed_type == DistributedType.DEEPSPEED)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        progress.step(done, stats, lr)
        if due.log:
            record = _metrics_record(run, done, stats, lr, progress.tok_s)
            run.log(record)
        if due.eval:
            run.log({"step": done, **run.validate()})
        saved = _save(run, done) if due.save else None
        if due.any and stop is not None:
            signum = stop.agreed(done)
        if signum and done < plan.steps:
            progress.close()
            raise Preempted(signal_name(signum), done, plan.steps, saved or _stop_checkpoint(run, done, stop))
    progress.close()
    return record


class _Due:
    """What step `done` (1-based) of `steps` does besides training: log, evaluate, checkpoint."""

    def __init__(self, config: TrainConfig, done: int, steps: int):
        self.log = done % config.log.every == 0 or done == steps
        self.eval = bool(config.eval.every) and done % config.eval.every == 0 and done != steps
        self.save = bool(config.checkpoint.every) and done % config.checkpoint.every == 0

    @property
    def any(self) -> bool:
        return self.log or self.eval or self.save


class _Stages:
    """`trainable` stages: which parameters train at each step (set when a stage starts or on resume)."""

    def __init__(self, run: Run):
        self.run, self.current = run, None

    def enter(self, step: int) -> None:
        if not self.run.trainable_ranges:
            return
        stage = trainable_at(self.run.trainable_ranges, step)
        if stage != self.current:  # a new stage (or a resume inside one)
            self.current = stage
            set_trainable(self.run.accelerator.unwrap_model(self.run.model), stage)


def _set_lr(run: Run, step: int) -> float:
    lr = lr_at(step, run.plan.steps, run.config.optim)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    return lr


class _Progress:
    """The progress bar (tokens/s and the losses at each sync point) and the ETA lines."""

    def __init__(self, run: Run, start_step: int):
        self.run, self.tokens, self.t_start, self.tok_s = run, 0, time.time(), 0.0
        self.eta = EtaTracker()
        self.bar = tqdm(total=run.plan.steps, initial=start_step,
                        disable=not (run.accelerator.is_main_process and run.config.log.progress_bar), desc="train")

    def step(self, done: int, stats, lr: float) -> None:
        steps = self.run.plan.steps
        self.tokens += self.run.plan.tokens_per_step
        self.bar.update(1)
        if stats is not None:
            self.tok_s = self.tokens / (time.time() - self.t_start)  # after a host sync: the device work is done
            # Named as metrics.jsonl names them: with a teacher, `loss` is the distillation mix, so the
            # bar shows its parts (lm: next-token loss, kd: the KL to the teacher).
            losses = {"lm": f"{stats.lm:.4f}", "kd": f"{stats.kd:.4f}"} if self.run.teacher is not None else {
                "loss": f"{stats.loss:.4f}"}
            self.bar.set_postfix(**losses, lr=f"{lr:.2e}", tok_s=f"{self.tok_s:,.0f}")
        # ETA from a moving window of recent step times past the warm-up (uptrain.train.eta); between
        # sync points the host runs ahead of the device, the step at the sync point absorbs the wait
        left = self.eta.update(time.monotonic(), steps - done)
        if left is not None and self.run.accelerator.is_main_process:
            self.bar.write(f"ETA: {format_eta(left)} for {steps - done} more steps at "
                           f"{left / (steps - done):.2f} s/step (recent steps; step {done}/{steps})")

    def close(self) -> None:
        self.bar.close()


def _forward_backward(run: Run, window: list[torch.Tensor], sharded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of one step's micro batches (`window`, each [micro_batch, seq_len]);
    returns ([loss, lm, kd] summed over this process's target tokens, the step's global token count),
    both on the device.

    Normalised by the target tokens of the whole step on all processes (sum / global count), not by
    a mean of per-batch means. All blocks are full now, but the rule stays right if padding or
    masking ever appears. The count stays on the device (no host sync); torch.full is a fill kernel:
    unlike torch.tensor(x, device=cuda) no copy that waits for the GPU.
    """
    accelerator, model, accum = run.accelerator, run.model, len(window)
    world = accelerator.num_processes
    local_tokens = torch.full((), float(sum(ids[:, 1:].numel() for ids in window)), device=accelerator.device)
    global_tokens = accelerator.reduce(local_tokens, reduction="sum")
    sums = torch.zeros(3, device=accelerator.device)  # [loss, lm, kd] summed over tokens
    for i, ids in enumerate(window):
        # Gradients are all-reduced only on the last micro batch of the step.
        sync = (contextlib.nullcontext() if i == accum - 1 else
                shard.no_grad_sync(model) if sharded else accelerator.no_sync(model))
        with sync:
            logits = model(input_ids=ids).logits  # [micro_batch, seq_len, vocab]
            loss, lm, kd = _step_loss(run, logits, ids)
            # DDP averages gradients over processes; x world turns that into sum / global count.
            accelerator.backward(loss * world / global_tokens)
            sums += torch.stack([loss.detach(), lm.detach(), kd.detach()]).float()
    return sums, global_tokens


def _clipped_grad_norm(run: Run) -> torch.Tensor | None:
    """The global gradient norm, clipped to optim.grad_clip (inf: computed, nothing clipped), as a tensor.
    Under DeepSpeed the step already ran inside backward; its norm is known only with clipping (else None)."""
    deepspeed = run.accelerator.distributed_type == DistributedType.DEEPSPEED
    clip = shard.clip_grad_norm if shard.is_sharded(run.model) else run.accelerator.clip_grad_norm_
    grad_clip = run.config.optim.grad_clip
    grad_norm = clip(run.model.parameters(), grad_clip or math.inf) if not deepspeed or grad_clip > 0 else None
    if grad_norm is not None and not isinstance(grad_norm, torch.Tensor):  # e.g. DeepSpeed's float
        grad_norm = torch.tensor(float(grad_norm))
    elif hasattr(grad_norm, "full_tensor"):  # accelerate's FSDP2 may return the norm as a DTensor
        grad_norm = grad_norm.full_tensor()
    return grad_norm


def _metrics_record(run: Run, done: int, stats, lr: float, tok_s: float) -> dict:
    """The metrics.jsonl record of step `done` (after a sync point: `stats` read from the device)."""
    record = {"step": done, "loss": stats.loss, "lm_loss": stats.lm, "lr": lr,
              "tokens": done * run.plan.tokens_per_step, "tok_per_s": tok_s}
    if run.teacher is not None:
        record["kd_loss"] = stats.kd
    if stats.grad_norm is not None:
        record["grad_norm"] = stats.grad_norm
    return record


def _save(run: Run, done: int) -> Path:
    """Checkpoint after `done` steps (every process): state, data position, process count, the run's
    identity; says once when the write took longer than the stop grace."""
    plan = run.plan
    state = {"step": done, "samples": done * plan.sequences_per_step, "tokens": done * plan.tokens_per_step,
             "processes": run.accelerator.num_processes, "identity": run.identity,
             "run_dir": str(run.run_dir.resolve())}
    started = time.monotonic()
    path = save_checkpoint(run.accelerator, run.run_dir, done, state, run.config.checkpoint.keep,
                           _sharded_io(run, shard.save_sharded))
    took, before = time.monotonic() - started, run.checkpoint_s
    run.checkpoint_s = took
    if run.grace_s is not None and took > run.grace_s and (before is None or before <= run.grace_s):
        run.accelerator.print(
            f"warning: checkpoint {done} took {took:.1f} s, more than the {run.grace_s:g} s stop grace: a preemption "
            f"would stop at the last periodic checkpoint instead; give the scheduler (and TORCH_ELASTIC_SHUTDOWN_TIMEOUT, "
            f"stop_grace_s) at least {2 * took:.0f} s, or checkpoint.every fewer steps")
    return path


def _stop_checkpoint(run: Run, done: int, stop: StopRequest) -> Path | None:
    """The checkpoint a stop signal asks for after step `done`, if it can be written in the grace left.

    A write that the scheduler would kill half-way saves nothing and loses the clean exit 75 (the
    requeue): when the last write took longer than what is left of the grace on any rank, nothing
    is started and the last complete checkpoint is named instead (resume=latest continues from it)."""
    left = stop.seconds_left(run.grace_s)
    too_slow = left is not None and run.checkpoint_s is not None and run.checkpoint_s > left
    if not stop.any_rank(too_slow):  # the same decision on every rank: the save is a collective
        return _save(run, done)
    done_before = complete_checkpoints(run.run_dir)
    kept = done_before[-1] if done_before else None
    need = "?" if run.checkpoint_s is None else f"{run.checkpoint_s:.1f}"
    run.accelerator.print(
        f"no checkpoint at step {done}: a write takes ~{need} s, {max(left or 0.0, 0.0):.1f} s are left of the "
        f"{run.grace_s:g} s grace; " + (f"the last complete checkpoint {kept.name} is kept" if kept else
                                        "no checkpoint yet: the resumed run starts over"))
    return kept


def _sharded_io(run: Run, io):
    """folder -> io(model, optimizer, folder) for a sharded model (its weights and optimizer are
    not accelerate's to save), else None."""
    if not shard.is_sharded(run.model):
        return None
    return lambda folder: io(run.model, run.optimizer, folder)


def _step_loss(run: Run, logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lm, kd) of one micro batch, each summed over its target tokens."""
    lm, _ = lm_loss_sum(logits, ids)
    if run.teacher is None:
        return lm, lm, torch.zeros((), device=lm.device)
    with torch.no_grad(), run.accelerator.autocast():
        teacher_logits = run.teacher(input_ids=ids).logits
    d = run.config.distill
    kd = kd_loss_sum(logits, teacher_logits, d.temperature)
    return d.alpha_kd * kd + (1 - d.alpha_kd) * lm, lm, kd


def finish_run(run: Run, last_record: dict) -> dict:
    """Final validation, the model folder with its card, the loss plot; return the final metrics."""
    config, accelerator, plan = run.config, run.accelerator, run.plan
    final_eval = run.validate()
    run.log({"step": plan.steps, **final_eval})
    accelerator.print(f"step {plan.steps}: val loss {final_eval['val_loss']:.4f}, ppl {final_eval['val_ppl']:.2f}")
    history = run.metrics.read()
    start_val = next((r["val_loss"] for r in history if r["step"] == 0 and "val_loss" in r), None)
    card = {
        "base model": config.model, "tokens": plan.steps * plan.tokens_per_step, "optimizer steps": plan.steps,
        "global batch (sequences x seq_len)": f"{plan.sequences_per_step} x {config.data.seq_len}",
        "processes": accelerator.num_processes, "peak lr": config.optim.lr,
        "distillation teacher": config.distill.teacher or "none",
        "training data": config.data.train.files or config.data.train.dataset
        or ("samples of the teacher" if config.data.train.teacher_samples else None),
        "val loss before / after": f"{start_val if start_val is None else round(start_val, 4)} / {final_eval['val_loss']:.4f}",
        "val perplexity after": round(final_eval["val_ppl"], 3), "mixed precision": accelerator.mixed_precision,
    }
    save_final_model(accelerator, run.model, run.run_dir / "model", run.folders.model, card, dtype=run.save_dtype,
                     tokenizer_dir=run.folders.tokenizer, source_name=config.model)
    if accelerator.is_main_process:
        plot_losses(history, run.run_dir / "loss.png")
        mark_finished(run.run_dir, {"steps": plan.steps, "tokens": plan.steps * plan.tokens_per_step,
                                    "val_loss": final_eval["val_loss"]})
        accelerator.print(f"saved {run.run_dir / 'model'} and {run.run_dir / 'loss.png'}")
    accelerator.end_training()
    return {**final_eval, "last_loss": last_record.get("loss"), "steps": plan.steps}


def _flat(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1} (tracker hyper-parameters must be flat)."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out
