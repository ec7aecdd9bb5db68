"""What the plan reads from disk: the run folder's state and the model folders' facts.

The run folder (first half): may the folder be used, which checkpoint a resume continues, is that
checkpoint part of this run (its identity), and on another process count the grad_accum that keeps
its global batch. The models (second half): their facts read once from convert's readers (where
the checkpoints are, the student's shape and family, its positions and vocabulary, the dtype of
the final model) and the checks made on them before any weights load. Each refusal is one
UsageError line. (`checked.py` holds the checks that need only the config and the launch.)

What makes a checkpoint part of a run is defined once, here: the run identity.

A resume must continue the same run: the same model, data, data order, optimisation trajectory and
state layout. Those are the identity:

  - the config sections in SECTIONS, as written (run.yaml keeps them for the run folder);
  - minus ELASTIC: fields a resume may change on purpose (grad_accum, which an elastic resume on
    another process count adapts; the global batch is checked instead, by `elastic_grad_accum`);
  - the effective mixed precision (the config's or the launcher's: `accelerator.mixed_precision`);
  - the training data's fingerprint (the token blocks' content key: the documents, the tokenizer,
    seq_len), so a data file changed under the same path is seen.

Every checkpoint records its identity (`checkpoint_identity`, in trainer_state.json) and the run
folder it belongs to; `identity_changes` names what differs. The process count is recorded too but
is not part of the identity: an elastic resume keeps the global batch (`elastic_grad_accum`, below).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from uptrain.convert.io.output_dir import check_writable
from uptrain.convert.io.hfconfig import model_shape
from uptrain.convert.io.source import open_checkpoint, resolve_source
from uptrain.convert.registry.architectures import supported_model_types
from uptrain.errors import UsageError
from uptrain.train.config import TrainConfig, field_defaults, to_dict
from uptrain.train.state.run_files import (  # noqa: F401 (RUN_OUTPUTS, checkpoint_state: public here too)
    FINISHED_FILE, RUN_FILE, RUN_OUTPUTS, STATE_FILE, checkpoint_state, complete_checkpoints,
)


# Config sections that decide the data, the data order, the trajectory and the checkpoint layout.
SECTIONS = ("model", "tokenizer", "seed", "data", "budget", "batch", "optim", "distill", "trainable",
            "trainable_stages", "shard", "mixed_precision")
# Fields inside SECTIONS that a resume may change: section -> field names.
ELASTIC = {"batch": ("grad_accum",)}
# What each section is called in a refusal, with what to do about it.
_HINTS = {"shard": "a sharded (shard=fsdp2) checkpoint holds per-rank shards, an unsharded one whole tensors",
          "mixed_precision": "the master weights' trajectory depends on it",
          "data_fingerprint": "the training text or the tokenizer changed since the checkpoint was written"}


def config_identity(config_dict: dict) -> dict:
    """The identity sections of a config (as `to_dict` gives it), elastic fields left out."""
    out = {}
    for key in SECTIONS:
        value = copy.deepcopy(config_dict.get(key))
        if isinstance(value, dict):
            for field in ELASTIC.get(key, ()):
                value.pop(field, None)
        out[key] = value
    return out


def run_identity(config_dict: dict, mixed_precision: str, data_fingerprint: str | None) -> dict:
    """The identity of a run: its config sections, the effective mixed precision, the data's fingerprint."""
    identity = config_identity(config_dict)
    identity["mixed_precision"] = mixed_precision  # the launcher's when the config leaves it unset (None)
    identity["data_fingerprint"] = data_fingerprint
    return identity


def _with_defaults(recorded, default):
    """`recorded` with the fields it lacks taken from `default`, at every depth (dicts only)."""
    if not (isinstance(recorded, dict) and isinstance(default, dict)):
        return recorded
    filled = {name: _with_defaults(value, default.get(name)) for name, value in recorded.items()}
    return {**{name: value for name, value in default.items() if name not in filled}, **filled}


def _filled(recorded: dict) -> dict:
    """A recorded identity with the fields added since it was written at their defaults."""
    defaults = config_identity(field_defaults())
    return {key: _with_defaults(value, defaults.get(key)) for key, value in recorded.items()}


