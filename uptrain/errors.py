"""The one error type that CLIs turn into a one-line message and exit code 2."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import wraps


class UsageError(Exception):
    """Bad input from the user: a message that names the problem and what would work."""


def exit_on_usage_error(main: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap a CLI `main(argv)` so a UsageError prints one line to stderr and returns 2."""

    @wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs) or 0
        except UsageError as err:
            # Under `accelerate launch` / torchrun every process meets the same bad input: one says so.
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {err}", file=sys.stderr)
            return 2

    return wrapper
