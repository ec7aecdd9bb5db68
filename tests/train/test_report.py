"""The final model folder of a run: loadable, with the source's card, licence and records."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

from train_helpers import REPO, fresh_accelerate_state  # noqa: F401 (autouse fixture)
from uptrain.train.report.report import save_final_model

DEMO_MODEL = REPO / "examples" / "stories260K-mha8"  # ships with the repository


def test_final_model_keeps_licence_card_and_records(tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(DEMO_MODEL, source)
    (source / "NOTICE.txt").write_text("notice\n")
    (source / "uptrain_conversion.json").write_text("{}\n")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    accelerator = Accelerator(cpu=True)
    save_final_model(accelerator, accelerator.prepare(model), tmp_path / "out", source, {"tokens": 123})
    out = tmp_path / "out"
    assert (out / "LICENSE").read_text() == (DEMO_MODEL / "LICENSE").read_text()
    # llama.cpp's converter reads the SentencePiece model: the final folder keeps it byte for byte
    assert (out / "tokenizer.model").read_bytes() == (DEMO_MODEL / "tokenizer.model").read_bytes()
    assert (out / "NOTICE.txt").is_file() and (out / "uptrain_conversion.json").is_file()
    assert "| tokens | 123 |" in (out / "README.md").read_text()
    AutoModelForCausalLM.from_pretrained(out)


def test_final_model_takes_a_separate_tokenizer_folder_byte_for_byte(tmp_path: Path) -> None:
    source, tok = tmp_path / "source", tmp_path / "tokenizer"
    shutil.copytree(DEMO_MODEL, source)
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tok / name).write_bytes((DEMO_MODEL / name).read_bytes() + b"\n")  # other bytes, same tokenizer
    (source / "special_tokens_map.json").write_text("{}\n")  # the source's own: replaced, not mixed in
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    accelerator = Accelerator(cpu=True)
    out = tmp_path / "out"
    save_final_model(accelerator, accelerator.prepare(model), out, source, {}, dtype=torch.float16, tokenizer_dir=tok)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tok / name).read_bytes()
    assert not (out / "special_tokens_map.json").exists()
    assert (out / "generation_config.json").read_bytes() == (source / "generation_config.json").read_bytes()
    assert AutoModelForCausalLM.from_pretrained(out).config.dtype == torch.float16
    assert str(model.config.dtype).removeprefix("torch.") == "float32"  # the live model's config: as save_pretrained left it
