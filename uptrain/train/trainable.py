"""Which parameters an uptraining run trains (config field `trainable`); the rest are frozen.

    all        every parameter (the default)
    attention  every parameter inside each layer's attention module: the q/k/v/o projections
               (separate or fused), their biases, and the norms that live in the attention
               module (q/k norms: Qwen3, Gemma3, OLMo2, Cohere, StableLM's per-head k norms)
    kv         the K/V projections and what a function-preserving conversion compensates: the
               q, k, v and output projections (weights and biases), no norms. Fused families
               (Phi-3 qkv_proj, Falcon query_key_value, GPTBigCode c_attn) train the fused matrix.

The names are those of the converter's registry (uptrain/convert/architectures.py): every family
it converts keeps attention in a module named self_attn, self_attention, attention or attn, with
the projections named below. Frozen parameters get requires_grad=False, so the optimizer (which
takes only parameters that need gradients) never sees them.
"""

from __future__ import annotations

import re

import torch

from uptrain.convert.architectures import supported_model_types
from uptrain.errors import UsageError

_ATTN = r"(?:^|\.)(?:self_attn|self_attention|attention|attn)\."
# q / k / v / output projections of every registry family: Llama-style q_proj..o_proj, Phi `dense`,
# Phi-3 fused qkv_proj, Falcon query_key_value + dense, GPTBigCode c_attn + c_proj.
_PROJ = r"(?:q_proj|k_proj|v_proj|o_proj|dense|qkv_proj|query_key_value|c_attn|c_proj)\.(?:weight|bias)$"
TRAINABLE = {
    "all": None,
    "attention": re.compile(_ATTN),
    "kv": re.compile(_ATTN + _PROJ),
}


def check_trainable(value: str) -> None:
    """UsageError unless `value` names a set of parameters."""
    if value not in TRAINABLE:
        raise UsageError(f"unknown trainable {value!r}; use one of {', '.join(TRAINABLE)}")


def check_trainable_model(value: str, model_type: str, model: str) -> None:
    """UsageError when `value` restricts training on a model whose names the registry does not know."""
    if value != "all" and model_type not in supported_model_types():
        raise UsageError(f"trainable={value} selects parameters by the converter registry's names, which do not "
                         f"cover model type {model_type!r} of {model}; use trainable=all")


def is_trainable(name: str, value: str) -> bool:
    """Whether parameter `name` is trained under `trainable=value`."""
    pattern = TRAINABLE[value]
    return pattern is None or bool(pattern.search(name))


def apply_trainable(model: torch.nn.Module, value: str) -> tuple[int, int]:
    """Freeze what `value` does not train; return (trainable, total) parameter counts."""
    trained = total = 0
    for name, param in model.named_parameters():
        keep = is_trainable(name, value)
        param.requires_grad_(keep)
        total += param.numel()
        trained += param.numel() if keep else 0
    if trained == 0:
        raise UsageError(f"trainable={value} matches no parameter of this model; use trainable=all")
    return trained, total


def trainable_line(value: str, trained: int, total: int) -> str:
    """The plan's line: `trainable: kv (N of M parameters)`."""
    return f"trainable: {value} ({trained:,} of {total:,} parameters)"
