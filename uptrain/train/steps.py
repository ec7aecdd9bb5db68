"""One optimizer step after another: the training loop and the steps it is made of.

    train_steps    each step, top to bottom: the stage and learning rate; forward and backward of
                   its micro batches (`_forward_backward`), the gradient norm clipped; at a sync
                   point the losses read back and checked (the one finite check, before the
                   update); the update; progress; the metrics record, evaluation and checkpoint
                   when due (`_Due`); a stop signal (agreed by all processes): a checkpoint
                   within the grace and Preempted

The run around it (set up, resume, finish) is `loop.py`; `Run` (here) is what they share.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import DistributedType
from tqdm.auto import tqdm

from uptrain.train.parallel import shard
from uptrain.train.config import TrainConfig
from uptrain.convert.progress import progress_every
from uptrain.train.report.eta import EtaTracker, ProgressLines, format_eta, plain_output
from uptrain.train.stop.health import StepHealth, check_finite
from uptrain.train.model.attention_match import attention_match_sum, attention_outputs
from uptrain.train.model.losses import kd_and_lm_sums, kd_loss_sum, lm_loss_sum
from uptrain.train.model.teacher_cache import TeacherCache
from uptrain.stopping.codes import signal_name
from uptrain.train.stop.preempt import Preempted, StopRequest, checkpoint_overruns, seconds_left
from uptrain.train.state.run_state import complete_checkpoints, save_checkpoint
from uptrain.train.setup import lr_at
from uptrain.train.model.trainable import set_trainable, trainable_at
from uptrain.train.model.validate import validate_blocks, validation_copy_probe, validation_line

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerBase

    from uptrain.train.plan.checked import Plan
    from uptrain.train.state.run_state import MetricsLog


@dataclass
class Run:
    """Everything one run holds from set-up to finish (what nanoGPT keeps in globals): the checked
    plan (read, never checked again) and what set-up built from it."""

    plan: Plan  # uptrain.train.plan: the config as checked, the budget in steps, the models' facts
    accelerator: Accelerator
    tokenizer: PreTrainedTokenizerBase
    val_blocks: Any  # datasets.Dataset of validation blocks
    model: torch.nn.Module
    teacher: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    loader: DataLoader
    metrics: MetricsLog
    checkpoint_s: float | None = None  # how long the last checkpoint took to write (a resumed run: its checkpoint's)
    teacher_cache: TeacherCache | None = None  # the teacher's log-probabilities of blocks read again (distill.teacher_cache_gb)

    # What the plan holds, by the names the steps read it by.
    config = property(lambda self: self.plan.config, doc="The config as checked (TrainConfig).")
    run_dir = property(lambda self: self.plan.run_dir, doc="The run folder.")
    resume_from = property(lambda self: self.plan.resume_from, doc="The checkpoint continued from, or None.")
    folders = property(lambda self: self.plan.folders, doc="Local folders of model, tokenizer, teacher.")
    save_dtype = property(lambda self: self.plan.models.save_dtype, doc="The dtype of the final model/.")
    trainable_ranges = property(lambda self: list(self.plan.stage_ranges),
                                doc="(first, end step, trainable) per stage.")
    identity = property(lambda self: self.plan.identity, doc="run_identity, recorded in every checkpoint.")
    grace_s = property(lambda self: self.plan.grace_s, doc="Seconds between a stop signal and the kill, or None.")

    def log(self, record: dict) -> None:
        """One metrics record to metrics.jsonl and to the trackers."""
        self.metrics.write(record)
        self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def validate(self) -> dict:
        """Validation loss and perplexity of the model now (all processes take part); with a teacher,
        also its KL to the teacher and their top-1 agreement (`validate_blocks`)."""
        c = self.config
        record = validate_blocks(self.model, self.val_blocks, self.accelerator,
                                 c.eval.batch_size or c.batch.micro_batch, c.eval.max_batches, teacher=self.teacher)
        if c.eval.copy_passages:  # asked for: how well it retrieves from its context (uptrain.measure.copy_probe)
            record |= validation_copy_probe(self.accelerator.unwrap_model(self.model), self.val_blocks,
                                            c.data.seq_len, c.eval.copy_passages, self.teacher)
        return record


def train_steps(run: Run, start_step: int, batches: Iterator[dict], stop: StopRequest | None = None) -> dict:
    """Optimizer steps `start_step` .. plan.steps - 1 on `batches`; return the last metrics record.

    Each step, top to bottom: the stage and learning rate; forward and backward of its micro
    batches, the gradient norm clipped; at a sync point the losses read back from the device and
    checked (the one finite check, before the update, so a bad step is never applied or saved);
    the update; progress; the metrics record, evaluation and checkpoint when due; a stop.

    Losses stay on the device between sync points (uptrain/train/stop/health.py): every log.every
    steps, before each evaluation and checkpoint, at the last step, and at a step a stop signal
    ends. Raises Preempted (on every process, after a checkpoint) when `stop` reports a stop signal.
    """
    progress = _Progress(run, start_step)
    try:
        return _loop(run, start_step, batches, stop, progress)
    finally:  # also on Preempted or a diverged step: the bar ends, the progress lines' watcher stops
        progress.close()


def _loop(run: Run, start_step: int, batches: Iterator[dict], stop: StopRequest | None, progress: _Progress) -> dict:
    """`train_steps`'s loop (its doc); returns the last metrics record."""
    config, plan, accelerator = run.config, run.plan, run.accelerator
    sharded = shard.is_sharded(run.model)  # shard=fsdp2; FSDP2 averages gradients like DDP: x world holds
    health, stages, record = StepHealth(accelerator.device), _Stages(run), {}
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
            result = run.validate()
            run.log({"step": done, **result})
            progress.say(validation_line(done, result))  # every validation, not only the first and last
        saved = _save(run, done) if due.save else None
        if due.any and stop is not None:
            signum = stop.agreed(done)
        if signum and done < plan.steps:
            progress.close()  # the bar ends before the stop's lines (closed again by train_steps: harmless)
            raise Preempted(signal_name(signum), done, plan.steps, saved or _stop_checkpoint(run, done, stop))
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


