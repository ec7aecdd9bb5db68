"""How a record in results/ names a path: relative to the repository, never as the machine it ran on has it.

    from shown import shown, shown_command
    shown("/work/main/examples/stories260K-mha8")   # 'examples/stories260K-mha8' (checkout at /work/main)
    shown("/work/shared/data/configs/x.json")        # '../shared/data/configs/x.json'
    shown("/tmp/bench-sweep/kv4")                    # 'SCRATCH/bench-sweep/kv4'
    shown_command(["--out", "/tmp/bench-sweep"])     # '--out SCRATCH/bench-sweep'

Inside the repository: relative to its root ("." for the root). In ../shared, the data beside the
checkout: `../shared/...`. A relative path outside the repository: as given. Any other absolute path
becomes a placeholder, `SCRATCH/` followed by the path below its top folder (below the temporary folder,
or below e.g. /work or /mnt), or `~/...` below the home folder: a scratch folder the reader picks, with
the names the command gave. tests/test_results_paths.py checks that results/ holds no machine paths.
"""

from __future__ import annotations

import os
import shlex
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _below(path: str, root: str) -> str | None:
    """path relative to root when path is root or inside it, else None (both absolute, normalised)."""
    if root == os.sep:  # a home or temporary folder at the root would take in every path
        return None
    if path == root:
        return "."
    return path[len(root):].lstrip(os.sep) if path.startswith(root.rstrip(os.sep) + os.sep) else None


def shown(path: str | os.PathLike) -> str:
    """The form of `path` a record in results/ keeps (see the module's docstring)."""
    given = os.fspath(path)
    full = os.path.abspath(given)
    for repo in dict.fromkeys((os.path.abspath(REPO), str(REPO))):  # as typed, and with symlinks resolved
        if (rel := _below(full, repo)) is not None:
            return rel
        if (rel := _below(full, os.path.join(os.path.dirname(repo), "shared"))) is not None:
            return "../shared" if rel == "." else f"../shared/{rel}"
    if not os.path.isabs(given):
        return given
    if (rel := _below(full, os.path.abspath(os.path.expanduser("~")))) not in (None, "."):
        return f"~/{rel}"
    if (rel := _below(full, os.path.abspath(tempfile.gettempdir()))) not in (None, "."):
        return f"SCRATCH/{rel}"
    parts = Path(full).parts[1:]  # without the root
    return "SCRATCH/" + "/".join(parts[1:] if len(parts) > 1 else parts) if parts else "SCRATCH"


def shown_arg(arg: str) -> str:
    """One command-line word: an absolute path (alone or as the value of `--opt=` / `key=`) through `shown`."""
    if os.path.isabs(arg):
        return shown(arg)
    key, eq, value = arg.partition("=")
    return f"{key}={shown(value)}" if eq and os.path.isabs(value) else arg


def shown_command(argv: list[str]) -> str:
    """A command line for a record: every word through `shown_arg`, quoted for a shell where needed."""
    return shlex.join(shown_arg(a) for a in argv)
