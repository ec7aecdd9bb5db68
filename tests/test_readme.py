"""The README and docs/ are the contract: their command blocks run, in order, on the bundled model and text."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import readme_commands  # noqa: E402


def test_readme_command_blocks_run_in_order(tmp_path: Path, capsys) -> None:
    blocks = readme_commands.all_blocks()
    commands = [c for block in blocks for c in block]
    # what a newcomer meets: convert, train (plain, distilled, two processes), measure, plots
    for expected in ("uptrain.convert examples/stories260K-mha8", "uptrain.train configs/demo-cpu.yaml",
                     "accelerate launch", "uptrain.eval", "uptrain.bench", "uptrain.compare", "uptrain.plots"):
        assert any(expected in c for c in commands), expected
    for name in readme_commands.COPIED:
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "runs"))
    rc = readme_commands.run_all(tmp_path, Path(sys.executable))
    assert rc == 0, capsys.readouterr().err[-4000:]
    assert (tmp_path / "runs" / "demo-cpu" / "model" / "config.json").is_file()
