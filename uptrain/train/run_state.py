"""Run folders and atomic checkpoints on top of `accelerator.save_state` / `load_state`.

Layout of a run folder:
  run.yaml                 the config that started the run (identifies whose state this is)
  checkpoints/checkpoint-00000100/   accelerate state + trainer_state.json (written last)
  metrics.jsonl, <project>/ (TensorBoard), model/ (final Hugging Face folder), loss.png

A checkpoint is written into `checkpoints/.tmp-...`, fsynced, marked complete (trainer_state.json,
written last) and renamed into place: a kill at any point leaves it complete or absent, and a
folder without the mark is never taken as latest. A checkpoint records the process count and the
global batch (samples / step); a resume on another count keeps that batch by adjusting grad_accum
(`elastic_grad_accum`).
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
from uptrain.errors import UsageError
from uptrain.train.identity import config_identity, describe_changes, identity_changes
from uptrain.train.preempt import signal_in_checkpoint_hook
from uptrain.train.run_files import (  # noqa: F401 (public here too)
    FINISHED_FILE, PREEMPTED_FILE, RUN_FILE, STATE_FILE, complete_checkpoints,
)

_RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "model", "loss.png", RUN_FILE, FINISHED_FILE, "held_out.jsonl")


def check_run_dir(run_dir: Path, config_dict: dict, resume: str | None, overwrite: bool) -> Path | None:
    """Check that `run_dir` may be used; return the checkpoint to resume from (or None).

    Raises UsageError when the folder holds another run's state (unless `overwrite`), or when
    `resume` names nothing usable.
    """
    run_file = run_dir / RUN_FILE
    has_state = any((run_dir / name).exists() for name in _RUN_OUTPUTS)
    if resume and overwrite:
        raise UsageError("resume and overwrite=true contradict each other; choose one")
    if resume is None:
        if has_state and not overwrite:
            raise UsageError(
                f"run folder {run_dir} already holds a run; set resume=latest to continue it, "
                "overwrite=true to replace it, or choose another run_dir"
            )
        return None
    if run_file.is_file():
        stored = yaml.safe_load(run_file.read_text()) or {}
        recorded, now = config_identity(stored), config_identity(config_dict)
        changed = identity_changes(recorded, now)
        if changed:
            raise UsageError(
                f"run folder {run_dir} holds another run's state (differs in: {describe_changes(changed, recorded, now)}); "
                "resume with the config it was started with, or use another run_dir (or overwrite=true without resume)"
            )
    finished = run_dir / FINISHED_FILE
    if finished.is_file():
        # Resuming would redo the steps after the last checkpoint and overwrite model/.
        record = json.loads(finished.read_text())
        raise UsageError(
            f"run {run_dir} is finished ({record.get('steps')} steps, {record.get('tokens'):,} tokens, "
            f"val loss {record.get('val_loss', float('nan')):.4f}); to train further start a new run from it: "
            f"model={run_dir / 'model'} run_dir=NEW_FOLDER"
        )
    if resume == "latest":
        done = complete_checkpoints(run_dir)
        return done[-1] if done else None  # nothing saved yet: start from the beginning
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise UsageError(f"{path} is not a complete checkpoint (no {STATE_FILE})")
    owner = path.resolve().parent.parent
    if owner != run_dir.resolve():
        # Its metrics, run.yaml and later checkpoints live in its own folder: continuing it elsewhere
        # would leave a run without the records of its first steps (or mix two runs in one folder).
        raise UsageError(
            f"checkpoint {path} belongs to the run in {owner}, not to run_dir {run_dir}: continue that run with "
            f"run_dir={owner} resume=latest (and its config), or start a new run without resume"
        )
    return path


def check_checkpoint_identity(path: Path, state: dict, now: dict) -> None:
    """UsageError naming what differs when checkpoint `path` (its trainer state `state`) was written
    by a run of another identity than `now` (uptrain.train.identity.run_identity)."""
    recorded = state.get("identity")
    if not recorded:  # written before checkpoints recorded their run's identity: run.yaml was compared
        return
    changed = identity_changes(recorded, now)
    if changed:
        raise UsageError(
            f"checkpoint {path} was written by a run with other settings: {describe_changes(changed, recorded, now)}; "
            "resume with the settings it was written with, or start a new run (another run_dir, without resume)"
        )


def mark_finished(run_dir: Path, record: dict) -> None:
    """Mark the run complete (main process, after model/ is saved): resume then refuses."""
    tmp = run_dir / f".{FINISHED_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, run_dir / FINISHED_FILE)


def clear_run_dir(run_dir: Path, tracker_dir: str) -> None:
    """Remove a previous run's outputs (only what this trainer writes, incl. `tracker_dir`)."""
    for name in (*_RUN_OUTPUTS, PREEMPTED_FILE, tracker_dir):
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


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


def checkpoint_state(path: Path) -> dict:
    """The trainer state of a complete checkpoint: step, samples, tokens, processes."""
    return json.loads((path / STATE_FILE).read_text())


def elastic_grad_accum(path, state: dict, world: int, micro_batch: int, grad_accum: int) -> int:
    """The grad_accum that keeps checkpoint `path`'s global batch on `world` processes.

    The global batch (micro_batch x grad_accum x processes, stored as samples / step) fixes the
    steps, the data each step sees and the LR schedule; `world` processes keep it when it is a
    whole multiple of micro_batch x world. Raises UsageError (one line) naming the process counts
    that do when it is not.
    """
    if not state.get("step"):
        return grad_accum
    global_batch = state["samples"] // state["step"]
    if global_batch % (micro_batch * world) == 0:
        return global_batch // (micro_batch * world)
    written = state.get("processes") or global_batch // (micro_batch * grad_accum)
    per_micro = global_batch // micro_batch if global_batch % micro_batch == 0 else 0
    counts = [m for m in range(1, per_micro + 1) if per_micro % m == 0]
    raise UsageError(
        f"checkpoint {path} was written with a global batch of {global_batch} sequences ({written} processes); "
        f"{world} processes x micro_batch {micro_batch} cannot keep it with a whole grad_accum: "
        f"resume on {', '.join(map(str, counts))} processes (grad_accum is set to keep the global batch)"
    )


def load_checkpoint(accelerator: Accelerator, path: Path, load_extra=None) -> dict:
    """Restore the accelerate state in `path`; return its trainer state (step, samples, ...)."""
    accelerator.load_state(str(path))
    if load_extra is not None:
        load_extra(path)
    return checkpoint_state(path)
