"""configs/template.yaml: every key a user must set is marked, and the template trains once they are set."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from conftest import REPO, TRAIN_TXT, VALID_TXT, built_gqa4
from uptrain.train import train
from uptrain.train.config import load_config

TEMPLATE = REPO / "configs" / "template.yaml"


def test_template_marks_the_keys_to_set_and_its_header_gives_the_commands():
    text = TEMPLATE.read_text()
    marked = re.findall(r"^\s*([a-z_]+):.*# SET", text, flags=re.M)
    assert marked == ["model", "run_dir", "files", "files", "seq_len", "fraction", "micro_batch", "lr", "teacher"]
    header = "\n".join(text.splitlines()[:9])
    for command in ("cp configs/template.yaml configs/my-run.yaml", "python -m uptrain.convert", "--refine",
                    "scripts/lr_sweep.py configs/my-run.yaml", "python -m uptrain.train configs/my-run.yaml",
                    "python -m uptrain.eval MY_MODEL runs/my-model-gqa4 runs/my-model-uptrain/model"):
        assert command in header, command
    assert "relative to this file's folder" in text and "relative to the folder you run from" in text


def test_template_copied_as_its_header_says_trains_your_model_on_your_text(tmp_path: Path, monkeypatch):
    # A repository root: configs/my-run.yaml (the copy), runs/my-model-gqa4 (converted), my-text.txt
    (tmp_path / "configs").mkdir()
    shutil.copy(TEMPLATE, tmp_path / "configs" / "my-run.yaml")
    shutil.copytree(built_gqa4(), tmp_path / "runs" / "my-model-gqa4")
    shutil.copy(TRAIN_TXT, tmp_path / "my-text.txt")
    shutil.copy(VALID_TXT, tmp_path / "my-held-out.txt")
    monkeypatch.chdir(tmp_path / "configs")  # anywhere: the file's paths do not depend on it
    config = load_config(tmp_path / "configs" / "my-run.yaml",
                         ["budget.fraction=null", "budget.tokens=1024", "data.seq_len=128", "batch.micro_batch=4",
                          "batch.grad_accum=1", "eval.max_batches=2", "log.progress_bar=false", "threads=1"])
    assert config.model == str(tmp_path / "runs" / "my-model-gqa4")
    assert config.data.train.files == [str(tmp_path / "my-text.txt")]
    assert config.run_dir == str(tmp_path / "runs" / "my-model-uptrain")
    result = train(config)
    assert result["val_loss"] > 0 and (tmp_path / "runs" / "my-model-uptrain" / "model" / "config.json").is_file()