@contextlib.contextmanager
def plain_lines_while(run: Run, done: int) -> Iterator[None]:
    """Outside the steps (the step-0 validation; the final validation and save): in a log file, the
    `ProgressLines` watcher's 'still working' lines, so that a big model's long validation is not silent."""
    shown = run.accelerator.is_main_process and run.config.log.progress_bar and plain_output()
    lines = ProgressLines(run.plan.steps, done, progress_every()) if shown else None
    try:
        yield
    finally:
        if lines is not None:
            lines.close()


class _Progress:
    """The progress (tokens/s and the losses at each sync point) and the ETA lines: a tqdm bar on a
    terminal; where the output is a log file or a pipe, plain lines instead (`ProgressLines`: at least
    every UPTRAIN_PROGRESS_EVERY, default 10, seconds, no carriage returns). log.progress_bar false: neither."""

    def __init__(self, run: Run, start_step: int):
        self.run, self.tokens, self.t_start, self.tok_s = run, 0, time.time(), 0.0
        self.eta, self.figures = EtaTracker(), ""
        shown = run.accelerator.is_main_process and run.config.log.progress_bar
        self.lines = ProgressLines(run.plan.steps, start_step, progress_every()) if shown and plain_output() else None
        self.bar = tqdm(total=run.plan.steps, initial=start_step, disable=not shown or self.lines is not None,
                        desc="train")

    def say(self, line: str) -> None:
        """A line of the trainer's own (main process only), above the bar or among the progress lines."""
        if not self.run.accelerator.is_main_process:
            return
        if self.lines is not None:
            self.lines.say(line)
        else:
            self.bar.write(line)

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
            self.figures = ", ".join(f"{k} {v}" for k, v in {**losses, "lr": f"{lr:.2e}"}.items())
            self.figures += f", {self.tok_s:,.0f} tokens/s"
        if self.lines is not None:
            self.lines.step(done, self.figures)
        # ETA from a moving window of recent step times past the warm-up (uptrain.train.report.eta); between
        # sync points the host runs ahead of the device, the step at the sync point absorbs the wait
        left = self.eta.update(time.monotonic(), steps - done)
        if left is not None:
            self.say(f"ETA: {format_eta(left)} for {steps - done} more steps at "
                     f"{left / (steps - done):.2f} s/step (recent steps; step {done}/{steps})")

    def close(self) -> None:
        self.bar.close()
        if self.lines is not None:
            self.lines.close()


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
    matching = run.teacher is not None and run.config.distill.attention_match > 0
    for i, ids in enumerate(window):
        # Gradients are all-reduced only on the last micro batch of the step.
        sync = (contextlib.nullcontext() if i == accum - 1 else
                shard.no_grad_sync(model) if sharded else accelerator.no_sync(model))
        with sync:
            with attention_outputs(run.accelerator.unwrap_model(model), on=matching) as attention:
                logits = model(input_ids=ids).logits  # [micro_batch, seq_len, vocab]
            loss, lm, kd = _step_loss(run, logits, ids, attention)
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
                           shard.sharded_io(run.model, run.optimizer, shard.save_sharded))
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
    since = stop.since_signal()
    left = seconds_left(run.grace_s, since)
    too_slow = checkpoint_overruns(run.checkpoint_s, run.grace_s, since)
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


def _step_loss(run: Run, logits: torch.Tensor, ids: torch.Tensor,
               attention: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lm, kd) of one micro batch, each summed over its target tokens. attention: the student's
    attention outputs on this batch (`attention_outputs`; empty unless distill.attention_match).

    A term whose weight is 0 (lm at alpha_kd 1, the no-data path's; kd at alpha_kd 0) is computed without
    a graph: it is reported, not trained, and its backward through the [batch, seq, vocab] logits was ~2%
    of a CPU step on stories260K. The loss's value is the same expression either way."""
    d = run.config.distill
    if run.teacher is None:
        lm, _ = lm_loss_sum(logits, ids)
        return lm, lm, torch.zeros((), device=lm.device)
    with torch.no_grad(), run.accelerator.autocast(), attention_outputs(run.teacher, on=bool(attention)) as targets:
        if run.teacher_cache is not None and not attention:  # a block read again: its targets from memory
            teacher_logits = run.teacher_cache.log_probs(ids, lambda: run.teacher(input_ids=ids).logits)
        else:
            teacher_logits = run.teacher(input_ids=ids).logits
    if d.alpha_kd == 1 and d.temperature == 1:  # pure distillation (the no-data path): one log_softmax serves both
        kd, lm = kd_and_lm_sums(logits, teacher_logits, ids)
    else:
        with torch.no_grad() if d.alpha_kd == 1 else contextlib.nullcontext():
            lm, _ = lm_loss_sum(logits, ids)
        with torch.no_grad() if d.alpha_kd == 0 else contextlib.nullcontext():
            kd = kd_loss_sum(logits, teacher_logits, d.temperature)
    loss = d.alpha_kd * kd + (1 - d.alpha_kd) * lm
    if attention:  # the loss (what is trained) carries the matching; lm and kd stay what they name
        loss = loss + d.attention_match * attention_match_sum(attention, targets)
    return loss, lm, kd
