"""How a stopped process ends, for every entry point: the stop signals, the exit codes, and what a
second signal does (standard library only).

Exit codes:
  75   EXIT_PREEMPTED: the trainer stopped on a signal with a checkpoint (or during set-up, before
       its first step); `resume=latest` continues (EX_TEMPFAIL, sysexits.h: launch scripts requeue).
  130  EXIT_INTERRUPTED: the trainer stopped at once by a second Ctrl-C (the last complete
       checkpoint kept), and `killed_by(SIGINT)`.
  128 + the signal (`killed_by`): what a shell reports for a process a signal killed; an
       end-at-once command exits so (130 for SIGINT, 143 for SIGTERM).

A second signal:
  end at once (`at_once.py`): every signal, first or second, ends the process; inside a
      `shielded()` block signals are only recorded (a SIGTERM is the one named over a SIGINT) and
      the process ends after the block; once the command's exit code is decided (`finish`),
      signals are ignored.
  record, then stop at a safe point (`safe_point.py`): once the stop is raised, later signals are
      only recorded (launchers deliver one stop twice: srun and torchrun both forward it), and
      ignored once the exit code is decided (`ignore()`).
  the trainer (`uptrain/train/stop/preempt.py`): SIGTERM / SIGUSR1 again are only recorded; a
      second Ctrl-C more than SAME_PRESS_S after the first (`is_second_press`) stops at once:
      EXIT_INTERRUPTED. Within SAME_PRESS_S it is the same press (a terminal sends Ctrl-C to the
      launcher and to its workers, and the launcher forwards it again).
"""

from __future__ import annotations

import signal

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGINT") if hasattr(signal, name))
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130
SAME_PRESS_S = 1.0


def killed_by(signum: int) -> int:
    """128 + the signal's number: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    """'SIGTERM' for signal.SIGTERM."""
    return signal.Signals(signum).name


def is_second_press(first_at: float | None, now: float) -> bool:
    """Whether a Ctrl-C at `now` (time.monotonic()) is a second press after one at `first_at`
    (None: none yet), not the same press delivered again."""
    return first_at is not None and now - first_at > SAME_PRESS_S
