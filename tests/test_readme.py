"""The README and docs/ are the contract: their command blocks run, in order, on the bundled model and text.

The pages form independent chains (scripts/tools/readme_commands.py's CHAINS), each run in a fresh folder:
this file runs the first (README, convert, deploy, own-model, paper, ...), test_readme_uptrain.py the
second (uptrain, then measure on its runs), so that the two run side by side on pytest-xdist workers.
"""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "tools"))
import readme_commands  # noqa: E402


def run_chain(n: int, workdir: Path, capsys) -> None:
    """Chain `n`'s commands, in order, in `workdir` holding copies of what a clone gives them; all must pass."""
    readme_commands.copy_repository_files(workdir)
    rc = readme_commands.run_all(workdir, Path(sys.executable), readme_commands.CHAINS[n])
    assert rc == 0, capsys.readouterr().err[-4000:]


def test_every_page_is_in_one_chain_and_a_newcomer_meets_each_step() -> None:
    pages = readme_commands.PAGES
    assert sorted(pages) == sorted(["README.md", *(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))])
    assert len(set(pages)) == len(pages)
    commands = [c for block in readme_commands.all_blocks() for c in block]
    # what a newcomer meets: convert, train (plain, distilled, two processes), measure, plots
    for expected in ("uptrain.convert examples/stories260K-mha8", "uptrain.train configs/demo-cpu.yaml",
                     "accelerate launch", "uptrain.eval", "uptrain.bench", "uptrain.compare", "uptrain.plots"):
        assert any(expected in c for c in commands), expected


def test_readme_convert_deploy_and_paper_pages_run_in_order(tmp_path: Path, capsys) -> None:
    # docs/deploy.md's transformers/ONNX block is not in this chain: tests/measure/test_deploy.py runs it
    # as typed and checks what it wrote, so its exports run once in the suite.
    run_chain(0, tmp_path, capsys)
    assert (tmp_path / "runs" / "gqa2-refined-quick" / "config.json").is_file()
