"""The bundled model's SentencePiece `tokenizer.model` (what llama.cpp's GGUF converter reads).

It is rebuilt from tokenizer.json by scripts/tools/make_spm_tokenizer.py; it must tokenize as
transformers does, and its presence must not change how transformers tokenizes (tokenizer.json
still decides). The sentencepiece comparison needs the optional `sentencepiece` package.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from conftest import EXAMPLE_MHA8, REPO, TRAIN_TXT, VALID_TXT

spec = importlib.util.spec_from_file_location("make_spm_tokenizer", REPO / "scripts" / "tools" / "make_spm_tokenizer.py")
make_spm = importlib.util.module_from_spec(spec)
sys.modules["make_spm_tokenizer"] = make_spm
spec.loader.exec_module(make_spm)


def test_shipped_model_is_what_the_script_makes_from_tokenizer_json(tmp_path: Path) -> None:
    assert make_spm.main([str(EXAMPLE_MHA8), "-o", str(tmp_path / "tokenizer.model")]) == 0
    assert (tmp_path / "tokenizer.model").read_bytes() == (EXAMPLE_MHA8 / "tokenizer.model").read_bytes()


def test_scores_follow_the_merge_priority() -> None:
    tok = json.loads((EXAMPLE_MHA8 / "tokenizer.json").read_text())
    pieces = make_spm.pieces_from_tokenizer_json(tok)
    score = {p: s for p, s, _ in pieces}
    merges = tok["model"]["merges"]
    # a merge listed earlier makes a piece that SentencePiece prefers (higher score), or the same piece
    for (a1, b1), (a2, b2) in zip(merges, merges[1:]):
        assert score[a1 + b1] >= score[a2 + b2], (a1 + b1, a2 + b2)
    kinds = [k for _, _, k in pieces]
    assert kinds[:3] == [make_spm.UNKNOWN, make_spm.CONTROL, make_spm.CONTROL]
    assert kinds[3:259] == [make_spm.BYTE] * 256 and pieces[3 + 0x0A][0] == "<0x0A>"


def test_sentencepiece_tokenizes_every_line_as_transformers() -> None:
    pytest.importorskip("sentencepiece", reason="the deploy extra's sentencepiece (pip install -e '.[deploy]'; scripts/setup.sh installs it)")
    lines = make_spm.text_lines([TRAIN_TXT, VALID_TXT])
    assert len(lines) > 1000
    assert make_spm.check(EXAMPLE_MHA8, EXAMPLE_MHA8 / "tokenizer.model", lines) == len(lines)


def test_transformers_tokenizes_the_same_with_and_without_it(tmp_path: Path) -> None:
    without = tmp_path / "without"
    shutil.copytree(EXAMPLE_MHA8, without, ignore=shutil.ignore_patterns("tokenizer.model", "*.safetensors"))
    with_, plain = AutoTokenizer.from_pretrained(EXAMPLE_MHA8), AutoTokenizer.from_pretrained(without)
    assert type(with_) is type(plain) and with_.is_fast
    text = VALID_TXT.read_text(encoding="utf-8")
    assert with_(text)["input_ids"] == plain(text)["input_ids"]


def test_a_tokenizer_json_of_another_kind_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    tok = json.loads((EXAMPLE_MHA8 / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "ByteLevel"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    assert make_spm.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "pre_tokenizer" in err and "\n" not in err and not (tmp_path / "tokenizer.model").exists()
