"""The model's facts, read once from convert's readers into the plan: where the checkpoints are,
the student's shape and family, its positions and vocabulary, the dtype of the final model; and
the checks made on them (one-line UsageErrors), before any weights load."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from uptrain.convert.io.hfconfig import model_shape
from uptrain.convert.io.source import open_checkpoint, resolve_source
from uptrain.convert.registry.architectures import supported_model_types
from uptrain.errors import UsageError
from uptrain.train.config import TrainConfig


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
