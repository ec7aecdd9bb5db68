"""Typed configuration of a training run: dataclasses with defaults, read from YAML, overridable
with `key=value` arguments (dotted for nested fields, e.g. `optim.lr=1e-3`).

Every field is checked: unknown keys, wrong types and impossible values raise `UsageError` with
the dotted name of the field, so a bad config fails before any work starts.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from uptrain.data import DataSource
from uptrain.train.model.trainable import check_trainable
from uptrain.errors import UsageError


@dataclass
class DataConfig:
    """Training text, validation text and how it becomes blocks of `seq_len` tokens."""

    train: DataSource = field(default_factory=DataSource)
    val: DataSource | None = None  # separate validation text (required with a streaming train); else `val_fraction`
    val_fraction: float = 0.05  # held-out share of the train documents (whole ones) when `val` is unset
    seq_len: int = 512  # tokens per packed block (documents joined with EOS)
    repeat_data: bool = False  # loop over the data when the budget needs more (reshuffled per epoch; a
    # stream restarts in order, or reshuffled by seed + epoch with shuffle_buffer)
    shuffle_buffer: int = 0  # streaming train source: seeded buffer shuffle of blocks (0: stream order)
    copy_repeats: float = 0.0  # share of training blocks with a passage read again (uptrain.data.blocks.read_again:
    # copy-aware uptraining for a source whose heads copy across its context; validation blocks never)
    num_proc: int | None = None  # worker processes for tokenization (datasets.map)


@dataclass
class BudgetConfig:
    """How many tokens to train on: `tokens`, or `fraction` x `pretrain_tokens` (paper: 0.05)."""

    tokens: int | None = None
    fraction: float | None = None
    pretrain_tokens: int | None = None

    def total_tokens(self) -> int:
        """The budget in tokens."""
        if self.tokens is not None:
            return int(self.tokens)
        return int(self.fraction * self.pretrain_tokens)  # validated: both set


@dataclass
class BatchConfig:
    """Per-process micro batch (sequences) and gradient-accumulation steps per optimizer step."""

    micro_batch: int = 8
    grad_accum: int = 1


@dataclass
class OptimConfig:
    """AdamW (or plain SGD); linear warm-up, then a decay to `min_lr_ratio` x `lr` by the last step.

    schedule `cosine`: cosine decay over all steps after warm-up. `wsd` (warm-up, stable, decay):
    the peak lr held, then a linear decay over the last `decay_fraction` of the steps.
    """

    name: str = "adamw"  # adamw; sgd: plain SGD without momentum (its update shows gradient scale)
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    schedule: str = "cosine"  # cosine or wsd
    decay_fraction: float = 0.2  # wsd: share of the run's steps spent in the final linear decay
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass
class DistillConfig:
    """Knowledge distillation from a frozen teacher (e.g. the original MHA checkpoint).

    loss = alpha_kd * T^2 * KL(teacher_T || student_T) + (1 - alpha_kd) * LM loss, per target token.
    """

    teacher: str | None = None  # folder or Hub id (org/name) of the teacher; None disables distillation
    alpha_kd: float = 0.5
    temperature: float = 1.0
    # weight of each layer's attention output matched to the teacher's on the same tokens, beside the loss
    # above (uptrain/train/model/attention_match.py: squared distance over the teacher's mean square,
    # per target token, averaged over layers); 0: off. Needs a teacher with the student's layers
    attention_match: float = 0.0
    # the teacher's log-probabilities of each block kept in memory (float16) for the block's next reading, up to
    # this many GB per process (uptrain/train/model/teacher_cache.py); None: a teacher on the CPU in a run that
    # reads its blocks more than once keeps up to a quarter of the memory available at the start; 0: off
    teacher_cache_gb: float | None = None

    def validate(self) -> None:
        """Raise UsageError on a weight out of range, or a matching without a teacher to match."""
        if not (0.0 <= self.alpha_kd <= 1.0 and self.temperature > 0):
            raise UsageError("distill.alpha_kd must be in [0, 1] and distill.temperature > 0")
        if self.teacher_cache_gb is not None and self.teacher_cache_gb < 0:
            raise UsageError("distill.teacher_cache_gb must be >= 0 (0: off; leave it unset for the automatic choice)")
        if self.attention_match < 0 or (self.attention_match and not self.teacher):
            raise UsageError("distill.attention_match must be >= 0 and needs distill.teacher (the outputs it matches)")


@dataclass
class EvalConfig:
    """Validation loss and perplexity at step 0, every `every` steps and at the end."""

    every: int = 100  # 0: only at start and end
    at_start: bool = True  # false: skip the step-0 validation (e.g. the converted model was scored already)
    max_batches: int | None = None  # cap on validation batches in total (all processes)
    batch_size: int | None = None  # defaults to batch.micro_batch
    # the copy probe at each validation (uptrain.measure.copy_probe, on the validation text, seq_len windows):
    # N passages per distance read twice; val_copy_* in metrics.jsonl and the validation line. 0: off
    copy_passages: int = 0


@dataclass
class CheckpointConfig:
    """accelerate save_state every `every` steps into run_dir/checkpoints, keeping the last `keep`."""

    every: int = 500  # 0: no intermediate checkpoints
    keep: int = 2


@dataclass
class LogConfig:
    """Metrics go to run_dir/metrics.jsonl and to accelerate trackers named in `log_with`."""

    every: int = 1  # steps between metric records; losses are read back from the device only then (and
    # before evaluations and checkpoints): on a GPU, more than 1 spares a host sync per step
    log_with: list[str] = field(default_factory=lambda: ["tensorboard"])  # tensorboard, wandb
    project: str = "uptrain"  # tracker project (W&B project / TensorBoard subfolder)
    progress_bar: bool = True


@dataclass
class TrainableStage:
    """One stage of `trainable_stages`: train `trainable` for `tokens` tokens."""

    trainable: str = "all"
    tokens: int = 0


@dataclass
class TrainConfig:
    """One uptraining run of a Hugging Face causal LM."""

    model: str = ""  # folder or Hub id (org/name; offline: from the huggingface_hub cache) of the model to train
    run_dir: str = "runs/run"  # checkpoints, metrics, final model
    tokenizer: str | None = None  # folder or Hub id; defaults to `model`
    save_dtype: str = "source"  # dtype of the final model/: source (the model's stored dtype), float32, bfloat16,
    # float16 (training keeps float32 master weights whatever this is)
    expect_kv_heads: int | None = None  # fail unless the model has this num_key_value_heads
    resume: str | None = None  # "latest" or a checkpoint folder
    overwrite: bool = False  # allow replacing another run's state in run_dir
    seed: int = 0
    mixed_precision: str | None = None  # no, bf16, fp16; None: the launcher's (accelerate config/flag), else no
    gradient_checkpointing: bool = False  # recompute activations in backward (shard=fsdp2: torch's
    # checkpoint_wrapper on each decoder layer, before fully_shard)
    compile: bool = False  # torch.compile the model (shard=fsdp2: each decoder layer, before fully_shard)
    # the training attention (causal packed blocks) of the model and the teacher by hand in bfloat16, for small heads
    # on a CPU (uptrain/train/model/cpu_attention.py: 1.2-2x the tokens/s on the bundled model for a few 1e-4 nats;
    # the demo's default where the CPU multiplies bfloat16); CPU runs only (on a GPU: mixed_precision: bf16)
    bf16_attention: bool = False
    trainable: str = "all"  # all, attention (every attention-module parameter) or kv (q/k/v/o projections);
    # the rest is frozen (see uptrain/train/model/trainable.py)
    trainable_stages: list[TrainableStage] = field(default_factory=list)  # run these first, in order (e.g.
    # [{trainable: kv, tokens: 1e6}]), then `trainable` for the rest of the budget
    shard: str | None = None  # fsdp2: the trainer fully_shards the model itself (one or more processes, also
    # CPU/gloo; mixed_precision bf16: bf16 compute, fp32 gradient reduction and master weights)
    stop_grace_s: float | None = None  # seconds a scheduler leaves between its stop signal and the kill (Slurm's
    # --signal lead time, Kubernetes' terminationGracePeriodSeconds); a preemption checkpoint that would not fit
    # in what is left is not started. None: UPTRAIN_STOP_GRACE_S, else torchrun's shutdown timeout, else unknown
    threads: int | None = None  # torch CPU threads per process; None: chosen from the load (uptrain.threads)
    # 1 is often several times faster when other CPU-bound jobs share the machine.
    data: DataConfig = field(default_factory=DataConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def validate(self) -> None:
        """Raise UsageError on values that cannot work (paths are checked by the trainer)."""
        checks = [
            (bool(self.model), "model: give the folder or Hub id of the model to train"),
            (self.save_dtype in ("source", "float32", "bfloat16", "float16"),
             f"save_dtype must be source, float32, bfloat16 or float16, got {self.save_dtype!r}"),
            (self.mixed_precision in (None, "no", "bf16", "fp16"),
             "mixed_precision must be no, bf16 or fp16 (or null: take the launcher's)"),
            (self.resume in (None, "latest") or Path(self.resume).is_dir(),
             f"resume must be 'latest' or an existing checkpoint folder, got {self.resume!r}"),
            (self.data.seq_len >= 2, "data.seq_len must be at least 2"),
            (0 <= self.data.copy_repeats <= 1, f"data.copy_repeats must be in [0, 1], got {self.data.copy_repeats}"),
            (0.0 <= self.data.val_fraction < 1.0, "data.val_fraction must be in [0, 1)"),
            (self.data.val is not None or self.data.val_fraction > 0,
             "no validation set: give data.val or data.val_fraction > 0"),
            (self.batch.micro_batch >= 1 and self.batch.grad_accum >= 1,
             "batch.micro_batch and batch.grad_accum must be at least 1"),
            (self.optim.lr > 0 and 0 <= self.optim.min_lr_ratio <= 1,
             "optim.lr must be > 0 and optim.min_lr_ratio in [0, 1]"),
            (self.optim.name in ("adamw", "sgd"), f"optim.name must be adamw or sgd, got {self.optim.name!r}"),
            (self.optim.schedule in ("cosine", "wsd"), f"optim.schedule must be cosine or wsd, got {self.optim.schedule!r}"),
            (0.0 < self.optim.decay_fraction <= 1.0, "optim.decay_fraction must be in (0, 1]"),
            (self.optim.warmup_steps >= 0 and self.optim.grad_clip >= 0,
             "optim.warmup_steps and optim.grad_clip must be >= 0"),
            ((self.eval.max_batches is None or self.eval.max_batches >= 1)
             and (self.eval.batch_size is None or self.eval.batch_size >= 1),
             "eval.max_batches and eval.batch_size must be at least 1 (or null): validation must score tokens"),
            (self.eval.every >= 0 and self.checkpoint.every >= 0 and self.checkpoint.keep >= 1,
             "eval.every and checkpoint.every must be >= 0, checkpoint.keep >= 1"),
            (self.eval.copy_passages >= 0, "eval.copy_passages must be >= 0 (0: no copy probe)"),
            (self.log.every >= 1, "log.every must be at least 1"),
            (self.shard in (None, "fsdp2"), f"shard must be fsdp2 or null, got {self.shard!r}"),
            (self.stop_grace_s is None or self.stop_grace_s > 0, "stop_grace_s must be > 0 seconds (or null)"),
            (self.threads is None or self.threads >= 1, "threads must be at least 1 (or null: chosen from the load)"),
            (set(self.log.log_with) <= {"tensorboard", "wandb"},
             f"log.log_with takes tensorboard and/or wandb, got {self.log.log_with}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)
        self.distill.validate()
        check_trainable(self.trainable)
        for i, stage in enumerate(self.trainable_stages):
            check_trainable(stage.trainable)
            if stage.tokens < 1:
                raise UsageError(f"trainable_stages[{i}].tokens must be at least 1")
        b = self.budget
        if (b.tokens is None) == (b.fraction is None):
            raise UsageError("budget: give either budget.tokens or budget.fraction (with budget.pretrain_tokens)")
        if b.fraction is not None and b.pretrain_tokens is None:  # e.g. configs/template.yaml not filled in
            raise UsageError(f"budget.pretrain_tokens is not set: the budget is budget.fraction ({b.fraction:g}) of the "
                             "tokens the model was pre-trained on (its model card); set budget.pretrain_tokens=N, or "
                             "budget.tokens=N with budget.fraction=null")
        if b.fraction is not None and not 0 < b.fraction <= 1:
            raise UsageError("budget.fraction must be in (0, 1]")
        if b.total_tokens() <= 0:
            raise UsageError("budget must be a positive number of tokens")
        staged = sum(stage.tokens for stage in self.trainable_stages)
        if staged > b.total_tokens():
            raise UsageError(f"trainable_stages take {staged:,} tokens, more than the budget of {b.total_tokens():,}")
        self.data.train.validate()
        if self.data.train.teacher_samples is not None and not self.distill.teacher:
            raise UsageError("data.train.teacher_samples needs distill.teacher: the teacher writes the samples "
                             "(and is distilled from on them)")
        if self.data.train.streaming and self.data.val is None:
            raise UsageError("a streaming data.train needs a separate validation source: give data.val")
        if self.data.val is not None and self.data.val.streaming and self.eval.max_batches is None:
            raise UsageError("a streaming data.val needs eval.max_batches (its first max_batches batches are evaluated)")
        if self.data.shuffle_buffer < 0 or (self.data.shuffle_buffer and not self.data.train.streaming):
            raise UsageError("data.shuffle_buffer must be >= 0 and applies only to a streaming data.train")
        if self.data.val is not None:
            if self.data.val.teacher_samples is not None:
                raise UsageError("teacher_samples is for data.train only; give data.val files or a dataset")
            self.data.val.validate()


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Turn a YAML / command-line value into the type `hint` of field `name`."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        return _coerce(value, args[0], name)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise UsageError(f"config field {name!r} must be a mapping, got {value!r}")
        return _build(hint, value, name + ".")
    if origin is list:
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return []  # `files=null` on the command line: no files (not a file named "None")
        items = value if isinstance(value, list) else [value]
        return [_coerce(v, typing.get_args(hint)[0], name) for v in items]
    try:
        if hint is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
                return value.lower() in ("true", "yes")
            if not isinstance(value, bool):
                raise ValueError
            return value
        if hint is int:
            number = float(value) if isinstance(value, str) else value  # YAML reads 1e9 as a string
            if isinstance(number, bool) or float(number) != int(number):
                raise ValueError
            return int(number)
        if hint is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if hint is str:
            if isinstance(value, bool):  # YAML 1.1 reads a bare no / yes as a boolean
                return "yes" if value else "no"
            return str(value)
    except (TypeError, ValueError):
        pass
    raise UsageError(f"config field {name!r} must be {getattr(hint, '__name__', hint)}, got {value!r}")


def _build(cls: type, raw: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from a dict; unknown keys are errors naming the dotted field."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            raise UsageError(f"unknown config field {prefix + str(key)!r}; known fields: {', '.join(sorted(known))}")
    return cls(**{key: _coerce(value, hints[key], prefix + key) for key, value in raw.items()})


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Set `a.b.c=value` overrides (values parsed as YAML) into the nested dict `raw`."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UsageError(f"override {item!r} is not key=value (e.g. optim.lr=1e-3)")
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"override {item!r}: {part!r} is not a section")
        node[leaf] = yaml.safe_load(text) if text else None
    return raw


# Fields holding local paths. In a config FILE, relative paths are relative to that file's
# folder (so a config works from any working directory); on the command line (`key=value`),
# relative to the working directory, as a shell user expects.
_PATH_FIELDS = ("run_dir", "resume", "data.train.files", "data.val.files", "data.train.teacher_samples.prompts")
# Fields that may also name a Hub model: resolved only when written as a path (./, ../) or
# when the path exists beside the config.
_MODEL_FIELDS = ("model", "tokenizer", "distill.teacher")


def _resolve_file_paths(raw: dict, base: Path) -> None:
    """Rewrite the relative local paths of a config file's dict `raw` against `base` (in place)."""
    def resolve(value: Any, model_like: bool) -> Any:
        if not isinstance(value, str) or not value or value == "latest" or Path(value).is_absolute():
            return value
        candidate = base / value
        if model_like and not (value.startswith(("./", "../")) or candidate.exists()):
            return value  # a Hub id (org/name), or a folder relative to the working directory
        return str(candidate.resolve())

    for dotted in (*_PATH_FIELDS, *_MODEL_FIELDS):
        *parents, leaf = dotted.split(".")
        node = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        value = node[leaf]
        model_like = dotted in _MODEL_FIELDS
        node[leaf] = [resolve(v, model_like) for v in value] if isinstance(value, list) else resolve(value, model_like)


