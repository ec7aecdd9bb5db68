"""`model` and `distill.teacher` as Hub ids, read from a huggingface_hub cache (offline).

The cache is filled by the real huggingface_hub client (`snapshot_download`) from a local HTTP
server that serves the shipped stories260K folders through the Hub's file API (tests/convert/
local_hub.py), so its layout (blobs, snapshots of symlinks, refs) is the client's own. The
trainer then runs in a real process with HF_HUB_OFFLINE=1 against that cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from train_helpers import DEMO, GQA4, MHA8, REPO, need_models, tiny_overrides

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))
from local_hub import LocalHub  # noqa: E402

STUDENT, TEACHER = "uptrain-test/stories-gqa4", "uptrain-test/stories-mha8"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A huggingface_hub cache holding the student and the teacher, as `snapshot_download` wrote it."""
    need_models()
    cache = tmp_path_factory.mktemp("hub-cache")
    with LocalHub({STUDENT: GQA4, TEACHER: MHA8}) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0",
               "HF_HUB_DISABLE_XET": "1"}
        code = f"from huggingface_hub import snapshot_download\nfor r in {[STUDENT, TEACHER]!r}: snapshot_download(r)"
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    assert list(cache.glob("models--uptrain-test--stories-gqa4/snapshots/*/*.safetensors"))
    return cache


def _train(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "uptrain.train", str(DEMO), *args], cwd=REPO, env=env,
                          capture_output=True, text=True)


def test_hub_ids_for_model_and_teacher_train_offline_from_the_cache(hub_cache, tmp_path):
    run_dir = tmp_path / "run"
    proc = _train(tiny_overrides(run_dir, steps=1, **{"optim.warmup_steps": 0, "model": STUDENT, "distill.teacher": TEACHER,
                                                      "eval.at_start": "false", "eval.max_batches": 1}), hub_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = run_dir / "model"
    with safe_open(model / "model.safetensors", "pt") as f:
        assert "model.layers.0.self_attn.k_proj.weight" in f.keys()
    assert (model / "tokenizer.json").read_bytes() == (GQA4 / "tokenizer.json").read_bytes()
    assert (model / "LICENSE").is_file()  # carried from the cached snapshot like from a folder
    card = (model / "README.md").read_text()
    assert STUDENT in card and TEACHER in card  # the record names the Hub ids, not cache paths


def test_hub_id_not_in_the_cache_offline_is_one_line_exit_2(hub_cache, tmp_path):
    for extra in ({"model": "uptrain-test/missing"}, {"distill.teacher": "uptrain-test/missing-teacher"}):
        run_dir = tmp_path / "missing"
        proc = _train(tiny_overrides(run_dir, steps=1, **{"optim.warmup_steps": 0, **extra}), hub_cache)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
        assert "not in the local Hub cache (offline: HF_HUB_OFFLINE=1)" in proc.stderr and "missing" in proc.stderr
        assert not run_dir.exists()
