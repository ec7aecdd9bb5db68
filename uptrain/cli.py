"""Small helpers shared by the uptrain report CLIs (eval, bench, compare, plots)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from uptrain.errors import UsageError


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless X is None/False or the help names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


class ArgParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are UsageErrors (one line on stderr, exit code 2); help shows defaults."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")


def prog_name(module: str) -> str:
    """How the user called us, for usage lines: the console script's name (`uptrain-eval`) when
    run through one, else `python -m MODULE`."""
    called = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return called if called.startswith("uptrain-") else f"python -m {module}"


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-markdown table (readable as plain text too)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write_json(obj: object, dest: str) -> None:
    """Write `obj` as JSON to `dest` ("-" for stdout)."""
    text = json.dumps(obj, indent=2)
    if dest == "-":
        print(text)
    else:
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        Path(dest).write_text(text + "\n")


def distinct_names(paths: Sequence[str]) -> list[str]:
    """Shortest trailing path parts that tell the paths apart: runs/a/model, runs/b/model -> a/model, b/model.

    A training run's final model (RUN/model) always keeps its run's name: "model" alone names nothing.
    """
    parts = [Path(str(p)).parts or (str(p),) for p in paths]
    for depth in range(1, max(len(x) for x in parts) + 1):
        names = ["/".join(x[-(depth + (x[-1] == "model" and depth == 1)):]) for x in parts]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]
