"""The names of a run folder's files and its complete checkpoints (stdlib only: the CLI reads them
when a stop comes during the imports, before torch & co. are loaded)."""

from __future__ import annotations

import json
from pathlib import Path

STATE_FILE = "trainer_state.json"  # written last into a checkpoint: its completion mark
RUN_FILE = "run.yaml"
FINISHED_FILE = "finished.json"  # written last by a run that completed its budget
PREEMPTED_FILE = "preempted.json"  # the last stop's record for launch scripts (uptrain.train.__main__)
HELD_OUT_FILE = "held_out.jsonl"  # the documents of data.train held out for validation
# what a run writes into its folder: one of them there means the folder holds a run (clear_run_dir removes them)
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "model", "loss.png", RUN_FILE, FINISHED_FILE, HELD_OUT_FILE)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Finished checkpoints of a run, oldest first."""
    folder = run_dir / "checkpoints"
    found = [p for p in folder.glob("checkpoint-*") if (p / STATE_FILE).is_file()] if folder.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def checkpoint_state(path: Path) -> dict:
    """The trainer state of a complete checkpoint: step, samples, tokens, processes."""
    return json.loads((path / STATE_FILE).read_text())
