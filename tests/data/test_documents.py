"""The one reader of text: the same file gives the same documents to the trainer, eval and calibration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from uptrain.convert.layers.calibrate import read_calibration_texts
from uptrain.data import DataSource, documents, read_documents

# Whitespace-only lines, indented first lines, runs of blank lines, a last line without newline:
# where a home-made splitter and the trainer's reader part ways.
AWKWARD = "Tom ran.\n \nHe fell.\n\n  Sue sang.\n\n\n\nThe end.\n\t\nBye."


@pytest.mark.parametrize("unit", ["line", "paragraph", "file"])
def test_calibration_reads_the_documents_the_trainer_and_eval_read(tmp_path, unit):
    path = tmp_path / "calib.txt"
    path.write_text(AWKWARD)
    source = DataSource(files=[str(path)], text_unit=unit)
    trainer = [row["text"] for row in documents(source)]
    assert read_documents(source) == trainer
    assert read_calibration_texts(path, unit) == trainer


def test_calibration_reads_jsonl_as_the_trainer_does(tmp_path):
    path = tmp_path / "calib.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["  A story.\n", "Two\n\nparagraphs", " "]))
    trainer = [row["text"] for row in documents(DataSource(files=[str(path)]))]
    assert read_calibration_texts(path) == trainer == ["  A story.\n", "Two\n\nparagraphs"]


def test_calibration_default_text_unit_is_the_trainers(tmp_path):
    import inspect

    from uptrain.convert.__main__ import build_parser

    default = DataSource().text_unit
    assert inspect.signature(read_calibration_texts).parameters["text_unit"].default == default
    args = build_parser().parse_args(["ckpt", "--kv-heads", "2", "--calib", "x.txt"])
    assert args.calib_text_unit == default
    assert build_parser().parse_args(["ckpt", "--kv-heads", "2", "--calib-text-unit", "line"]).calib_text_unit == "line"


def test_data_is_the_bottom_room():
    """Every room reads data here, so uptrain/data imports none of them (and no CLI module)."""
    import re

    from conftest import REPO

    imports = re.compile(r"^\s*(?:from|import)\s+uptrain\.(?:convert|train|measure|demo|eval)\b", re.M)
    for path in (REPO / "uptrain" / "data").glob("*.py"):
        assert not imports.search(path.read_text()), path.name


def test_calibration_reads_through_the_shared_reader_with_its_flag_named(tmp_path):
    from uptrain.errors import UsageError

    path = tmp_path / "calib.txt"
    path.write_bytes("Tom ran.\n\nThe café.\n".encode("latin-1"))
    with pytest.raises(UsageError, match=r"^--calib: data file .*calib.txt is not UTF-8 text"):
        read_calibration_texts(path)
