"""Stopping: what every entry point does with Ctrl-C (SIGINT), SIGTERM and SIGUSR1 (standard library only).

Two behaviours, one per kind of work, each from the entry point's first instruction (before torch
and the rest import: a scheduler may stop a job at any moment):

- `at_once.py`: **end at once, from the handler**, where nothing is worth saving mid-way: a
  conversion (`uptrain.convert`), the sweep and the demo. The folders being written are removed,
  one line says what is left, the process ends (`os._exit`) with 128 + the signal. Only the swap
  that puts a finished folder in place holds a signal back (`shielded()`).
- `safe_point.py`: **record, then stop at a safe point**, where a checkpoint is worth writing: the
  trainer (`uptrain.train`). A stop during the imports is recorded; the entry point arms the
  handlers once it can act (`raise_now()`), and the trainer's own handling
  (`uptrain/train/stop/preempt.py`: a checkpoint after the step, agreed across processes) takes
  the recorded stop over.

`codes.py` owns the exit codes and what a second signal does, for both. A new entry point picks one
behaviour by its work: nothing to save -> `at_once.install(...)` first thing; a checkpoint to write
-> `safe_point.install()` first thing, then the trainer's handling. A new behaviour is a new module
here, with its exit codes and its second-signal rule in `codes.py`.

"First thing" holds for both ways a command starts: `python -m uptrain.X` runs the module as
`__main__`; a console script (`uptrain-X`, pyproject's [project.scripts]) imports it under its own
name and then calls its main(). `is_command(__name__, "uptrain-X")` is true for both.
"""

import os as _os
import sys as _sys


def is_command(module_name: str, console_script: str) -> bool:
    """Whether this process is the command: the module runs as `__main__` (`python -m`), or the
    process was started as `console_script` (which imports the module, then calls its main())."""
    started_as = _os.path.basename(_sys.argv[0]) if _sys.argv else ""
    return module_name == "__main__" or started_as == console_script
