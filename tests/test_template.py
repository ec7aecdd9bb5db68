"""configs/template.yaml: every key a user must set is marked, the template refuses to start while its
budget is not set, and it trains once they are set."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from conftest import REPO, TRAIN_TXT, VALID_TXT, built_gqa4
from uptrain.errors import UsageError
from uptrain.train import train
from uptrain.train.__main__ import main
from uptrain.train.config import load_config

TEMPLATE = REPO / "configs" / "template.yaml"


def test_template_marks_the_keys_to_set_and_its_header_gives_the_commands():
    text = TEMPLATE.read_text()
    marked = re.findall(r"^\s*([a-z_]+):.*# SET", text, flags=re.M)
    assert marked == ["model", "run_dir", "files", "files", "seq_len", "pretrain_tokens", "micro_batch", "lr", "teacher"]
    header = "\n".join(text.splitlines()[:9])
    for command in ("cp configs/template.yaml configs/my-run.yaml", "python -m uptrain.convert", "--refine",
                    "scripts/lr_sweep.py configs/my-run.yaml", "python -m uptrain.train configs/my-run.yaml",
                    "python -m uptrain.eval MY_MODEL runs/my-model-gqa4 runs/my-model-uptrain/model"):
        assert command in header, command
    assert "relative to this file's folder" in text and "relative to the folder you run from" in text


def _copied_as_its_header_says(root: Path) -> Path:
    """A repository root: configs/my-run.yaml (the copy), runs/my-model-gqa4 (converted), my-text.txt."""
    (root / "configs").mkdir()
    shutil.copy(TEMPLATE, root / "configs" / "my-run.yaml")
    shutil.copytree(built_gqa4(), root / "runs" / "my-model-gqa4")
    shutil.copy(TRAIN_TXT, root / "my-text.txt")
    shutil.copy(VALID_TXT, root / "my-held-out.txt")
    return root / "configs" / "my-run.yaml"


def test_template_with_its_budget_not_set_refuses_to_start_in_one_line(tmp_path: Path, capsys):
    # Every other key of the copy is usable: only the budget is missing, and it must never fall back
    # on some default (a large model's pre-training tokens would be a months-long run).
    config = _copied_as_its_header_says(tmp_path)
    with pytest.raises(UsageError, match="budget.pretrain_tokens is not set"):  # (else main below would train)
        load_config(config)
    assert main([str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: budget.pretrain_tokens is not set: the budget is budget.fraction (0.05) of the tokens the "
                   "model was pre-trained on (its model card); set budget.pretrain_tokens=N, or budget.tokens=N with "
                   "budget.fraction=null"], err
    assert not (tmp_path / "runs" / "my-model-uptrain").exists()
    # the two ways it names both load (and a budget the run would plan from)
    assert load_config(config, ["budget.pretrain_tokens=2e6"]).budget.total_tokens() == 100_000
    assert load_config(config, ["budget.tokens=4096", "budget.fraction=null"]).budget.total_tokens() == 4096


def test_template_copied_as_its_header_says_trains_your_model_on_your_text(tmp_path: Path, monkeypatch):
    _copied_as_its_header_says(tmp_path)
    monkeypatch.chdir(tmp_path / "configs")  # anywhere: the file's paths do not depend on it
    config = load_config(tmp_path / "configs" / "my-run.yaml",
                         ["budget.fraction=null", "budget.tokens=1024", "data.seq_len=128", "batch.micro_batch=4",
                          "batch.grad_accum=1", "eval.max_batches=2", "log.progress_bar=false", "threads=1"])
    assert config.model == str(tmp_path / "runs" / "my-model-gqa4")
    assert config.data.train.files == [str(tmp_path / "my-text.txt")]
    assert config.run_dir == str(tmp_path / "runs" / "my-model-uptrain")
    result = train(config)
    assert result["val_loss"] > 0 and (tmp_path / "runs" / "my-model-uptrain" / "model" / "config.json").is_file()
