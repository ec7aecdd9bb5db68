"""Everything the trainer checks and builds before the first step.

All checks run before any heavy work (data tokenization, weight loading), so a bad config fails
in seconds with one line (UsageError -> exit code 2).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import NamedTuple
from pathlib import Path

import datasets
import torch
from accelerate import Accelerator
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from uptrain.convert.io.hfconfig import model_shape
from uptrain.convert.io.source import open_checkpoint, resolve_source
from uptrain.errors import UsageError
from uptrain.data import DataSource, documents, split_documents
from uptrain.data.source import files_fingerprint
from uptrain.data.blocks import first_blocks, require_blocks, token_blocks, tokenizer_fingerprint
from uptrain.data.schedule import StreamSchedule, schedule_blocks
from uptrain.train.config import OptimConfig, TrainConfig
from uptrain.train.runtime import caches_filled_in_turn
from uptrain.train.trainable import check_trainable_model, param_shape
from uptrain.threads import applied as applied_threads, apply_threads as apply_cpu_threads


@dataclass
class ModelFolders:
    """Local folders of the model to train, its tokenizer and the teacher (None: no distillation)."""

    model: Path
    tokenizer: Path
    teacher: Path | None


def resolve_models(config: TrainConfig) -> ModelFolders:
    """The folders behind `model`, `tokenizer` and `distill.teacher`: a local folder as given, a Hub
    id (org/name) through huggingface_hub as the converter resolves it (offline: from the local
    cache; not cached: one-line UsageError)."""
    model = resolve_source(config.model)
    tokenizer = model if config.tokenizer in (None, config.model) else resolve_source(config.tokenizer)
    teacher = resolve_source(config.distill.teacher) if config.distill.teacher else None
    return ModelFolders(model, tokenizer, teacher)


def _model_config(path: Path, name: str, role: str):
    """The Hugging Face config of the model folder `path` (UsageError when it is not one)."""
    if not (path / "config.json").is_file():
        raise UsageError(f"{role} {name} is not a model folder (no config.json at {path}); check the path or Hub id")
    return AutoConfig.from_pretrained(path)


def _tokenizer(path: Path, name: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved in folder `path` (UsageError when there is none that loads)."""
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        raise UsageError(f"cannot load a tokenizer from {name}: {str(err).splitlines()[0]}") from err


def check_models(config: TrainConfig, folders: ModelFolders) -> PreTrainedTokenizerBase:
    """Check student, teacher and tokenizers (in `folders`); return the student's tokenizer."""
    student = _model_config(folders.model, config.model, "model")
    kv_heads = model_shape(student).kv_heads  # registry field: Falcon num_kv_heads, GPTBigCode multi_query
    if config.expect_kv_heads is not None and kv_heads != config.expect_kv_heads:
        raise UsageError(
            f"model {config.model} has {kv_heads} key/value heads but expect_kv_heads={config.expect_kv_heads}; "
            "convert it first or fix expect_kv_heads"
        )
    positions = getattr(student.get_text_config(), "max_position_embeddings", None)
    if positions and config.data.seq_len > positions:
        raise UsageError(f"data.seq_len={config.data.seq_len} is beyond the {positions} positions of model "
                         f"{config.model} (max_position_embeddings); use data.seq_len<={positions}")
    for value in {config.trainable, *(s.trainable for s in config.trainable_stages)}:
        check_trainable_model(value, student.model_type, config.model)
    shape = model_shape(student)
    if shape.kv_heads == shape.heads and shape.heads > 1 and os.environ.get("RANK", "0") == "0":
        # not a conversion: probably the source itself, given by mistake
        print(f"warning: model {config.model} has as many K/V heads as query heads ({shape.heads}): it is not a "
              "GQA conversion; convert it first (python -m uptrain.convert ... --kv-heads K) unless this is "
              "the MHA control run", flush=True)
    tokenizer = _tokenizer(folders.tokenizer, config.tokenizer or config.model)
    if folders.teacher is not None:
        teacher = _model_config(folders.teacher, config.distill.teacher, "distill.teacher")
        teacher_tok = _tokenizer(folders.teacher, config.distill.teacher)
        # Distillation compares distributions token by token: ids must mean the same strings.
        if teacher_tok.get_vocab() != tokenizer.get_vocab() or teacher.vocab_size != student.vocab_size:
            raise UsageError(
                f"teacher {config.distill.teacher} and student {config.model} do not share a tokenizer "
                f"({vocab_difference(teacher_tok.get_vocab(), tokenizer.get_vocab(), teacher.vocab_size, student.vocab_size)}); "
                "distillation needs identical vocabularies: distil from the model you converted"
            )
    return tokenizer


