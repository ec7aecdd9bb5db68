"""Loading a model folder for measurement: one loader for eval, tasks, bench and compare.

Its own module so that eval.py and tasks.py (lm-eval) both use it without importing each other.
"""

from __future__ import annotations

from pathlib import Path

import torch

from uptrain.convert.io.source import missing_folder_hint
from uptrain.errors import UsageError
from uptrain.units import DTYPES

LOAD_DTYPES: dict[str, torch.dtype | str] = {"auto": "auto", **DTYPES}


def require_model_folder(path: str | Path) -> None:
    """UsageError (one line, with a near-name hint) unless `path` is a folder holding config.json."""
    if not (Path(path) / "config.json").is_file():
        raise UsageError(f"model folder not found or has no config.json: {path}{missing_folder_hint(path)}")


def load_model(path: str, dtype: str = "auto", device: str = "cpu", with_tokenizer: bool = True):
    """(model in eval mode on `device`, tokenizer or None) from a local folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    require_model_folder(path)
    if dtype not in LOAD_DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; use one of {sorted(LOAD_DTYPES)}")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:
        raise UsageError(f"device {device!r} is not usable here: {str(err).splitlines()[0]}") from None
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=LOAD_DTYPES[dtype]).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path) if with_tokenizer else None
    return model, tokenizer
