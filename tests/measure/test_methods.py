"""The conversion-method bake-off (`python -m uptrain.measure.methods`) on the real stories260K model."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO
from uptrain.measure.methods import compare_methods, main, markdown

MHA8 = REPO / "examples" / "stories260K-mha8"
VALID = REPO / "examples" / "data" / "tinystories-valid-sample.txt"


def test_bake_off_rows_and_table(one_torch_thread):
    texts = [t for t in VALID.read_text().splitlines() if t.strip()][:1]
    source, rows = compare_methods(str(MHA8), [2], texts, 512, 256, variants=(("mean", "mean", False),
                                   ("fit", "fit", False)), groupings=("contiguous",), log=lambda *_: None)
    assert [(r.kv_heads, r.method, r.grouping) for r in rows] == [(2, "mean", "contiguous"), (2, "fit", "contiguous")]
    assert rows[0].gap_closed == 0 and 0 < rows[1].gap_closed <= 1
    assert source < rows[1].loss < rows[0].loss
    table = markdown(source, rows)
    assert "| 2 | fit | contiguous |" in table and "(original)" in table


def test_missing_eval_data_is_one_line(tmp_path: Path, capsys):
    assert main([str(MHA8), "--kv-heads", "2", "--eval-data", str(tmp_path / "nope.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_convert_does_not_import_measure_or_train():
    """The arrow rule: convert/ (fit, grouping, calibration included) uses neither measure nor train."""
    imports = re.compile(r"^\s*(?:from|import)\s+uptrain\.(?:measure|train)\b", re.M)
    for path in (REPO / "uptrain" / "convert").glob("*.py"):
        assert not imports.search(path.read_text()), path.name


def test_calibrated_fit_with_both_groupings_and_two_head_counts(one_torch_thread):
    """fit+calib runs once per (kv heads, grouping): each conversion needs the calibration's moments
    (a Calibration hands each layer's out once; reusing one failed the README's bake-off)."""
    texts = [t for t in VALID.read_text().splitlines() if t.strip()][:1]
    train = REPO / "examples" / "data" / "tinystories-train-sample.txt"
    source, rows = compare_methods(str(MHA8), [4, 2], texts, 64, 32, calib=train, calib_tokens=256,
                                   variants=(("fit+calib", "fit", True),), log=lambda *_: None)
    assert [(r.kv_heads, r.grouping) for r in rows] == [(4, "contiguous"), (4, "similar"),
                                                       (2, "contiguous"), (2, "similar")]
