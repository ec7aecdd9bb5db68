"""The run folder's state as a new start finds it: may the folder be used, which checkpoint a resume
continues, is that checkpoint part of this run (its identity), and on another process count the
grad_accum that keeps its global batch. Each refusal is one UsageError line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml

from uptrain.errors import UsageError
from uptrain.train.config import TrainConfig, to_dict
from uptrain.train.identity import config_identity, describe_changes, identity_changes, run_identity
from uptrain.train.run_files import FINISHED_FILE, RUN_FILE, STATE_FILE, complete_checkpoints


# what a run writes into its folder: one of them there means the folder holds a run (clear_run_dir removes them)
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "model", "loss.png", RUN_FILE, FINISHED_FILE, "held_out.jsonl")


def check_run_dir(run_dir: Path, config_dict: dict, resume: str | None, overwrite: bool) -> Path | None:
    """Check that `run_dir` may be used; return the checkpoint to resume from (or None).

    Raises UsageError when the folder holds another run's state (unless `overwrite`), or when
    `resume` names nothing usable.
    """
    run_file = run_dir / RUN_FILE
    has_state = any((run_dir / name).exists() for name in RUN_OUTPUTS)
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


def resume_checks(config: TrainConfig, resume_from: Path | None,
                   world: int, mixed_precision: str) -> tuple[TrainConfig, dict, list[str]]:
    """(config, the checkpoint's trainer state or {}, lines for the plan) of a run that may resume.

    The checkpoint's recorded identity is compared with the settings first (before any data is
    read; the data's fingerprint once it is known, in check_data). Elastic resume: on another
    process count, grad_accum keeps the checkpoint's global batch (the returned config has it)."""
    if resume_from is None:
        return config, {}, []
    state = checkpoint_state(resume_from)
    recorded_data = (state.get("identity") or {}).get("data_fingerprint")
    check_checkpoint_identity(resume_from, state, run_identity(to_dict(config), mixed_precision,
                                                               recorded_data))
    accum = elastic_grad_accum(resume_from, state, world, config.batch.micro_batch, config.batch.grad_accum)
    if accum == config.batch.grad_accum:
        return config, state, []
    written = state.get("processes", "?")
    line = (f"checkpoint written by {written} process{'es' * (written != 1)}, resumed on {world}: "
            f"grad_accum {config.batch.grad_accum} -> {accum} keeps the global batch of "
            f"{accum * world * config.batch.micro_batch} sequences")
    return dataclasses.replace(config, batch=dataclasses.replace(config.batch, grad_accum=accum)), state, [line]
