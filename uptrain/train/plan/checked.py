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
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from uptrain.errors import UsageError
from uptrain.train.config import TrainConfig, to_dict
from uptrain.train.identity import run_identity
from uptrain.train.plan.budget import (
    StepBudget, check_samples_budget, check_validation_size, cpu_threads_line, paths_line, plan_run, stage_steps,
)
from uptrain.train.plan.launch import check_compile, check_deepspeed, check_fsdp2, check_shared_run_dir, deepspeed_facts
from uptrain.train.plan.models import ModelFacts, ModelFolders, check_models, resolve_models
from uptrain.train.plan.resume import check_checkpoint_identity, check_run_dir, resume_checks
from uptrain.train.preempt import stop_grace


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
