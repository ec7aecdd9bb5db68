"""Preemption: a stop signal makes every process finish its step, checkpoint, and exit EXIT_PREEMPTED.

SIGTERM (what SLURM, Kubernetes and spot instances send before killing a job), SIGUSR1 (SLURM's
`--signal=USR1@SECONDS`) and a first Ctrl-C (SIGINT) only set a flag; the loop reads it once per
step (`StopRequest.agreed`), after the optimizer step. In a multi-process run the signal may reach
only some processes, so the flag is all-reduced (max) over a CPU (gloo) group at the end of every
step: every rank sees the same answer at the same step, saves the same checkpoint (a collective)
and exits with the same code. The gloo all-reduce of one int on the host costs no device sync.

A second Ctrl-C stops at once (KeyboardInterrupt): the last complete checkpoint is kept, the one
being written (if any) is never taken for complete. A SIGINT within `SAME_PRESS_S` of the first
counts as the same press: a terminal sends Ctrl-C to the launcher and to its workers, and
`accelerate launch` / torchrun forward it to the workers again.

Test hooks (environment; our own code sending itself real signals at a chosen point):
  UPTRAIN_TEST_SIGNAL_AT="STEP:RANK:SIGNAME"   rank RANK signals itself after step STEP
  UPTRAIN_TEST_SIGNAL_IN_CHECKPOINT="STEP:SIGNAME[:DELAY_S]"   the main process signals itself
      while writing checkpoint STEP (after the state files, before the completion mark)
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import torch

EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): stopped on request with a checkpoint; resume=latest continues
EXIT_INTERRUPTED = 130  # 128 + SIGINT: stopped at once by a second Ctrl-C; the last complete checkpoint is kept
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGINT") if hasattr(signal, name))
SAME_PRESS_S = 1.0


class Preempted(Exception):
    """The run stopped on a signal after `step` with checkpoint `checkpoint` (every process raises it)."""

    def __init__(self, signal_name: str, step: int, steps: int, checkpoint):
        super().__init__(f"stopped by {signal_name} after step {step} of {steps}")
        self.signal_name, self.step, self.steps, self.checkpoint = signal_name, step, steps, checkpoint


class StopRequest:
    """The stop signals received by this process, and the run-wide decision once per step."""

    def __init__(self):
        self.signum = 0  # the first stop signal received here, 0: none
        self._first_sigint = None
        self._group = None
        self._rank = 0

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_sigint is not None and now - self._first_sigint > SAME_PRESS_S:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now
            self._first_sigint = self._first_sigint or now
        self.signum = self.signum or signum

    @contextlib.contextmanager
    def installed(self):
        """Handle the stop signals inside the block; the previous handlers come back after it."""
        if threading.current_thread() is not threading.main_thread():  # only the main thread may
            yield self
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        try:
            yield self
        finally:
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


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _parse(value: str) -> list[str]:
    return value.split(":")


def _test_signal_at(step: int, rank: int) -> None:
    """Test hook: UPTRAIN_TEST_SIGNAL_AT="STEP:RANK:SIGNAME" signals this process after step STEP."""
    hook = os.environ.get("UPTRAIN_TEST_SIGNAL_AT")
    if hook:
        at, who, name = _parse(hook)
        if int(at) == step and int(who) == rank:
            os.kill(os.getpid(), getattr(signal, name))


def signal_in_checkpoint_hook(step: int) -> None:
    """Test hook: UPTRAIN_TEST_SIGNAL_IN_CHECKPOINT="STEP:SIGNAME[:DELAY_S]" (main process, mid-write)."""
    hook = os.environ.get("UPTRAIN_TEST_SIGNAL_IN_CHECKPOINT")
    if hook:
        at, name, *delay = _parse(hook)
        if int(at) == step:
            time.sleep(float(delay[0]) if delay else 0.0)
            os.kill(os.getpid(), getattr(signal, name))