def vocab_difference(teacher: dict[str, int], student: dict[str, int], teacher_size: int, student_size: int) -> str:
    """What differs between two vocabularies (token -> id), in words: sizes, or the first tokens whose
    ids differ (two vocabularies of one size can map other ids)."""
    if len(teacher) != len(student) or teacher_size != student_size:
        return (f"vocabulary of {len(teacher):,} tokens (embedding {teacher_size:,}) vs {len(student):,} "
                f"(embedding {student_size:,})")
    differ = sorted(t for t in teacher.keys() | student.keys() if teacher.get(t) != student.get(t))
    shown = ", ".join(f"{t!r}: {teacher.get(t)} vs {student.get(t)}" for t in differ[:3])
    return f"both {len(teacher):,} tokens, but {len(differ):,} map to other ids (teacher vs student: {shown})"


def final_model_dtype(config: TrainConfig, folders: ModelFolders) -> tuple[torch.dtype, str]:
    """The dtype of the final model/ and a line for the plan: `save_dtype`, or with "source" the
    dtype the model's floating-point weights are stored in (most bytes; from the safetensors
    headers, no weights read). Training itself keeps float32 master weights either way."""
    if config.save_dtype != "source":
        dtype = getattr(torch, config.save_dtype)
        return dtype, f"final model: saved in {config.save_dtype} (save_dtype)"
    by_dtype: dict[torch.dtype, int] = {}
    for info in open_checkpoint(folders.model).tensors:
        if info.dtype.is_floating_point:
            by_dtype[info.dtype] = by_dtype.get(info.dtype, 0) + info.nbytes
    dtype = max(by_dtype, key=by_dtype.get) if by_dtype else torch.float32
    return dtype, (f"final model: saved in {str(dtype).removeprefix('torch.')}, the source's dtype "
                   "(save_dtype: source; set float32/bfloat16/float16 to choose)")


@dataclass
class RunPlan:
    """How the token budget becomes optimizer steps."""

    total_tokens: int
    steps: int
    sequences_per_step: int  # global: micro_batch x grad_accum x processes
    tokens_per_step: int  # sequences_per_step x seq_len

    def describe(self, config: TrainConfig, world: int, n_params: int, n_train: int | None, n_val: int) -> str:
        """Human-readable plan printed at the start of a run."""
        b = config.batch
        return (
            f"plan: {self.steps} steps x {self.tokens_per_step:,} tokens = {self.steps * self.tokens_per_step:,} "
            f"tokens (budget {self.total_tokens:,}); {self.sequences_per_step} sequences/step = "
            f"micro_batch {b.micro_batch} x grad_accum {b.grad_accum} x {world} processes, seq_len "
            f"{config.data.seq_len}; model {n_params:,} params; data {'streaming' if n_train is None else n_train} "
            f"train blocks, {n_val} val blocks\n{cpu_threads_line(config.threads)}\n{paths_line(config)}"
        )


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


def plan_run(config: TrainConfig, world: int) -> RunPlan:
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
    return RunPlan(total, steps, sequences, per_step)


class RunData(NamedTuple):
    """What `build_data` makes for a run."""

    train: datasets.Dataset | StreamSchedule  # the train blocks for the whole run, in run order
    val: datasets.Dataset  # validation blocks
    n_available: int | None  # train blocks available (None: a stream)
    fingerprint: str | None  # of the training files' content and the tokenizer (None: a Hub dataset,
    # which the config names): a checkpoint records it, a resume compares it
    held_out: datasets.Dataset | None  # the documents held out of data.train for validation (None: data.val)


def build_data(
    config: TrainConfig, tokenizer, plan: RunPlan, accelerator: Accelerator, skip_blocks: int = 0
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
        train_docs = documents(d.train)
        if d.val is None:  # hold out whole documents of the train source (validated: not streaming)
            train_docs, val_docs = split_documents(train_docs, d.val_fraction, config.seed)
        else:
            val_docs = documents(d.val)
        train = token_blocks(train_docs, tokenizer, d.seq_len, d.num_proc)
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


def wsd_decay_steps(total_steps: int, o: OptimConfig) -> int:
    """Steps of the final linear decay of the `wsd` schedule (at least 1)."""
    return max(1, round(o.decay_fraction * total_steps))
