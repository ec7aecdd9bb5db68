"""How the token budget becomes optimizer steps, and the plan's printed lines (no torch work).

Checks of the budget against the batch and the schedule; the one of the validation size, made
once the data is read; the lines the plan prints about threads and paths.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from uptrain.errors import UsageError
from uptrain.train.config import OptimConfig, TrainConfig
from uptrain.threads import applied as applied_threads, apply_threads as apply_cpu_threads


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
    at every operation)."""
    apply_cpu_threads(threads, processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


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
