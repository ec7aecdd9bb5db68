"""End at once, from the handler: Ctrl-C and SIGTERM during a conversion, the sweep or the demo end
the run cleanly, every one (standard library only; the other behaviour, record then stop at a safe
point: `safe_point.py`; exit codes and second signals: `codes.py`).

The command line (`install()`, the first act of `python -m uptrain.convert`): a SIGINT or SIGTERM,
first or second, at any point, ends the process at once from the signal handler: the temporary
output folders being written (`register`ed by `output_dir.atomic_output_dir`) are moved aside and
removed, one line is printed, and the process exits 130 for SIGINT, 143 for SIGTERM (128 + the
signal's number, what a shell reports for a process the signal killed) with `os._exit`. The output
folder is as it was and the source untouched: only the temporary folder was ever written.

Why not a KeyboardInterrupt: raised in the main thread it lands wherever Python code runs, also
inside torch's C++ calling back into Python (importing torch: `terminate called after throwing an
instance of 'pybind11::error_already_set'`, exit 134), and unwinding then waits for worker threads
inside a layer's refinement (the first Ctrl-C seemed ignored for a minute); an interpreter that
exits around running C++ threads printed 'terminate called without an active exception'.
`os._exit` runs no Python and no C++ destructors, and waits for no thread.

Only `shielded()` blocks (putting the finished folder in place: the point of no return) delay
a signal: it is recorded, and the CLI says after the swap that the new folder is complete.

The Python API (`convert`, the demo; no `install()`): a KeyboardInterrupt in the main thread sets
`CANCEL` (`passthrough.copy_beside`), and the worker building the layers stops at its next
`check()` (each refinement step, calibration sequence and tensor) instead of at the end of a layer.

Test hook: UPTRAIN_TEST_PAUSE_AT="PHASE[:SECONDS]" makes `pause(PHASE)` print 'paused at PHASE'
on stderr the first time the run reaches PHASE and wait SECONDS (default 60) or until stopped.
Phases: import, plan, copy (the kept tensors, also while planning), calibrate, start (a layer's closed-form start), inputs (a refinement's student and inputs), refine, solve (its output solve), write
(building and writing shards), kept-K (layer K of a layer-at-a-time conversion kept for a rerun:
`convert/io/kept_layers.py`; keeping-K: just before it is; keeping-written-K: written and synced under its
temporary name, not yet renamed), rename (just before the folder is put in place).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from uptrain.stopping.codes import killed_by, signal_name

CANCEL = threading.Event()  # the API's Ctrl-C: workers stop at their next `check()`
SIGNALS = (signal.SIGINT, signal.SIGTERM)
_state: dict = {"installed": False, "signal": None, "shield": 0, "written": None}
_temporary: set[Path] = set()  # folders being written: removed when a signal ends the process
_paused: set[str] = set()


class Interrupted(KeyboardInterrupt):
    """Raised by `check()` in a worker thread once the main thread was interrupted."""


def install(program: str = "uptrain.convert", as_it_was: str = "the output folder is as it was") -> None:
    """Handle SIGINT and SIGTERM as the module doc says (main thread; once per process). program /
    as_it_was: how the one line names the command and what it left (the sweep: its folders)."""
    _state.update(program=program, as_it_was=as_it_was)
    if not _state["installed"]:
        _state["installed"] = True
        for sig in SIGNALS:
            signal.signal(sig, _handle)


def exit_code() -> int:
    """130 for SIGINT (also a KeyboardInterrupt without our handler), 143 for SIGTERM."""
    return killed_by(_state["signal"] or signal.SIGINT)


def message() -> str:
    """The one line an interrupted run prints (the output as it was, or, once `written`, complete)."""
    signum = _state["signal"] or signal.SIGINT
    what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal_name(signum)}"
    program = _state.get("program", "uptrain.convert")
    if _state["written"] is not None:
        return f"{program}: {what} after {_state['written']} was put in place; it is the complete new folder"
    line = f"{program}: {what}; {_state.get('as_it_was', 'the output folder is as it was')}"
    left = left_behind()  # (whatever the disk says: a message must come out)
    return f"{line}; {left}" if left else line


def leaving(describe) -> None:
    """What a stop leaves behind on purpose, said in its one line: `describe()` returns it ('' for
    nothing yet), e.g. the finished layers a rerun continues from (`convert/io/kept_layers.py`); None: nothing."""
    _state["leaving"] = describe


def left_behind() -> str:
    """What a stop now would leave on purpose (`leaving`), '' for nothing."""
    describe = _state.get("leaving")
    try:
        return describe() if describe is not None else ""
    except OSError:
        return ""


def written(out: Path | None) -> None:
    """`out` is in place and complete: from now on an interrupt says so (None: a CLI that goes on
    to other work, the demo after its conversion, says its own `as_it_was` again)."""
    _state["written"] = out


def pending() -> bool:
    """Whether a signal came inside a `shielded()` block (the process then goes on to its end)."""
    return _state["signal"] is not None


def _handle(signum: int, frame) -> None:
    if _state["signal"] is None or signum == signal.SIGTERM:
        _state["signal"] = signum
    if not _state["shield"]:
        _exit_now()


def _exit_now() -> None:
    """Remove the folders being written, say so, end the process (no Python or C++ unwinding)."""
    for folder in list(_temporary):
        aside = folder.with_name(f"{folder.name}-{uuid.uuid4().hex[:6]}")  # still a `partial-PID` name
        try:  # moved first: a worker still writing can no longer add files under the old path
            folder.rename(aside)
        except OSError:
            aside = folder
        shutil.rmtree(aside, ignore_errors=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - a print the signal interrupted: its line may be lost
            pass
    os.write(2, (message() + "\n").encode())
    os._exit(exit_code())


@contextmanager
def shielded() -> Iterator[None]:
    """Signals inside the block are only recorded (`pending()`); the process goes on."""
    _state["shield"] += 1
    try:
        yield
    finally:
        _state["shield"] -= 1


def register(folder: Path) -> None:
    """`folder` is being written: removed if a signal ends the process."""
    _temporary.add(folder)


def unregister(folder: Path) -> None:
    _temporary.discard(folder)


def end_if_pending() -> None:
    """A signal held by `shielded()` ends the process now (the folders it guarded are in place)."""
    if pending() and _state["installed"]:
        _exit_now()


def finish(code: int) -> None:
    """End the CLI with `code` (after a signal that came while the folder was put in place: at
    once, `os._exit`, streams flushed). The code is decided: stop signals are ignored from now on
    (`codes.py`), so a Ctrl-C while Python shuts down does not turn a finished run into exit 130."""
    if _state["installed"] and threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    if pending():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def end_after_training_stop(err: BaseException) -> None:
    """`uptrain.train`'s `train()`, called inside a CLI that `install`ed these handlers (the demo, the
    sweep's --uptrain-tokens), handles stop signals itself while it runs (its handlers replace
    ours and come back after it) and ends in an exception: a stop during its set-up, a stop after
    a step (its checkpoint written), a second Ctrl-C. Such a stop ends this CLI as any other stop
    does: the folders being written removed, one line, exit 128 + the signal. Any other error is
    left to the caller (this returns)."""
    name = getattr(err, "signal_name", None)  # safe_point.Stopped and train.stop.preempt.Preempted carry it
    if isinstance(err, KeyboardInterrupt) and name is None:
        name = "SIGINT"
    if not _state["installed"] or name not in signal.Signals.__members__:
        return
    _state["signal"] = signal.Signals[name]
    _exit_now()


def check() -> None:
    """Raise Interrupted once `CANCEL` is set (called by workers between steps)."""
    if CANCEL.is_set():
        raise Interrupted


def pause(phase: str) -> None:
    """Test hook (see the module doc): wait at `phase` the first time the run reaches it."""
    hook = os.environ.get("UPTRAIN_TEST_PAUSE_AT", "")
    name, _, seconds = hook.partition(":")
    if name != phase or phase in _paused:
        return
    _paused.add(phase)
    print(f"paused at {phase}", file=sys.stderr, flush=True)
    end = time.monotonic() + float(seconds or 60)
    while time.monotonic() < end:
        check()
        time.sleep(0.02)
