"""results/ names paths as a reader of the repository sees them, never as the machine that made them had them.

A record that says `/work/main/examples/stories260K-mha8` or `--out /tmp/bench-sweep` tells a reader about
someone else's disk, not where to look in their checkout (issue 41). Paths in the repository are relative
to its root, ../shared is `../shared/...`, and a scratch folder outside it is `SCRATCH/...`
(scripts/tools/shown.py, which the scripts that write results/ use). Binary files (the plots) are not read.
"""

from __future__ import annotations

import re

from conftest import REPO

# an absolute path under a machine's usual roots; `runs/tmp/x` (relative) does not count
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|root|home|Users)/")


def test_results_hold_no_absolute_paths_of_a_machine() -> None:
    found = []
    for path in sorted((REPO / "results").rglob("*")):
        if not path.is_file() or b"\0" in (data := path.read_bytes()):
            continue
        for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:160]}")
    assert not found, ("absolute paths of a machine in results/ (make them relative to the repository, or "
                       "SCRATCH/... for a folder outside it: scripts/tools/shown.py):\n" + "\n".join(found))
