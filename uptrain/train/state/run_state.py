"""Run folders and atomic checkpoints on top of `accelerator.save_state` / `load_state`: the run
folder as a start begins it (`begin_run_folder`: run.yaml, held_out.jsonl), its metrics log
(`MetricsLog`: metrics.jsonl, cut back to the checkpoint on resume), checkpoints written and loaded.

Layout of a run folder:
  run.yaml                 the config that started the run (identifies whose state this is)
  checkpoints/checkpoint-00000100/   accelerate state + trainer_state.json (written last)
  metrics.jsonl, held_out.jsonl, <project>/ (TensorBoard), model/ (final Hugging Face folder), loss.png

A checkpoint is written into `checkpoints/.tmp-...`, fsynced, marked complete (trainer_state.json,
written last) and renamed into place: a kill at any point leaves it complete or absent, and a
folder without the mark is never taken as latest. A checkpoint records the process count and the
global batch (samples / step); a resume on another count keeps that batch by adjusting grad_accum
(`elastic_grad_accum`). What a new start checks of the folder (may it be used, which checkpoint a
resume continues, is it this run's) is the plan's: uptrain/train/plan/folders.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import yaml
from accelerate import Accelerator

from uptrain.convert.io.output_dir import fsync_path
from uptrain.train.stop.preempt import signal_in_checkpoint_hook
from uptrain.train.state.run_files import (  # noqa: F401 (public here too)
    FINISHED_FILE, HELD_OUT_FILE, PREEMPTED_FILE, RUN_FILE, RUN_OUTPUTS, STATE_FILE, checkpoint_state,
    complete_checkpoints,
)


def mark_finished(run_dir: Path, record: dict) -> None:
    """Mark the run complete (main process, after model/ is saved): resume then refuses."""
    tmp = run_dir / f".{FINISHED_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, run_dir / FINISHED_FILE)


def clear_run_dir(run_dir: Path, tracker_dir: str) -> None:
    """Remove a previous run's outputs (only what this trainer writes, incl. `tracker_dir`)."""
    for name in (*RUN_OUTPUTS, PREEMPTED_FILE, tracker_dir):
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def begin_run_folder(run_dir: Path, run_config: dict, overwrite: bool, tracker_dir: str,
                     held_out: list[str] | None) -> None:
    """The run folder as this start begins it (main process): cleared with `overwrite` (with the
    trackers' `tracker_dir`), run.yaml (`run_config`) written whole (a stop signal may come at any
    moment), the last stop's mark removed (this start continues that run), the held-out documents
    written for uptrain.eval."""
    if overwrite:
        clear_run_dir(run_dir, tracker_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / PREEMPTED_FILE).unlink(missing_ok=True)
    tmp = run_dir / f".{RUN_FILE}.tmp"
    tmp.write_text(yaml.safe_dump(run_config, sort_keys=False))
    os.replace(tmp, run_dir / RUN_FILE)
    if held_out is not None:
        write_held_out(run_dir, held_out)


def write_held_out(run_dir: Path, texts: list[str]) -> Path:
    """run_dir/held_out.jsonl: the documents held out of the training text (data.val_fraction), one
    {"text": ...} per line, written whole: `uptrain.eval ... --data RUN/held_out.jsonl` scores the
    models on text the run never trained on."""
    path = run_dir / HELD_OUT_FILE
    tmp = run_dir / f".{HELD_OUT_FILE}.tmp"
    tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    os.replace(tmp, path)
    return path


class MetricsLog:
    """Append-only JSON-lines log of metric records (written by the main process only)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """Drop records later than `step` (a resumed run rewrites them); -1 drops all."""
        if not self.enabled or not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line] if self.path.exists() else []


class _TiedWeightsNotice(logging.Filter):
    """Drop accelerate's "Removed shared tensor {'lm_head.weight'} while saving" warning.

    Tied embeddings are one tensor under two names; safetensors stores it once and the model
    ties it again on load (the resume test proves the round trip), so the warning on every
    checkpoint of a tied model tells the user nothing.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor" not in str(record.getMessage())  # accelerate prefixes "[RANK n] "


logging.getLogger("accelerate.utils.other").addFilter(_TiedWeightsNotice())


def save_checkpoint(accelerator: Accelerator, run_dir: Path, step: int, state: dict, keep: int,
                    save_extra=None) -> Path:
    """Save model/optimizer/RNG state + `state` (data position) atomically; keep the last `keep`.

    Must be called on every process (accelerate gathers and writes per-process RNG state). The
    state goes into `.tmp-checkpoint-N`, every file is fsynced, the completion mark is written
    last, and one rename makes it `checkpoint-N`: a crash or kill at any point leaves the folder
    complete or absent (an earlier copy of the same step is renamed away first, then deleted).
    """
    folder = run_dir / "checkpoints"
    final = folder / f"checkpoint-{step:08d}"
    tmp = folder / f".tmp-checkpoint-{step:08d}"
    old = folder / f".old-checkpoint-{step:08d}"
    if accelerator.is_main_process:
        for stale in [*folder.glob(".tmp-checkpoint-*"), *folder.glob(".old-checkpoint-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # left over from a crash while writing
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    started = time.monotonic()
    accelerator.save_state(str(tmp))
    if save_extra is not None:  # e.g. sharded weights and optimizer (shard=fsdp2), every rank
        save_extra(tmp)
    _fsync_tree(tmp)  # each rank's files on disk before the mark says "complete"
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        signal_in_checkpoint_hook(step)
        # The write time is what a stop signal's grace must cover (loop.stop_checkpoint reads it).
        state = {**state, "write_s": round(time.monotonic() - started, 3)}
        with open(tmp / STATE_FILE, "w") as f:  # completion mark, written after everything else
            json.dump(state, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        if final.exists():  # e.g. resumed from an earlier checkpoint: keep it whole until replaced
            os.rename(final, old)
        os.rename(tmp, final)  # atomic on one filesystem: readers see all of it or nothing
        fsync_path(folder)
        shutil.rmtree(old, ignore_errors=True)
        for stale in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(stale)
    accelerator.wait_for_everyone()
    return final


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root` (what this process can see of it: a file another
    rank removes meanwhile is skipped)."""
    for here, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                fsync_path(Path(here) / name)
        fsync_path(Path(here))


def load_checkpoint(accelerator: Accelerator, path: Path, load_extra=None) -> dict:
    """Restore the accelerate state in `path`; return its trainer state (step, samples, ...)."""
    accelerator.load_state(str(path))
    if load_extra is not None:
        load_extra(path)
    return checkpoint_state(path)
