"""The trainer's time-to-finish estimate, from the recent steps' wall times.

The first steps of a run are slow (allocation, lazy initialization, caches filling; on a busy
machine more so): issue 22 saw an ETA of 32.1 min from the average since the start, for 3:47 of
actual training. So the first `skip` steps are left out, and the rate is the mean step time over
a moving window of recent steps: the last half of those measured, at least `window`, so that a
periodic validation or checkpoint falls inside it once one has happened.

Where the output is not a terminal (a log file, a pipe), the progress is plain lines
(`ProgressLines`), not a tqdm bar: a bar's carriage returns leave a log without a newline for a
minute at a time and fill it with bar states.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

SKIP_STEPS = 3  # warm-up steps whose times do not predict the rest
WINDOW_STEPS = 20  # at least this many recent steps make the rate
MIN_STEPS = 2  # step times needed after the warm-up before there is an estimate


def eta_seconds(step_ends: Sequence[float], remaining: int, skip: int = SKIP_STEPS,
                window: int = WINDOW_STEPS) -> float | None:
    """Seconds to run `remaining` more steps, or None while too few steps were timed.

    `step_ends`: increasing wall-clock times at which this session's steps ended (step_ends[0]:
    the first). Step i's time is step_ends[i] - step_ends[i - 1]; the first `skip` of those are
    dropped, the rate is their mean over the last max(window, half of the rest).
    """
    durations = len(step_ends) - 1 - skip  # timed steps after the warm-up
    if remaining <= 0:
        return 0.0
    if durations < MIN_STEPS:
        return None
    n = min(durations, max(window, durations // 2))
    return (step_ends[-1] - step_ends[-1 - n]) / n * remaining


@dataclass
class EtaTracker:
    """Step end times of one session, and when the ETA was last printed."""

    step_ends: list[float] = field(default_factory=list)
    printed_finish: float | None = None  # wall time the last printed ETA pointed at
    printed_at: int = 0  # steps timed when it was printed

    def update(self, now: float, remaining: int) -> float | None:
        """Record a step that ended at `now`; return an ETA (seconds) worth printing, else None.

        Printed when first known, then again when the projected finish moved by more than a
        fifth of the time left (and at least WINDOW_STEPS steps after the last print).
        """
        self.step_ends.append(now)
        eta = eta_seconds(self.step_ends, remaining)
        if eta is None or remaining <= 0:
            return None
        finish = now + eta
        if self.printed_finish is not None and (len(self.step_ends) - self.printed_at < WINDOW_STEPS
                                                or abs(finish - self.printed_finish) <= 0.2 * eta):
            return None
        self.printed_finish, self.printed_at = finish, len(self.step_ends)
        return eta


def format_eta(seconds: float) -> str:
    """'3:47' (m:ss) or '1:02:03' (h:mm:ss)."""
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def plain_output(stream=None) -> bool:
    """Whether progress goes out as plain lines: `stream` (the bar's, stderr) is not a terminal and
    tqdm.auto did not pick a notebook widget (which draws in place, without carriage returns)."""
    from tqdm.auto import tqdm

    stream = sys.stderr if stream is None else stream
    notebook = any("notebook" in cls.__module__ for cls in tqdm.__mro__)
    return not notebook and not (hasattr(stream, "isatty") and stream.isatty())


def _print_line(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write: a line from the watcher thread never splits another
    sys.stdout.flush()


class ProgressLines:
    """The trainer's progress for a log file: a line `train: step k/N, <figures>` at the end of a step
    once `every` seconds have passed since the last line (0: every step), and while a step (or a
    validation, a checkpoint) runs longer, `train: still working, S s since step k/N` each `every`
    seconds from a watcher thread: never silent longer than `every`. Lines written through `say` (ETA,
    validation) count as lines. `close()` stops the watcher."""

    def __init__(self, total: int, done: int, every: float, write: Callable[[str], None] = _print_line):
        self.total, self.every, self.write = total, every, write
        self.lock = threading.Lock()
        self.last = self.since = time.monotonic()
        self.done = done  # the last step that ended, at `since`
        self.stop = threading.Event()
        self.thread = None
        if every > 0:
            self.thread = threading.Thread(target=self._watch, name="uptrain-train-progress", daemon=True)
            self.thread.start()

    def say(self, line: str) -> None:
        """Write a line of the trainer's own (the silence starts again)."""
        with self.lock:
            self.last = time.monotonic()
            self.write(line)

    def step(self, done: int, figures: str) -> None:
        """Step `done` (1-based) ended; `figures`: its losses, lr, tokens/s (may be empty)."""
        with self.lock:
            now = time.monotonic()
            self.done, self.since = done, now
            if now - self.last >= self.every or done == self.total:
                self.last = now
                self.write(f"train: step {done}/{self.total}" + (f", {figures}" if figures else ""))

    def _watch(self) -> None:
        while not self.stop.wait(min(1.0, self.every / 4)):
            with self.lock:
                now = time.monotonic()
                if now - self.last >= self.every:
                    self.last = now
                    self.write(f"train: still working, {now - self.since:.0f} s since step {self.done}/{self.total}")

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
