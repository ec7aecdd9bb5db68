"""Preemption: a stop signal makes every process finish its step, checkpoint, and exit EXIT_PREEMPTED.

Before the first step (set-up: model and teacher loads, tokenization, teacher-sample generation,
the checkpoint's load) there is nothing to checkpoint: a stop signal then raises StoppedInSetup
from the handler itself, so the process ends within moments wherever set-up is (a scheduler's
grace is seconds to minutes; set-up can take hours). What set-up writes is written atomically
(teacher samples chunk by chunk), so a restart continues it. Earlier still, while
`python -m uptrain.train` imports torch & co., the early handlers of uptrain.stopping.safe_point (installed
as its first instruction) keep a stop: `StopRequest.installed` takes it over (the phase "imports").

The grace: a scheduler kills a job some time after its stop signal (Slurm's --signal lead time,
Kubernetes' terminationGracePeriodSeconds, torchrun's shutdown timeout after it forwards the
signal: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, default 30 s). `stop_grace` says what this run knows of it;
a preemption checkpoint that would not fit in what is left of it is not started (the last complete
checkpoint is named instead), so the process still exits 75 and asks to be resumed rather than
being killed half-way.

SIGTERM (what SLURM, Kubernetes and spot instances send before killing a job), SIGUSR1 (SLURM's
`--signal=USR1@SECONDS`) and a first Ctrl-C (SIGINT) only set a flag; the loop reads it once per
step (`StopRequest.agreed`), after the optimizer step. In a multi-process run the signal may reach
only some processes, so the flag is all-reduced (max) over a CPU (gloo) group at the end of every
step: every rank sees the same answer at the same step, saves the same checkpoint (a collective)
and exits with the same code. The gloo all-reduce of one int on the host costs no device sync.

A second Ctrl-C stops at once (KeyboardInterrupt): the last complete checkpoint is kept, the one
being written (if any) is never taken for complete. A SIGINT within `SAME_PRESS_S` of the first (`uptrain.stopping.codes`, the owner of exit codes and second signals)
counts as the same press: a terminal sends Ctrl-C to the launcher and to its workers, and
`accelerate launch` / torchrun forward it to the workers again.

Test hooks (environment; our own code sending itself real signals at a chosen point):
  UPTRAIN_TEST_SIGNAL_AT="STEP:RANK:SIGNAME[:AFTER_S]"   rank RANK signals itself after step STEP
      (then sleeps AFTER_S: the rest of a long step, spent from the grace before the stop is decided)
  UPTRAIN_TEST_SIGNAL_IN_CHECKPOINT="STEP:SIGNAME[:DELAY_S[:until-stop]]"   the main process
      signals itself while writing checkpoint STEP (after the state files, before the completion
      mark), after sleeping DELAY_S (a slow write); SIGNAME "none": only the sleep; "until-stop":
      the sleep ends early once a stop signal has reached this process (a write that lasts until
      a scheduler's signal, however late that comes within DELAY_S)
  UPTRAIN_TEST_SIGNAL_IN_SETUP="PHASE:SIGNAME[:end|:in-finalizer]"   signal itself as set-up enters
      PHASE, or with ":end" once the phase's work is done (called where the work ends:
      `StopRequest.phase_done`, after the checkpoint load and after the step-0 evaluation), still
      before the first step; ":in-finalizer": as it enters PHASE, from inside a `__del__`
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

import torch

from uptrain.stopping import safe_point
from uptrain.stopping.codes import STOP_SIGNALS, is_second_press, signal_name

_STOP_SEEN = threading.Event()  # a stop signal reached this process (read only by the checkpoint test hook)


class Preempted(Exception):
    """The run stopped on a signal after `step` with checkpoint `checkpoint` (every process raises it)."""

    def __init__(self, signal_name: str, step: int, steps: int, checkpoint):
        super().__init__(f"stopped by {signal_name} after step {step} of {steps}")
        self.signal_name, self.step, self.steps, self.checkpoint = signal_name, step, steps, checkpoint


class StoppedInSetup(safe_point.Stopped):
    """A stop signal before the first step (nothing to checkpoint yet), raised by the handler.

    A BaseException, like KeyboardInterrupt: library code that catches Exception (a loader trying a
    fallback) must not swallow it. The CLI catches its base class, safe_point.Stopped: the early
    handlers (uptrain.stopping.safe_point, installed first thing by `python -m uptrain.train`) raise that one
    during the imports."""

    def __init__(self, signal_name: str, phase: str):
        super().__init__(signal_name, phase, f"stopped by {signal_name} during set-up ({phase}), before the first step")


class StopRequest:
    """The stop signals received by this process, and the run-wide decision once per step."""

    def __init__(self):
        self.signum = 0  # the first stop signal received here, 0: none
        self.received_at = None  # time.monotonic() of that signal
        self.phase = "starting"  # what set-up is doing (named when a signal stops it)
        self._in_setup = True  # until setup_done(): a signal raises StoppedInSetup at once
        self._stopped_in: str | None = None  # the set-up phase a stop signal came in (`_raise_swallowed`)
        self._first_sigint = None
        self._group = None
        self._rank = 0

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if is_second_press(self._first_sigint, now):
                raise KeyboardInterrupt  # a second Ctrl-C: stop now
            self._first_sigint = self._first_sigint or now
        if not self.signum:
            self.signum, self.received_at = signum, time.monotonic()
        _STOP_SEEN.set()
        if self._in_setup:
            self._stopped_in = self._stopped_in or self.phase
            raise StoppedInSetup(signal_name(self.signum), self.phase)

    def _raise_swallowed(self) -> None:
        """A stop the handler raised where it cannot propagate (it landed in a finalizer, a `__del__`
        that a garbage collection ran: Python ignores exceptions there) still stops set-up, at its next
        phase boundary, naming the phase the signal came in."""
        if self._in_setup and self._stopped_in is not None:
            raise StoppedInSetup(signal_name(self.signum), self._stopped_in)

    def _take_early_stop(self) -> None:
        signum, received_at, phase = safe_point.take()
        if signum:  # before this handler existed: the imports (or whatever the entry point named)
            self.signum, self.received_at, self.phase = signum, received_at, phase or self.phase
            _STOP_SEEN.set()
            raise StoppedInSetup(signal_name(signum), self.phase)

    def enter(self, phase: str) -> None:
        """Set-up starts `phase` (a stop signal from here on names it)."""
        self._raise_swallowed()
        self.phase = phase
        _test_signal_in_setup(phase)

    def phase_done(self) -> None:
        """The current phase's work is done (the test hook's ":end" point; still set-up)."""
        _test_signal_in_setup(self.phase, "end")
        self._raise_swallowed()

    def setup_done(self) -> None:
        """The first step starts: from now on a signal only sets the flag (checkpoint after the step)."""
        self._raise_swallowed()
        self._in_setup = False

    def since_signal(self) -> float | None:
        """Seconds since the first stop signal reached this process (None: none yet)."""
        return None if self.received_at is None else time.monotonic() - self.received_at

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any (a host all-reduce; every rank must call)."""
        if self._group is None:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int64)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=self._group)
        return bool(value.item())

    @contextlib.contextmanager
    def installed(self):
        """Handle the stop signals inside the block; the previous handlers come back after it.

        A stop that the early handlers (uptrain.stopping.safe_point) recorded before is taken over: it is a
        stop during set-up, raised here, in the phase they were in (the grace counts from it)."""
        if threading.current_thread() is not threading.main_thread():  # only the main thread may
            yield self
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        unraisable = sys.unraisablehook
        sys.unraisablehook = _quiet_stops(unraisable)
        try:
            self._take_early_stop()
            yield self
        finally:
            sys.unraisablehook = unraisable
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def connect(self, rank: int, world: int) -> None:
        """Join the run's processes (call on every rank, after the process group exists)."""
        self._rank = rank
        if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            # A host-side group: the flag is read on the host every step, so it must not wait on a device.
            self._group = torch.distributed.new_group(backend="gloo")

    def agreed(self, step: int) -> int:
        """The stop signal any process received by the end of `step` (0: none); same on every rank."""
        _test_signal_at(step, self._rank)
        if self._group is None:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int64)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
        return int(flag.item())



