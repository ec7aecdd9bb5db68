"""Sizes, dtypes and the KV-cache formula: one of each, shared by convert, train and measure."""

from __future__ import annotations

import re
from typing import Any

from uptrain.errors import UsageError

# Output / load dtypes a user can name on a command line. `DTYPES` maps them to torch dtypes and
# is built on first use (PEP 562), so a CLI can parse its arguments before torch is imported.
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def __getattr__(name: str) -> Any:
    if name == "DTYPES":
        import torch

        return {n: getattr(torch, n) for n in DTYPE_NAMES}
    raise AttributeError(f"module 'uptrain.units' has no attribute {name!r}")

# A source whose loss on a text is >= NEAR_CHANCE x ln(vocab) (uniform guessing) barely models it: said
# by the eval for scoring text (`measure/fidelity.fidelity_warnings`) and by the converter for
# calibration text (`convert/layers/calibrate.near_chance_warning`)
NEAR_CHANCE = 0.9

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524_288_000, '1000' -> 1000 (bytes; decimal and binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise UsageError(f"cannot read size {text!r}; write it like 5GB, 500MB or 2GiB")
    value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if value < 1:
        raise UsageError(f"size {text!r} must be positive")
    return value


def kv_cache_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_element: float) -> float:
    """KV-cache bytes one token costs: 2 (K and V) x layers x kv_heads x head_dim x bytes (an int for
    whole-byte dtypes; bytes_per_element may be fractional, as llama.cpp's q8_0 cache: 34 bytes per 32)."""
    return 2 * layers * kv_heads * head_dim * bytes_per_element


def human_seconds(s: float) -> str:
    """12.3 -> '12.3 s', 750 -> '12.5 min', 360000 -> '100 h'."""
    if s < 60:
        return f"{s:.3g} s"
    return f"{s / 60:.3g} min" if s < 3600 else f"{s / 3600:,.3g} h" if s < 360000 else f"{s / 3600:,.0f} h"
