"""The final model folder of a run: loadable, with the source's card, licence and records."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer

from train_helpers import REPO, fresh_accelerate_state  # noqa: F401 (autouse fixture)
from uptrain.train.report import save_final_model

DEMO_MODEL = REPO / "examples" / "stories260K-mha8"  # ships with the repository


def test_final_model_keeps_licence_card_and_records(tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(DEMO_MODEL, source)
    (source / "NOTICE.txt").write_text("notice\n")
    (source / "uptrain_conversion.json").write_text("{}\n")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    accelerator = Accelerator(cpu=True)
    save_final_model(accelerator, accelerator.prepare(model), AutoTokenizer.from_pretrained(source),
                     tmp_path / "out", source, {"tokens": 123})
    out = tmp_path / "out"
    assert (out / "LICENSE").read_text() == (DEMO_MODEL / "LICENSE").read_text()
    assert (out / "NOTICE.txt").is_file() and (out / "uptrain_conversion.json").is_file()
    assert "| tokens | 123 |" in (out / "README.md").read_text()
    AutoModelForCausalLM.from_pretrained(out)
