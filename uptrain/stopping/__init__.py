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
"""
