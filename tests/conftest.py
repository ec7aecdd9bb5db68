"""Shared fixtures: where ../shared is, and tiny real transformers checkpoints built on the fly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the test machine has no Hub; nothing may try it
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MODELS = SHARED / "data" / "models"
CONFIGS = SHARED / "data" / "configs"
CORPORA = SHARED / "data" / "corpora"


def need_shared(path: Path) -> Path:
    """Skip the calling test (with the reason) when a file from ../shared is absent."""
    if not path.exists():
        pytest.skip(f"needs {path} (../shared is absent on this machine)")
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """One CPU thread: tiny models gain nothing from more, and lose a lot on a busy machine."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def mha8() -> Path:
    return need_shared(MODELS / "stories260K-mha8")


@pytest.fixture
def gqa4() -> Path:
    return need_shared(MODELS / "stories260K-gqa4")
