"""A line per layer converted, with the layers done and the time left (standard library only).

The one format of every command that converts layer by layer: `<line> [k/N layers, ~S s left]`,
the time left extrapolated from the mean time per layer so far. Inside a layer (a 7B layer's
refinement takes an hour on a CPU) a line at most every ~10 s (`throttled`, `progress_every`):
`refine layer 3: step 120/400, ...` and `calibrate layer 3: sequence 40/128, ~12 s left in this layer`.

Never silent: the phases of a layer without steps to count (the closed-form start, the refinement's
inputs and its held-out measurements, the output solve: minutes each at 7B width on a CPU)
run inside `log.phase(what)`; while one runs, a line `<what>: still working, N s in it` comes
whenever `progress_every()` seconds pass with no line (`Heartbeat`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def print_line(line: str) -> None:
    """Print `line` on stdout at once (progress is read while the command runs)."""
    print(line, flush=True)


class Heartbeat:
    """A line through `write` whenever `every` seconds pass with no line while a phase runs
    (`phase(what)`, a context manager; phases may nest: the innermost is named). Lines written
    through `said` count as lines. One daemon thread, started at the first phase; none with
    `every` 0 (UPTRAIN_PROGRESS_EVERY=0: a line per step and sequence, the tests' setting)."""

    def __init__(self, write: Callable[[str], None], every: float | None = None, indent: str = ""):
        self.write, self.indent = write, indent
        self.every = progress_every() if every is None else every
        self.last = time.monotonic()
        self._phases: list[tuple[str, float]] = []  # (what, since)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def said(self, line: str) -> None:
        """Write `line` (a line of the command's own): the silence starts again."""
        with self._lock:
            self.last = time.monotonic()
        self.write(line)

    @contextmanager
    def phase(self, what: str) -> Iterator[None]:
        with self._lock:
            self._phases.append((what, time.monotonic()))
            if self._thread is None and self.every > 0:  # (0: a line per step and sequence, for tests; no beat)
                self._thread = threading.Thread(target=self._watch, name="uptrain-heartbeat", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._phases.pop()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, max(self.every / 4, 0.01)))
            with self._lock:
                now = time.monotonic()
                if not self._phases or now - self.last < self.every:
                    continue
                what, since = self._phases[-1]
                self.last = now
            self.write(f"{self.indent}{what}: still working, {now - since:.0f} s in it")


def layer_progress(layers: int, write: Callable[[str], None] = print_line, indent: str = ""
                   ) -> Callable[[str], None]:
    """A per-layer log: each call is one more of `layers` layers done; it writes
    `<indent><line> [k/N layers, ~S s left]`. The clock starts when it is made, or at its
    `begin()` (called as the first layer starts: the time left then leaves out imports and planning).
    Its `phase(what)` runs a phase of a layer that has no steps to count (`Heartbeat`)."""
    began, done, kept, lock = [time.monotonic()], [0], [0], threading.Lock()
    beat = Heartbeat(write, indent=indent)
    write = beat.said

    def log(line: str) -> None:
        with lock:  # a sweep's K/V counts may share one printer from several threads
            done[0] += 1
            k, timed = done[0], done[0] - kept[0]
        write(progress_line(line, k, layers, time.monotonic() - began[0], indent, timed))

    def kept_layer(line: str) -> None:
        """A layer an interrupted run kept (`layer_outputs._kept_layer`): done, but its moment's time
        is not a layer's cost: the clock starts again after it and the rate counts made layers only."""
        with lock:
            done[0] += 1
            kept[0] += 1
            k = done[0]
            began[0] = time.monotonic()
        write(f"{indent}{line} [{k}/{layers} layers]")
    log.kept = kept_layer  # type: ignore[attr-defined]

    def begin() -> None:
        with lock:
            if done[0] == 0:
                began[0] = time.monotonic()
        with beat._lock:  # the plan's lines were printed without it: the silence starts now, not at its making
            beat.last = time.monotonic()
    log.begin = begin  # type: ignore[attr-defined]
    # a line inside a layer (refinement steps, calibration sequences): written as it is, no layer counted
    log.note = lambda line: write(f"{indent}{line}")  # type: ignore[attr-defined]
    log.steps = lambda index: step_lines(index, log.note)  # type: ignore[attr-defined]  # (LayerRefiner)
    log.phase = beat.phase  # type: ignore[attr-defined]
    return log


def progress_line(line: str, done: int, layers: int, elapsed_s: float, indent: str = "",
                  timed: int | None = None) -> str:
    """`<indent><line> [done/layers layers, ~S s left]`, S extrapolated from `elapsed_s` over the `timed`
    layers it took (default `done`: all of them)."""
    left = elapsed_s / max(done if timed is None else timed, 1) * max(layers - done, 0)
    return f"{indent}{line} [{done}/{layers} layers, ~{left:.0f} s left]"


EVERY_S = 10.0  # seconds between two lines inside a layer (a 7B layer takes an hour on a CPU)


def progress_every() -> float:
    """Seconds between two lines inside a layer: UPTRAIN_PROGRESS_EVERY (0: every step or sequence,
    for tests), else EVERY_S."""
    raw = os.environ.get("UPTRAIN_PROGRESS_EVERY", "").strip()
    try:
        return max(0.0, float(raw)) if raw else EVERY_S
    except ValueError:
        return EVERY_S


def throttled(write: Callable[[str], None], every: float | None = None) -> Callable[[str], None]:
    """`write`, but a line only where `every` seconds (default `progress_every()`) have passed since the
    last line written or since it was made: inside a layer, a line every ~10 s, not one per step."""
    every = progress_every() if every is None else every
    last = [time.monotonic()]

    def show(line: str) -> None:
        now = time.monotonic()
        if now - last[0] >= every:
            last[0] = now
            write(line)
    return show


def step_lines(index: int, write: Callable[[str], None], every: float | None = None) -> Callable[[object], None]:
    """Layer `index`'s refinement progress (`refine.RefineProgress`: step, steps, held_out_error,
    seconds_left) as a line through `write` at most every `every` seconds (default `progress_every()`;
    the callback's `every` tells `refine_attention` how often to call it): `refine layer 3: step
    120/400, held-out error 0.1234, ~95 s left in this layer`."""
    every = progress_every() if every is None else every
    show = throttled(write, every)

    def line(p) -> None:
        if getattr(p, "stopped", False):  # the time left shown before is void: say so at once
            write(f"refine layer {index}: stopped early at step {p.step}/{p.steps} (best held-out error "
                  f"{p.best_error:.4f}); the output solve and the final measurement next")
            return
        show(f"refine layer {index}: step {p.step}/{p.steps}, held-out error {p.held_out_error:.4f}, "
             f"~{p.seconds_left:.0f} s left in this layer")
    line.every = every  # type: ignore[attr-defined]
    return line


def sequence_progress(what: str, total: int, write: Callable[[str], None], every: float | None = None
                      ) -> Callable[[int], None]:
    """A tick per sequence of a pass over `total` calibration sequences: `tick(done)` writes (throttled)
    `<what>: sequence done/total, ~S s left in this layer`, S = the mean seconds per sequence so far
    x the sequences left."""
    show, began = throttled(write, every), time.monotonic()

    def tick(done: int) -> None:
        left = (time.monotonic() - began) / max(done, 1) * max(total - done, 0)
        show(f"{what}: sequence {done}/{total}, ~{left:.0f} s left in this layer")
    return tick
