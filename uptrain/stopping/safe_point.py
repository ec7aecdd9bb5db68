"""Record a stop, then stop at a safe point: stop signals (SIGTERM, SIGUSR1, SIGINT) handled from a
process's first instruction (stdlib only; the other behaviour, end at once: `at_once.py`).

A scheduler may stop a job at any moment, also while Python is still importing torch & co.
(seconds): with Python's default handlers SIGTERM and SIGUSR1 kill the process there and then
(exit 143 / 138, nothing said, no requeue). An entry point installs these handlers first, before
any heavy import:

    if __name__ == "__main__":  # first act: a stop during the imports below is kept
        from uptrain.stopping import safe_point
        safe_point.install()

From then on a stop signal is recorded (the first one and when it came) and the imports go on.
The entry point arms the handlers once it can act on a stop (its arguments read: it knows where to
write what a launch script reads), with `raise_now()`: a recorded stop raises `Stopped` there, or
the next one raises it at once, naming the phase set with `enter()` ("imports" until then); once
raised, further signals are only recorded (the stop is under way). The entry point catches
`Stopped` and exits in its own way, calling `ignore()` once its exit code is decided (a second
delivery during Python's shutdown would otherwise kill it). Its own handling, once installed,
takes the recorded stop over with `take()` (the grace counts from the first signal); these
handlers only record from then on: a process that goes on after that handling is gone again
(`uptrain.train.train` returned inside a longer command) calls `raise_now()` to re-arm them (a
stop recorded meanwhile raises there).

A console script (pyproject's [project.scripts]) imports the module and then calls its main(), so
`__name__ == "__main__"` is false there: test the command's name too (uptrain/train/__main__.py).

Nothing here runs unless `install()` was called: code importing this module (tests, the Python
API) keeps its own handlers.
"""

from __future__ import annotations

import signal
import threading
import time

from uptrain.stopping.codes import STOP_SIGNALS, signal_name



class Stopped(BaseException):
    """A stop signal, raised by the armed handlers (a BaseException, like KeyboardInterrupt: library
    code that catches Exception must not swallow it)."""

    def __init__(self, signal_name: str, phase: str, message: str | None = None):
        super().__init__(message or f"stopped by {signal_name} during {phase}")
        self.signal_name, self.phase = signal_name, phase


class _State:
    """What this process's early handlers know (one per process: signal handlers are process-wide)."""

    def __init__(self):
        self.installed = False
        self.armed = False  # a stop signal raises Stopped at once
        self.phase = "imports"
        self.signum = 0  # the first stop signal received, 0: none
        self.received_at: float | None = None  # its time.monotonic()


_state = _State()


def install(phase: str = "imports") -> None:
    """Record stop signals from now on (main thread only; elsewhere Python refuses handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    _state.phase = phase
    for sig in STOP_SIGNALS:
        signal.signal(sig, _handle)
    _state.installed = True


def _handle(signum: int, frame) -> None:
    if not _state.signum:
        _state.signum, _state.received_at = signum, time.monotonic()
    _raise_once()


def _raise_once() -> None:
    # Once: the stop is then under way, and a launcher may deliver the same stop twice (srun and
    # torchrun both forward it); a second raise would hit the entry point's own stop handling.
    if _state.armed:
        _state.armed = False
        raise Stopped(signal_name(_state.signum), _state.phase)


def enter(phase: str) -> None:
    """The process starts `phase` (a stop from here on names it)."""
    _state.phase = phase


def raise_now() -> None:
    """Arm the handlers: a stop already recorded raises Stopped here, later ones at once.
    A no-op when `install()` was not called."""
    if not _state.installed:
        return
    _state.armed = True
    if _state.signum:
        _raise_once()


def take() -> tuple[int, float | None, str | None]:
    """(first stop signal or 0, its time.monotonic(), the phase) recorded here, for the entry point's
    own handling as it takes over; the record is cleared (a stop is handled once) and these handlers
    only record from now on (when they come back after the entry point's own, its work is over)."""
    if not _state.installed:
        return 0, None, None
    taken = (_state.signum, _state.received_at, _state.phase)
    _state.signum, _state.received_at, _state.armed = 0, None, False
    return taken


def ignore() -> None:
    """The process is ending (its exit code decided): stop signals are ignored from now on. A no-op
    when `install()` was not called.

    Python puts the default handlers back while it shuts down, and a second delivery of the same
    stop (srun and torchrun both forward it) would then kill the process with 128 + the signal
    instead of the exit code it was returning; ignored signals stay ignored."""
    if _state.installed and threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def installed() -> bool:
    """Whether `install()` ran in this process."""
    return _state.installed