def seconds_left(grace_s: float | None, since_signal_s: float | None) -> float | None:
    """What is left of the grace `since_signal_s` after the stop signal (None: no known deadline)."""
    if grace_s is None or since_signal_s is None:
        return None
    return grace_s - since_signal_s


def checkpoint_overruns(write_s: float | None, grace_s: float | None, since_signal_s: float | None) -> bool:
    """Whether a checkpoint written as slowly as the last one (`write_s`) would still be running when
    the grace ends: longer than what is left of it `since_signal_s` after the stop signal (not the
    whole grace: the step that was running when the signal came has used some). False when either
    time is unknown: without a measure or a deadline the checkpoint is tried."""
    left = seconds_left(grace_s, since_signal_s)
    return left is not None and write_s is not None and write_s > left


def stop_grace(configured: float | None, env) -> tuple[float | None, str, str | None]:
    """(grace seconds or None, where it comes from, a warning line or None) for this process.

    The config's stop_grace_s, else UPTRAIN_STOP_GRACE_S (scripts/slurm/uptrain.sbatch sets it to its
    --signal lead time), else under torchrun / accelerate launch its shutdown timeout (the launcher
    SIGKILLs the workers that long after forwarding a stop signal), else unknown. Under torchrun a
    grace longer than the launcher's own timeout is cut short by it: the warning says what to set.
    """
    launched = "TORCHELASTIC_RUN_ID" in env  # set by torchrun for its workers
    raw = env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or env.get("PET_SHUTDOWN_TIMEOUT")
    launcher_s = float(raw) if raw else 30.0
    if configured is not None:
        grace, source = float(configured), "stop_grace_s"
    elif env.get("UPTRAIN_STOP_GRACE_S"):
        grace, source = float(env["UPTRAIN_STOP_GRACE_S"]), "UPTRAIN_STOP_GRACE_S"
    elif launched:
        return launcher_s, ("torchrun's shutdown timeout" + ("" if raw else ", its default; raise it with "
                            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")), None
    else:
        return None, "no deadline known (set stop_grace_s to the scheduler's grace)", None
    if launched and launcher_s < grace:
        return launcher_s, f"torchrun's shutdown timeout, below the {grace:g} s of {source}", (
            f"warning: torchrun kills the workers {launcher_s:g} s after it forwards a stop signal, before the "
            f"{grace:g} s grace of {source}: launch with TORCH_ELASTIC_SHUTDOWN_TIMEOUT={grace:g}")
    return grace, source, None


def _quiet_stops(previous):
    """An unraisable-exception hook that passes over a stop raised where it could not propagate (a
    `__del__`: `StopRequest._raise_swallowed` acts on it, no traceback for the user) and hands
    anything else to `previous`."""
    def hook(unraisable) -> None:
        if not isinstance(unraisable.exc_value, safe_point.Stopped):
            previous(unraisable)
    return hook


def _parse(value: str) -> list[str]:
    return value.split(":")


def _test_signal_at(step: int, rank: int) -> None:
    """Test hook: UPTRAIN_TEST_SIGNAL_AT="STEP:RANK:SIGNAME[:AFTER_S]" signals this process after step
    STEP, then sleeps AFTER_S seconds (default 0)."""
    hook = os.environ.get("UPTRAIN_TEST_SIGNAL_AT")
    if hook:
        at, who, name, *after = _parse(hook)
        if int(at) == step and int(who) == rank:
            os.kill(os.getpid(), getattr(signal, name))
            time.sleep(float(after[0]) if after else 0.0)


def _test_signal_in_setup(phase: str, where: str = "start") -> None:
    """Test hook: UPTRAIN_TEST_SIGNAL_IN_SETUP="PHASE:SIGNAME[:end]" signals this process as set-up enters
    PHASE (the phase's first word: checks, teacher-samples, data, models, checkpoint, step-0), or with
    ":end" as its work ends."""
    hook = os.environ.get("UPTRAIN_TEST_SIGNAL_IN_SETUP")
    if hook:
        at, name, *when = _parse(hook)
        if phase.split()[0] == at and (when or ["start"])[0] == where:
            os.kill(os.getpid(), getattr(signal, name))
        elif phase.split()[0] == at and when == ["in-finalizer"]:
            _SignalInFinalizer(getattr(signal, name))  # made and collected at once: its __del__ signals


class _SignalInFinalizer:
    """Test hook: the process signals itself inside this object's `__del__`, so the handler's exception
    is raised in a finalizer, where Python ignores it (as when a garbage collection lands there)."""

    def __init__(self, signum: int):
        self.signum = signum

    def __del__(self) -> None:
        os.kill(os.getpid(), self.signum)


def signal_in_checkpoint_hook(step: int) -> None:
    """Test hook: UPTRAIN_TEST_SIGNAL_IN_CHECKPOINT="STEP:SIGNAME[:DELAY_S[:until-stop]]" (main
    process, mid-write)."""
    hook = os.environ.get("UPTRAIN_TEST_SIGNAL_IN_CHECKPOINT")
    if hook:
        at, name, *delay = _parse(hook)
        if int(at) == step:
            end = time.monotonic() + (float(delay[0]) if delay else 0.0)
            while time.monotonic() < end and not (delay[1:] == ["until-stop"] and _STOP_SEEN.is_set()):
                time.sleep(min(0.1, max(0.0, end - time.monotonic())))
            if name != "none":
                os.kill(os.getpid(), getattr(signal, name))