def yaml_error_line(err: yaml.YAMLError) -> str:
    """A YAML error in one line with where it is: 'line 7, column 3: expected <block end>, but found
    '<block mapping start>' (while parsing a block mapping that starts at line 5)'."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None)
    if mark is None or problem is None:
        return str(err).splitlines()[0]
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    where = f" ({context} that starts at line {start.line + 1})" if context and start is not None else ""
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}{where}"


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML run config, apply `key=value` overrides, validate, return the TrainConfig.

    Relative paths in the file are taken relative to the file's folder; relative paths in
    `overrides` relative to the working directory.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UsageError(f"{path} is not valid YAML: {yaml_error_line(err)}") from err
    if not isinstance(raw, dict):
        raise UsageError(f"{path} must hold a mapping of config fields")
    _resolve_file_paths(raw, path.resolve().parent)
    config = _build(TrainConfig, apply_overrides(raw, overrides or []))
    config.validate()
    return config


def to_dict(config: TrainConfig) -> dict:
    """The config as plain nested dicts (for YAML dumps, trackers and the model card)."""
    return dataclasses.asdict(config)


def field_defaults(cls: type = TrainConfig) -> dict:
    """Every field's default as nested dicts, a dataclass field (also an optional one, None by
    default) as the defaults of its own fields: what a config written before a field existed meant."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        kinds = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        if dataclasses.is_dataclass(kinds[0]):
            out[f.name] = field_defaults(kinds[0])
        else:
            out[f.name] = f.default_factory() if f.default is dataclasses.MISSING else copy.deepcopy(f.default)
    return out
