"""The names of a run folder's files and its complete checkpoints (stdlib only: the CLI reads them
when a stop comes during the imports, before torch & co. are loaded)."""

from __future__ import annotations

from pathlib import Path

STATE_FILE = "trainer_state.json"  # written last into a checkpoint: its completion mark
RUN_FILE = "run.yaml"
FINISHED_FILE = "finished.json"  # written last by a run that completed its budget
PREEMPTED_FILE = "preempted.json"  # the last stop's record for launch scripts (uptrain.train.__main__)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Finished checkpoints of a run, oldest first."""
    folder = run_dir / "checkpoints"
    found = [p for p in folder.glob("checkpoint-*") if (p / STATE_FILE).is_file()] if folder.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))
