"""Run the command blocks of README.md and the docs/ pages in order, as a new user would type them.

    python scripts/tools/readme_commands.py [--list] [--workdir DIR]

Every ```bash block of the pages in `CHAINS` runs, top to bottom, one command at a time (comment lines are
not commands; a trailing backslash continues a line), unless the line before the block is
`<!-- readme-test: skip (REASON) -->`. Commands run in DIR (default: a fresh temporary folder
holding copies of the repository's examples/, configs/, results/ and scripts/), with the virtual
environment's bin/ first on PATH, so `python -m uptrain.X`, `uptrain-X` and `accelerate` are
the installed ones. The first command that fails stops the run with its output.

The pages form independent chains: a page that uses another page's runs (docs/measure.md scores
docs/uptrain.md's runs/demo-cpu) is in that page's chain, after it. The test suite runs each chain in
a fresh folder of its own (tests/test_readme*.py, so the chains run side by side), which also proves
that no page uses another chain's files; this script runs them all, in order, in one folder.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\b")
COPIED = ("examples", "configs", "results", "scripts")
# README.md first, then the reference pages; each chain's pages in the order their commands build on each other
CHAINS = (("README.md", "docs/convert.md", "docs/deploy.md", "docs/own-model.md", "docs/paper.md",
           "docs/guarantees.md", "docs/layout.md", "docs/hardware.md"),
          ("docs/uptrain.md", "docs/measure.md"))
PAGES = tuple(page for chain in CHAINS for page in chain)


def all_blocks(pages: tuple[str, ...] = PAGES) -> list[list[str]]:
    """The runnable blocks of `pages` (default: every page), in order."""
    return [block for page in pages for block in command_blocks((REPO / page).read_text())]


def command_blocks(readme: str, skipped: bool = False) -> list[list[str]]:
    """The commands of each runnable ```bash block, continuation lines joined (`skipped`: those of the
    blocks marked skip instead, e.g. for the test that runs one of them itself)."""
    blocks, lines = [], readme.splitlines()
    for i, line in enumerate(lines):
        if line.strip() != "```bash" or (i > 0 and bool(SKIP.search(lines[i - 1]))) != skipped:
            continue
        commands, pending = [], ""
        for body in lines[i + 1:]:
            if body.strip() == "```":
                break
            text = body.rstrip()
            if not pending and (not text.strip() or text.lstrip().startswith("#")):
                continue
            text = re.sub(r"\s+#.*$", "", text) if not text.rstrip().endswith("\\") else text
            if text.endswith("\\"):
                pending += text[:-1].rstrip() + " "
                continue
            commands.append((pending + text.strip()).strip())
            pending = ""
        blocks.append(commands)
    return blocks


def copy_repository_files(workdir: Path) -> None:
    """What a clone gives the commands: copies of `COPIED` in `workdir` (not the run folders)."""
    for name in COPIED:
        if not (workdir / name).exists():
            shutil.copytree(REPO / name, workdir / name, ignore=shutil.ignore_patterns("__pycache__", "runs"))


def run_all(workdir: Path, python: Path, pages: tuple[str, ...] = PAGES) -> int:
    """Run every command of `pages` in `workdir`; 0 when all pass, else the failing command's exit code."""
    for n, commands in enumerate(all_blocks(pages), 1):
        if rc := run_commands(workdir, python, commands, f"block {n}"):
            return rc
    return 0


def run_commands(workdir: Path, python: Path, commands: list[str], label: str = "block") -> int:
    """Run `commands` in `workdir` through bash, `python`'s bin/ first on PATH; stop at the first failure
    (its output to stderr) and return its exit code, else 0."""
    env = dict(os.environ, PATH=f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1")
    for command in commands:
        start = time.time()
        proc = subprocess.run(command, shell=True, cwd=workdir, env=env, capture_output=True, text=True,
                              executable="/bin/bash")
        print(f"[{label}] {time.time() - start:5.1f}s rc={proc.returncode}  {command}", flush=True)
        if proc.returncode != 0:
            print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
            return proc.returncode
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/tools/readme_commands.py", description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="print the commands and run nothing")
    p.add_argument("--workdir", type=Path, help="where to run (default: a fresh temporary copy)")
    args = p.parse_args(argv)
    if args.list:
        for n, commands in enumerate(all_blocks(), 1):
            print("\n".join(f"[block {n}] {c}" for c in commands))
        return 0
    with tempfile.TemporaryDirectory(prefix="readme-") as tmp:
        workdir = args.workdir or Path(tmp)
        copy_repository_files(workdir)
        return run_all(workdir, Path(sys.executable))


if __name__ == "__main__":
    sys.exit(main())
