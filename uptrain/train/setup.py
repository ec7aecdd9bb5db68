"""What the trainer builds before the first step, once the plan is checked: the accelerator (what
the launcher decides: devices, processes, mixed precision, trackers; the caches filled in turn),
the run's data, the optimizer and its learning-rate schedule.

The checks themselves and the model's facts live in `uptrain.train.plan` (names re-exported here
for the callers that import them from this module).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import datasets
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from uptrain.data import DataSource, documents, split_documents
from uptrain.data.source import files_fingerprint
from uptrain.data.blocks import first_blocks, require_blocks, token_blocks, tokenizer_fingerprint
from uptrain.data.schedule import StreamSchedule, schedule_blocks
from uptrain.train.config import OptimConfig, TrainConfig
from uptrain.train.plan.checked import (  # noqa: F401 (public here too)
    StepBudget, StepBudget as RunPlan, _deepspeed_launch, apply_threads, check_launch_honoured, check_trackers,
    check_validation_size, cpu_threads_line, paths_line, plan_run, wsd_decay_steps,
)
from uptrain.train.plan.folders import (  # noqa: F401 (public here too)
    ModelFacts, ModelFolders, check_models, final_model_dtype, resolve_models, vocab_difference,
)
from uptrain.train.model.cpu_attention import cpu_run
from uptrain.train.model.trainable import param_shape


def make_accelerator(config: TrainConfig, run_dir: Path) -> Accelerator:
    """An Accelerator for this machine; trackers named in log.log_with.

    Mixed precision: an explicit `mixed_precision` in the run config wins; unset (None), accelerate
    takes the launcher's (`accelerate launch --mixed_precision` / the accelerate config file, passed
    as ACCELERATE_MIXED_PRECISION), else "no".
    """
    check_trackers(config.log.log_with)
    cpu, handlers = cpu_run(), []
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


class RunData(NamedTuple):
    """What `build_data` makes for a run."""

    train: datasets.Dataset | StreamSchedule  # the train blocks for the whole run, in run order
    val: datasets.Dataset  # validation blocks
    n_available: int | None  # train blocks available (None: a stream)
    fingerprint: str | None  # of the training files' content and the tokenizer (None: a Hub dataset,
    # which the config names): a checkpoint records it, a resume compares it
    held_out: datasets.Dataset | None  # the documents held out of data.train for validation (None: data.val)


def build_data(
    config: TrainConfig, tokenizer, plan: StepBudget, accelerator: Accelerator, skip_blocks: int = 0
) -> RunData:
    """The run's data (`RunData`).

    The data path of `uptrain.data`, top to bottom: sources -> documents (validation: data.val,
    or a held-out share of the train documents) -> token blocks -> the run's schedule. A whole
    train source is scheduled by a seeded shuffle (a resumed run skips batches in the loader); a
    streaming one becomes a `StreamSchedule` that packs on the fly and starts after the
    `skip_blocks` blocks a resumed run already consumed. Validation is always a fixed dataset: a
    streaming data.val gives its first eval.max_batches x eval batch blocks.
    """
    d = config.data
    with caches_filled_in_turn(accelerator):
        train_docs = documents(d.train, "data.train.text_field")
        if d.val is None:  # hold out whole documents of the train source (validated: not streaming)
            train_docs, val_docs = split_documents(train_docs, d.val_fraction, config.seed)
        else:
            val_docs = documents(d.val, "data.val.text_field")
        train = token_blocks(train_docs, tokenizer, d.seq_len, d.num_proc, d.copy_repeats)
        val = token_blocks(val_docs, tokenizer, d.seq_len, d.num_proc)
        if d.val is not None and d.val.streaming:
            val = first_blocks(val, config.eval.max_batches * (config.eval.batch_size or config.batch.micro_batch))
    if not d.train.streaming:
        require_blocks(train, d.seq_len, _name(d.train))
    if d.val is None:
        require_blocks(val, d.seq_len, f"the held-out {d.val_fraction:g} of {_name(d.train)} ({len(val_docs)} documents)",
                       "raise data.val_fraction or give data.val")
    else:
        require_blocks(val, d.seq_len, _name(d.val))

    n_sequences = plan.steps * plan.sequences_per_step
    fingerprint = None
    if d.train.files:
        fingerprint = f"{files_fingerprint(d.train.files)}|{tokenizer_fingerprint(tokenizer)}"
    if d.train.streaming:
        schedule = StreamSchedule(train, n_sequences, config.seed, d.repeat_data, d.shuffle_buffer, skip_blocks,
                                  name=f"the training stream {_name(d.train)}")
        return RunData(schedule, val, None, fingerprint, None)
    held_out = val_docs if d.val is None else None
    return RunData(schedule_blocks(train, n_sequences, config.seed, d.repeat_data), val, len(train), fingerprint,
                   held_out)


def _name(source: DataSource) -> str:
    """A source as an error message names it."""
    return f"data source {source.files or source.dataset}"


def make_optimizer(model: torch.nn.Module, o: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (or plain SGD); weight decay only on matrices (not on norms and biases), as in nanoGPT.

    SGD's update is proportional to the gradient, so an error in gradient scale shows in the
    weights; AdamW's update is (nearly) scale-invariant and hides it.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    # Under DeepSpeed ZeRO-3 (zero.Init) a parameter is a partitioned, empty 1-d tensor here: by
    # p.dim() every matrix would land in the group without weight decay.
    matrix = {id(p) for p in params if len(param_shape(p)) >= 2}
    groups = [
        {"params": [p for p in params if id(p) in matrix], "weight_decay": o.weight_decay},
        {"params": [p for p in params if id(p) not in matrix], "weight_decay": 0.0},
    ]
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=0.0)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


def lr_at(step: int, total_steps: int, o: OptimConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): warm-up, then decay to min_lr by the last step.

    The transformers schedule of the same name read one step ahead, i.e. as if its scheduler were
    stepped before each optimizer step, so no step is spent at lr 0 and the last step of the run
    is exactly at min_lr. `cosine` is `get_cosine_with_min_lr_schedule_with_warmup`
    (min_lr_rate = o.min_lr_ratio): step 0 at lr / warmup_steps, the peak once at the last
    warm-up step. `wsd` is `get_wsd_schedule` (linear warm-up from min_lr, linear decay over
    round(decay_fraction x steps) steps, the peak held in between). A pure function of the step,
    so a resumed run needs no scheduler state to get it right.
    """
    t, warmup, m = step + 1, o.warmup_steps, o.min_lr_ratio  # transformers' `current_step` after scheduler.step()
    if o.schedule == "wsd":
        decay = wsd_decay_steps(total_steps, o)
        stable = max(0, total_steps - warmup - decay)
        if t < warmup:
            return o.lr * ((t / warmup) * (1 - m) + m)
        if t < warmup + stable:
            return o.lr
        if t < warmup + stable + decay:
            return o.lr * ((1 - (t - warmup - stable) / max(1, decay)) * (1 - m) + m)
        return o.lr * m
    if t < warmup:
        return o.lr * t / warmup
    progress = (t - warmup) / max(1, total_steps - warmup)
    factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return o.lr * (factor * (1 - m) + m)
