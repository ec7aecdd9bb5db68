"""Reading attention sizes from a config.json and writing the target config.json.

The raw config.json dict is what gets written (unchanged but for the K/V head count), so that
fields transformers migrates on load (rope settings, aliases) are migrated the same way for the
converted checkpoint as for the source. transformers' own config class is used to *read* values,
so class defaults and attribute aliases (Falcon's n_head_kv, GPTBigCode's n_head) are honoured.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from uptrain.convert.registry.architectures import Family, family_for
from uptrain.errors import UsageError


@dataclass(frozen=True)
class AttentionDims:
    """The attention shape of a model: query heads, K/V heads, head_dim, layers."""

    heads: int
    kv_heads: int
    head_dim: int
    layers: int


def load_hf_config(raw: dict[str, Any]) -> PretrainedConfig:
    """The transformers config object of a raw config.json dict (no remote code)."""
    # a deep copy: transformers migrates nested fields (rope_scaling) in place
    rest = copy.deepcopy({k: v for k, v in raw.items() if k != "model_type"})
    try:
        return AutoConfig.for_model(raw["model_type"], **rest)
    except (ValueError, TypeError, KeyError) as err:
        raise UsageError(f"transformers cannot read this config.json as {raw.get('model_type')!r}: "
                         f"{str(err).splitlines()[0]}") from err


def attention_dims(cfg: PretrainedConfig, family: Family | None) -> AttentionDims:
    """Query heads, K/V heads, head_dim and layer count as the model class will use them.

    family None: a model type outside the registry, read through the usual
    `num_key_value_heads` field (absent: MHA).
    """
    heads = int(cfg.num_attention_heads)
    kv_field = family.kv_field if family is not None else "num_key_value_heads"
    if kv_field:
        kv = getattr(cfg, kv_field, None) or heads
    else:  # classes with only a multi_query switch: MHA or MQA
        kv = 1 if getattr(cfg, "multi_query", False) else heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return AttentionDims(heads=heads, kv_heads=int(kv), head_dim=int(head_dim),
                         layers=int(cfg.num_hidden_layers))



def source_family(raw: dict[str, Any]) -> Family:
    """The registry entry for a raw config.json, read with transformers' class defaults (the
    registry's `when` switches may be defaults); UsageError (one line) for types we cannot convert."""
    return family_for(load_hf_config(raw).to_dict() | raw)

def model_shape(config: PretrainedConfig | dict[str, Any]) -> AttentionDims:
    """The one reader of a model's attention shape for convert, train and measure.

    Takes a loaded transformers config (its text config for multimodal wrappers) or a raw
    config.json dict; the K/V head field comes from the architecture registry (Falcon's
    `num_kv_heads`, GPTBigCode's `multi_query`, ...).
    """
    if isinstance(config, dict):
        cfg = load_hf_config(config)
    else:
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        family: Family | None = family_for(cfg.to_dict())
    except UsageError:  # not convertible, but still a model whose shape we can report
        family = None
    return attention_dims(cfg, family)


def stored_kv_bytes_per_token(model_dir) -> int:
    """KV-cache bytes per token of a model folder in its stored dtype (float32 when it names none),
    from its config alone: 2 x layers x K/V heads x head_dim x the dtype's bytes."""
    from uptrain.units import DTYPES, kv_cache_bytes_per_token

    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    shape = model_shape(config)
    stored = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    itemsize = DTYPES.get(stored.removeprefix("torch."), DTYPES["float32"]).itemsize
    return kv_cache_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, itemsize)


def _raw_key(cfg: PretrainedConfig, raw: dict[str, Any], field: str) -> str:
    """The key config.json uses for `field`: the field itself or its legacy alias."""
    alias = getattr(type(cfg), "attribute_map", {}).get(field)
    return alias if alias and alias in raw and field not in raw else field


def target_config(raw: dict[str, Any], cfg: PretrainedConfig, family: Family, new_kv: int,
                  dtype: torch.dtype | None) -> dict[str, Any]:
    """config.json of the converted model: the source's, with the new K/V head count (and dtype)."""
    out = dict(raw)
    old = attention_dims(cfg, family)
    if new_kv != old.kv_heads:
        if family.kv_field:
            out[_raw_key(cfg, raw, family.kv_field)] = new_kv
        out.update(dict(family.target_config))
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        for key in ("dtype", "torch_dtype"):
            if key in out or key == "dtype":
                out[key] = name
    check = attention_dims(load_hf_config(out), family)
    if check.kv_heads != new_kv or check.heads != old.heads:
        raise RuntimeError(f"patched config reads back {check}, expected {new_kv} K/V heads")
    return out
