"""Bad data files through the trainer's and eval's CLIs: exit 2 and one line naming the file.

Each case is a real file (or folder) a user could pass by mistake; datasets' own errors for them
are tracebacks dozens of lines long.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from uptrain.measure.eval import main as eval_main
from uptrain.train.__main__ import main as train_main

from conftest import EXAMPLE_MHA8, TRAIN_TXT
from train_helpers import DEMO, fresh_accelerate_state, need_models, tiny_overrides  # noqa: F401 (autouse fixture)


def _empty(tmp: Path) -> Path:
    (tmp / "empty.txt").write_bytes(b"")
    return tmp / "empty.txt"


def _whitespace(tmp: Path) -> Path:
    (tmp / "blank.txt").write_text("  \n\n\t\n \n")
    return tmp / "blank.txt"


def _blank_lines(tmp: Path) -> Path:  # no paragraph at all: datasets' builder finds no split
    (tmp / "blank.txt").write_text("\n\n")
    return tmp / "blank.txt"


def _binary(tmp: Path) -> Path:  # a model's weights renamed .txt
    (tmp / "weights.txt").write_bytes((EXAMPLE_MHA8 / "model.safetensors").read_bytes()[:65536])
    return tmp / "weights.txt"


def _latin1(tmp: Path) -> Path:  # valid text, wrong encoding: é is one byte, 0xe9, not UTF-8
    (tmp / "latin1.txt").write_bytes(TRAIN_TXT.read_bytes()[:3000] + "\n\nThe café was open.\n".encode("latin-1"))
    return tmp / "latin1.txt"


def _jsonl_without_text(tmp: Path) -> Path:
    rows = [{"text": "Tom ran to the park."}, {"story": "Sue sang."}, {"text": "The end."}]
    (tmp / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp / "docs.jsonl"


def _not_jsonl(tmp: Path) -> Path:
    (tmp / "docs.jsonl").write_text('{"text": "Tom ran."}\n{"text": "Sue sang."\n')
    return tmp / "docs.jsonl"


def _directory(tmp: Path) -> Path:
    (tmp / "corpus.txt").mkdir()
    (tmp / "corpus.txt" / "a.txt").write_text("Tom ran.\n")
    return tmp / "corpus.txt"


def _missing(tmp: Path) -> Path:
    return tmp / "missing.txt"


CASES = {"empty": _empty, "whitespace only": _whitespace, "blank lines only": _blank_lines, "binary": _binary, "not UTF-8": _latin1,
         "JSONL line without text": _jsonl_without_text, "not JSON lines": _not_jsonl, "directory": _directory,
         "missing": _missing}


def _one_line(err: str, path: Path) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and str(path) in lines[0] and "; " in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("case", list(CASES))
def test_eval_refuses_bad_data_in_one_line(tmp_path, capsys, case):
    path = CASES[case](tmp_path)
    assert eval_main([str(EXAMPLE_MHA8), "--data", str(path), "--max-length", "64"]) == 2
    _one_line(capsys.readouterr().err, path)


# A stream is checked on its first documents only: a bad record further on stops the run when read.
STREAM_CASES = [c for c in CASES if c != "JSONL line without text"]


@pytest.mark.parametrize("streaming, case", [(False, c) for c in CASES] + [(True, c) for c in STREAM_CASES])
def test_train_refuses_bad_data_in_one_line(tmp_path, capsys, streaming, case):
    need_models()
    path = CASES[case](tmp_path)
    run_dir = tmp_path / "run"
    overrides = {"data.train.files": f"[{path}]", "data.train.streaming": str(streaming).lower()}
    assert train_main([str(DEMO), *tiny_overrides(run_dir, **overrides)]) == 2
    _one_line(capsys.readouterr().err, path)
    assert not run_dir.exists()


def test_a_record_without_the_text_field_names_the_option_of_the_command_that_read_it(tmp_path, capsys):
    """Before: `uptrain.convert --calib docs.jsonl` said "set text_field", an option it does not have."""
    need_models()
    from uptrain.convert.__main__ import main as convert_main

    path = _jsonl_without_text(tmp_path)
    said = {}
    assert eval_main([str(EXAMPLE_MHA8), "--data", str(path), "--max-length", "64"]) == 2
    said["eval"] = _one_line(capsys.readouterr().err, path)
    assert train_main([str(DEMO), *tiny_overrides(tmp_path / "run", **{"data.train.files": f"[{path}]"})]) == 2
    said["train"] = _one_line(capsys.readouterr().err, path)
    assert convert_main([str(EXAMPLE_MHA8), "--kv-heads", "2", "--method", "fit", "--calib", str(path),
                         "--out", str(tmp_path / "out")]) == 2
    said["convert"] = capsys.readouterr().err
    assert "set --text-field to the field" in said["eval"], said
    assert "set data.train.text_field to the field" in said["train"], said
    assert "text_field" not in said["convert"] and "reads the 'text' field only" in said["convert"], said
    assert not (tmp_path / "out").exists()