def identity_changes(recorded: dict, now: dict) -> list[str]:
    """Dotted names of the identity fields that differ between two identities (sorted by section).

    A section absent from `recorded` (a checkpoint of an older version that did not record it) is not
    compared. A field absent inside a recorded section was added to the config after that run started:
    it is compared as its default, the behaviour the older version had (new fields default to it), so
    an upgrade between two launches of one run does not refuse its resume."""
    recorded = _filled(recorded)
    changed = []
    for key in (*SECTIONS, "data_fingerprint"):
        if key not in recorded:
            continue
        a, b = recorded.get(key), now.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            changed += [f"{key}.{name}" for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
        else:
            changed.append(key)
    return changed


def describe_changes(changed: list[str], recorded: dict, now: dict) -> str:
    """'seed (checkpoint 0, now 5), optim.lr (checkpoint 0.002, now 0.005)': what a refusal names."""
    def value(identity: dict, dotted: str):
        section, _, field = dotted.partition(".")
        got = identity.get(section)
        return got.get(field) if field and isinstance(got, dict) else got

    recorded, parts = _filled(recorded), []
    for name in changed:
        hint = _HINTS.get(name.split(".")[0])
        shown = "" if name == "data_fingerprint" else f"checkpoint {value(recorded, name)!r}, now {value(now, name)!r}"
        parts.append(f"{name} ({'; '.join(p for p in (shown, hint) if p)})")
    return ", ".join(parts)


def check_run_dir(run_dir: Path, config_dict: dict, resume: str | None, overwrite: bool) -> Path | None:
    """Check that `run_dir` may be used; return the checkpoint to resume from (or None).

    Raises UsageError when the folder holds another run's state (unless `overwrite`), or when
    `resume` names nothing usable.
    """
    check_writable(run_dir, "run_dir")
    run_file = run_dir / RUN_FILE
    has_state = any((run_dir / name).exists() for name in RUN_OUTPUTS)
    if resume and overwrite:
        raise UsageError("resume and overwrite=true contradict each other; choose one")
    if resume is None:
        if has_state and not overwrite:
            raise UsageError(
                f"run folder {run_dir} already holds a run; set resume=latest to continue it, "
                "overwrite=true to replace it, or choose another run_dir"
            )
        return None
    if run_file.is_file():
        stored = yaml.safe_load(run_file.read_text()) or {}
        recorded, now = config_identity(stored), config_identity(config_dict)
        changed = identity_changes(recorded, now)
        if changed:
            raise UsageError(
                f"run folder {run_dir} holds another run's state (differs in: {describe_changes(changed, recorded, now)}); "
                "resume with the config it was started with, or use another run_dir (or overwrite=true without resume)"
            )
    finished = run_dir / FINISHED_FILE
    if finished.is_file():
        # Resuming would redo the steps after the last checkpoint and overwrite model/.
        record = json.loads(finished.read_text())
        raise UsageError(
            f"run {run_dir} is finished ({record.get('steps')} steps, {record.get('tokens'):,} tokens, "
            f"val loss {record.get('val_loss', float('nan')):.4f}); to train further start a new run from it: "
            f"model={run_dir / 'model'} run_dir=NEW_FOLDER"
        )
    if resume == "latest":
        done = complete_checkpoints(run_dir)
        return done[-1] if done else None  # nothing saved yet: start from the beginning
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise UsageError(f"{path} is not a complete checkpoint (no {STATE_FILE})")
    owner = path.resolve().parent.parent
    if owner != run_dir.resolve():
        # Its metrics, run.yaml and later checkpoints live in its own folder: continuing it elsewhere
        # would leave a run without the records of its first steps (or mix two runs in one folder).
        raise UsageError(
            f"checkpoint {path} belongs to the run in {owner}, not to run_dir {run_dir}: continue that run with "
            f"run_dir={owner} resume=latest (and its config), or start a new run without resume"
        )
    return path


def check_checkpoint_identity(path: Path, state: dict, now: dict) -> None:
    """UsageError naming what differs when checkpoint `path` (its trainer state `state`) was written
    by a run of another identity than `now` (`run_identity`, above)."""
    recorded = state.get("identity")
    if not recorded:  # written before checkpoints recorded their run's identity: run.yaml was compared
        return
    changed = identity_changes(recorded, now)
    if changed:
        raise UsageError(
            f"checkpoint {path} was written by a run with other settings: {describe_changes(changed, recorded, now)}; "
            "resume with the settings it was written with, or start a new run (another run_dir, without resume)"
        )


def elastic_grad_accum(path, state: dict, world: int, micro_batch: int, grad_accum: int) -> int:
    """The grad_accum that keeps checkpoint `path`'s global batch on `world` processes.

    The global batch (micro_batch x grad_accum x processes, stored as samples / step) fixes the
    steps, the data each step sees and the LR schedule; `world` processes keep it when it is a
    whole multiple of micro_batch x world. Raises UsageError (one line) naming the process counts
    that do when it is not.
    """
    if not state.get("step"):
        return grad_accum
    global_batch = state["samples"] // state["step"]
    if global_batch % (micro_batch * world) == 0:
        return global_batch // (micro_batch * world)
    written = state.get("processes") or global_batch // (micro_batch * grad_accum)
    per_micro = global_batch // micro_batch if global_batch % micro_batch == 0 else 0
    counts = [m for m in range(1, per_micro + 1) if per_micro % m == 0]
    raise UsageError(
        f"checkpoint {path} was written with a global batch of {global_batch} sequences ({written} processes); "
        f"{world} processes x micro_batch {micro_batch} cannot keep it with a whole grad_accum: "
        f"resume on {', '.join(map(str, counts))} processes (grad_accum is set to keep the global batch)"
    )


def resume_checks(config: TrainConfig, resume_from: Path | None,
                   world: int, mixed_precision: str) -> tuple[TrainConfig, dict, list[str]]:
    """(config, the checkpoint's trainer state or {}, lines for the plan) of a run that may resume.

    The checkpoint's recorded identity is compared with the settings first (before any data is
    read; the data's fingerprint once it is known, in check_data). Elastic resume: on another
    process count, grad_accum keeps the checkpoint's global batch (the returned config has it)."""
    if resume_from is None:
        return config, {}, []
    state = checkpoint_state(resume_from)
    recorded_data = (state.get("identity") or {}).get("data_fingerprint")
    check_checkpoint_identity(resume_from, state, run_identity(to_dict(config), mixed_precision,
                                                               recorded_data))
    accum = elastic_grad_accum(resume_from, state, world, config.batch.micro_batch, config.batch.grad_accum)
    if accum == config.batch.grad_accum:
        return config, state, []
    written = state.get("processes", "?")
    line = (f"checkpoint written by {written} process{'es' * (written != 1)}, resumed on {world}: "
            f"grad_accum {config.batch.grad_accum} -> {accum} keeps the global batch of "
            f"{accum * world * config.batch.micro_batch} sequences")
    return dataclasses.replace(config, batch=dataclasses.replace(config.batch, grad_accum=accum)), state, [line]


# ------------------------------------------------------------------ the models


@dataclass(frozen=True)
class ModelFolders:
    """Local folders of the model to train, its tokenizer and the teacher (None: no distillation)."""

    model: Path
    tokenizer: Path
    teacher: Path | None


@dataclass(frozen=True)
class ModelFacts:
    """What the run knows of its models, read once (config.json and the safetensors headers)."""

    folders: ModelFolders
    family: str  # the student's model_type
    heads: int
    kv_heads: int
    max_positions: int | None  # max_position_embeddings (None: the config has none)
    vocab_size: int
    save_dtype: torch.dtype  # of the final model/
    dtype_line: str  # the plan's line on that dtype


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


def check_models(config: TrainConfig, folders: ModelFolders) -> tuple[ModelFacts, PreTrainedTokenizerBase]:
    """Check student, teacher and tokenizers (in `folders`); return the student's facts and tokenizer."""
    student = _model_config(folders.model, config.model, "model")
    shape = model_shape(student)  # registry field: Falcon num_kv_heads, GPTBigCode multi_query
    if config.expect_kv_heads is not None and shape.kv_heads != config.expect_kv_heads:
        raise UsageError(
            f"model {config.model} has {shape.kv_heads} key/value heads but expect_kv_heads={config.expect_kv_heads}; "
            "convert it first or fix expect_kv_heads"
        )
    positions = getattr(student.get_text_config(), "max_position_embeddings", None)
    if positions and config.data.seq_len > positions:
        raise UsageError(f"data.seq_len={config.data.seq_len} is beyond the {positions} positions of model "
                         f"{config.model} (max_position_embeddings); use data.seq_len<={positions}")
    for value in {config.trainable, *(s.trainable for s in config.trainable_stages)}:
        check_trainable_model(value, student.model_type, config.model)
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
    save_dtype, dtype_line = final_model_dtype(config, folders)
    facts = ModelFacts(folders, student.model_type, shape.heads, shape.kv_heads, positions, student.vocab_size,
                       save_dtype, dtype_line)
    return facts, tokenizer


def check_trainable_model(value: str, model_type: str, model: str) -> None:
    """UsageError when `value` restricts training on a model whose names the registry does not know."""
    if value != "all" and model_type not in supported_model_types():
        raise UsageError(f"trainable={value} selects parameters by the converter registry's names, which do not "
                         f"cover model type {model_type!r} of {model}; use trainable=all")


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
