"""A line per layer converted, with the layers done and the time left (standard library only).

The one format of every command that converts layer by layer: `<line> [k/N layers, ~S s left]`,
the time left extrapolated from the mean time per layer so far.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def print_line(line: str) -> None:
    """Print `line` on stdout at once (progress is read while the command runs)."""
    print(line, flush=True)


def layer_progress(layers: int, write: Callable[[str], None] = print_line, indent: str = ""
                   ) -> Callable[[str], None]:
    """A per-layer log: each call is one more of `layers` layers done; it writes
    `<indent><line> [k/N layers, ~S s left]`. The clock starts when it is made, or at its
    `begin()` (called as the first layer starts: the time left then leaves out imports and planning)."""
    began, done, lock = [time.monotonic()], [0], threading.Lock()

    def log(line: str) -> None:
        with lock:  # a sweep's K/V counts may share one printer from several threads
            done[0] += 1
            k = done[0]
        write(progress_line(line, k, layers, time.monotonic() - began[0], indent))

    def begin() -> None:
        with lock:
            if done[0] == 0:
                began[0] = time.monotonic()
    log.begin = begin  # type: ignore[attr-defined]
    return log


def progress_line(line: str, done: int, layers: int, elapsed_s: float, indent: str = "") -> str:
    """`<indent><line> [done/layers layers, ~S s left]`, S extrapolated from `elapsed_s` over `done` layers."""
    left = elapsed_s / max(done, 1) * max(layers - done, 0)
    return f"{indent}{line} [{done}/{layers} layers, ~{left:.0f} s left]"
