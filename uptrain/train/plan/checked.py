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

Below the plan, the budget it is made with: how the token budget becomes optimizer steps and
stages (no torch work), the check of the validation size made once the data is read, and the
lines the plan prints about threads, paths and the stop grace.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from uptrain.errors import UsageError
from uptrain.threads import applied as applied_threads, apply_threads as apply_cpu_threads
from uptrain.train.config import OptimConfig, TrainConfig, to_dict
from uptrain.train.plan.launch import check_compile, check_deepspeed, check_fsdp2, check_shared_run_dir, deepspeed_facts
from uptrain.train.plan.models import ModelFacts, ModelFolders, check_models, resolve_models
from uptrain.train.plan.resume import check_checkpoint_identity, check_run_dir, resume_checks, run_identity
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
