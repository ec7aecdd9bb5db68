"""The demo's record of its finished steps (uptrain/demo_record.py): keyed by what made them, never by a path."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from conftest import EXAMPLE_MHA8, TRAIN_TXT
from uptrain.demo.record import DemoRecord, demo_key

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo-cpu.yaml"


def _key(model: Path, **options) -> str:
    args = argparse.Namespace(out=Path("/somewhere"), threads=None, model=str(model), kv_heads=None, **options)
    return demo_key(args, model, [TRAIN_TXT], CONFIG, {})


def test_the_key_follows_content_and_options_not_paths(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(EXAMPLE_MHA8, model)
    key = _key(model, refine_steps=30)
    assert _key(model, refine_steps=31) != key  # another option
    tok = model / "tokenizer.json"
    text = tok.read_text()
    tok.write_text(text.replace('"<s>"', '"<S>"', 1))  # a same-size edit of the tokenizer
    assert len(tok.read_text()) == len(text) and _key(model, refine_steps=30) != key
    tok.write_text(text)
    assert _key(model, refine_steps=30) == key  # the same content again: the same key
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\x00\x00\x00\x01")  # another model at the same path
    assert _key(model, refine_steps=30) != key


def test_a_record_of_another_key_is_emptied_and_of_the_same_key_kept(tmp_path):
    out = tmp_path / "demo"
    first = DemoRecord(out, "a" * 64)
    assert first.prepare() == []
    (out / "stories260K-gqa2").mkdir()
    first.finish("convert")
    assert DemoRecord(out, "a" * 64).prepare() == ["convert"] and (out / "stories260K-gqa2").is_dir()
    assert DemoRecord(out, "b" * 64).prepare() == [] and not (out / "stories260K-gqa2").exists()
