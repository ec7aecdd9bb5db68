"""docs/uptrain.md's commands, then docs/measure.md's on its runs, in a fresh folder (the second of
scripts/tools/readme_commands.py's CHAINS; tests/test_readme.py runs the first, side by side with this one)."""

from __future__ import annotations

from pathlib import Path

from test_readme import run_chain


def test_uptrain_then_measure_pages_run_in_order(tmp_path: Path, capsys) -> None:
    run_chain(1, tmp_path, capsys)
    assert (tmp_path / "runs" / "demo-cpu" / "model" / "config.json").is_file()
    assert (tmp_path / "runs" / "sweep").is_dir() and (tmp_path / "runs" / "plots" / "tasks.png").is_file()
