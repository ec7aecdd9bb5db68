"""The run's state on disk: the run folder's file names, its complete checkpoints and a
checkpoint's trainer state (run_files.py, stdlib only); the run folder as a start begins it, its
metrics log, checkpoints written and loaded (run_state.py). Which checkpoint a resume may use, and
its identity, is the plan's (plan/folders.py). Imports only stop/ of the trainer (a stop signal
during a checkpoint write)."""
