"""Which parameters an uptraining run trains (config field `trainable`); the rest are frozen.

    all        every parameter (the default)
    attention  every parameter inside each layer's attention module: the q/k/v/o projections
               (separate or fused), their biases, and the norms that live in the attention
               module (q/k norms: Qwen3, Gemma3, OLMo2, Cohere, StableLM's per-head k norms)
    kv         the K/V projections and what a function-preserving conversion compensates: the
               q, k, v and output projections (weights and biases), no norms. Fused families
               (Phi-3 qkv_proj, Falcon query_key_value, GPTBigCode c_attn) train the fused matrix.

The names are the model family's, from the converter's registry (`Family.modules` in
uptrain/convert/registry/architectures.py): the attention module (self_attn, self_attention, attn) and its
projections. Frozen parameters get requires_grad=False, so the optimizer (which takes only
parameters that need gradients) never sees them.
"""

from __future__ import annotations

import re

import torch

from uptrain.convert.registry.architectures import Attention, attention_for
from uptrain.errors import UsageError

TRAINABLE = ("all", "attention", "kv")


def check_trainable(value: str) -> None:
    """UsageError unless `value` names a set of parameters."""
    if value not in TRAINABLE:
        raise UsageError(f"unknown trainable {value!r}; use one of {', '.join(TRAINABLE)}")


def trainable_pattern(value: str, attention: Attention | None) -> re.Pattern[str] | None:
    """What `trainable=value` trains, as a regex searched in parameter names; None: everything.

    attention: the model family's names (`attention_for(model_type)`); needed unless value is "all".
    """
    if value == "all":
        return None
    if attention is None:
        raise UsageError(f"trainable={value} selects parameters by the converter registry's names, which do not "
                         f"cover this model; use trainable=all")
    return re.compile(attention.parameters_pattern() if value == "attention" else attention.projections_pattern())


def model_attention(model: torch.nn.Module) -> Attention | None:
    """The registry's attention names for `model` (its text config's model type), None if unknown."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return attention_for(getattr(text, "model_type", "") or getattr(config, "model_type", ""))


def is_trainable(name: str, value: str, attention: Attention | None) -> bool:
    """Whether parameter `name` is trained under `trainable=value` in a model named like `attention`."""
    pattern = trainable_pattern(value, attention)
    return pattern is None or bool(pattern.search(name))


def param_shape(param: torch.nn.Parameter) -> torch.Size:
    """The full shape of `param`: under DeepSpeed ZeRO-3 (zero.Init) a rank holds an empty 1-d
    partition and the real shape is its ds_shape."""
    return getattr(param, "ds_shape", param.shape)


def param_numel(param: torch.nn.Parameter) -> int:
    """Elements of `param`, counted in full under ZeRO-3 too (see `param_shape`)."""
    return param_shape(param).numel()


def apply_trainable(model: torch.nn.Module, value: str, *others: str) -> tuple[int, int]:
    """Freeze what neither `value` nor any of `others` trains; return (trainable, total) parameter counts."""
    trained = total = 0
    patterns = [trainable_pattern(v, model_attention(model) if v != "all" else None) for v in (value, *others)]
    for name, param in model.named_parameters():
        keep = any(p is None or bool(p.search(name)) for p in patterns)
        param.requires_grad_(keep)
        total += param_numel(param)
        trained += param_numel(param) if keep else 0
    if trained == 0:
        raise UsageError(f"trainable={value} matches no parameter of this model; use trainable=all")
    return trained, total


def trainable_line(value: str, trained: int, total: int) -> str:
    """The plan's line: `trainable: kv (N of M parameters)`."""
    return f"trainable: {value} ({trained:,} of {total:,} parameters)"


def trainable_at(ranges: list[tuple[int, int, str]], step: int) -> str:
    """What trains at 0-based optimizer step `step`."""
    return next(value for first, end, value in ranges if first <= step < end)


def set_trainable(model: torch.nn.Module, value: str) -> None:
    """Let only `value`'s parameters get gradients (a stage switch; the optimizer keeps every
    parameter any stage trains and skips those without a gradient: no update, no weight decay)."""
    pattern = trainable_pattern(value, model_attention(model) if value != "all" else None)
    for name, param in model.named_parameters():
        param.requires_grad_(pattern is None or bool(pattern.search(name)))


def stages_line(ranges: list[tuple[int, int, str]]) -> str:
    """The plan's line for a staged run (1-based steps)."""
    return "trainable stages: " + ", then ".join(f"{v} for steps {a + 1}-{b}" for a, b, v in ranges)
