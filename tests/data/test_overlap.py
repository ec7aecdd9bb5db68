"""Held-out text that was calibration text is warned about, at eval and at the trainer (issue 60).

The README's four commands calibrate on TRAIN.txt, train on TRAIN.txt (which holds out documents
for validation) and score those documents: a conversion is then scored on text it was fitted to.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import EXAMPLE_MHA8, TRAIN_TXT, VALID_TXT
from train_helpers import tiny_overrides
from uptrain.convert.__main__ import main as convert_main
from uptrain.data import DataSource, read_documents
from uptrain.data.overlap import calibration_overlap_warning, document_digest
from uptrain.measure.eval import main as eval_main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_document_is_known_by_its_text_whatever_its_ends() -> None:
    assert document_digest("Once upon a time.\n") == document_digest("Once upon a time.")
    assert document_digest("Once upon a time.") != document_digest("Once upon a time!")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("overlap") / "kv4-fit"
    assert convert_main([str(EXAMPLE_MHA8), "--kv-heads", "4", "--method", "fit", "--calib", str(TRAIN_TXT),
                         "--calib-tokens", "4096", "--out", str(out)]) == 0
    return out


def test_the_conversion_records_the_documents_it_calibrated_on(calibrated: Path) -> None:
    calibration = json.loads((calibrated / "uptrain_conversion.json").read_text())["calibration"]
    train = read_documents(DataSource(files=[str(TRAIN_TXT)]))
    # documents are read in order until the tokens are used: exactly the first `documents` of them
    assert calibration["document_sha256"] == [document_digest(t) for t in train[: calibration["documents"]]]
    assert 5 < calibration["documents"] < 30


def test_eval_warns_when_scored_documents_were_calibration_text(calibrated: Path, tmp_path: Path, capsys) -> None:
    train = read_documents(DataSource(files=[str(TRAIN_TXT)]))
    valid = read_documents(DataSource(files=[str(VALID_TXT)]))
    mixed = tmp_path / "held_out.jsonl"
    mixed.write_text("".join(json.dumps({"text": t}) + "\n" for t in [train[1], *valid[:3], train[3]]))
    out = tmp_path / "scores.json"
    assert eval_main([str(calibrated), "--data", str(mixed), "--max-length", "128", "--json", str(out)]) == 0
    line = f"warning: 2 of the 5 documents of --data were calibration text of {calibrated}"
    assert line in capsys.readouterr().out
    assert json.loads(out.read_text())[0]["warnings"][0].startswith(line)
    clean = tmp_path / "valid.jsonl"
    clean.write_text("".join(json.dumps({"text": t}) + "\n" for t in valid[:3]))
    assert eval_main([str(calibrated), "--data", str(clean), "--max-length", "128"]) == 0
    assert "calibration text" not in capsys.readouterr().out
    assert calibration_overlap_warning(EXAMPLE_MHA8, train, "x") is None  # no conversion record: nothing to say


def test_the_trainer_warns_when_its_held_out_documents_were_calibration_text(calibrated: Path, tmp_path: Path,
                                                                             capsys) -> None:
    from uptrain.train.__main__ import main as train_main

    run = tmp_path / "run"
    # data.val unset: the trainer holds out half of TRAIN.txt's documents, some of them calibration text
    args = tiny_overrides(run, steps=2, model=calibrated, **{"data.val": "null", "data.val_fraction": 0.5})
    assert train_main(["configs/demo-cpu.yaml", *args]) == 0
    held = [json.loads(line)["text"] for line in (run / "held_out.jsonl").read_text().splitlines()]
    calibrated_docs = set(json.loads((calibrated / "uptrain_conversion.json").read_text())["calibration"]
                          ["document_sha256"])
    shared = sum(document_digest(t) in calibrated_docs for t in held)
    assert shared > 0
    assert (f"warning: {shared:,} of the {len(held):,} documents of the held-out 0.5 of data.train were calibration "
            f"text of {calibrated}") in capsys.readouterr().out
