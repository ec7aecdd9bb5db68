"""The run folder's state as a new start finds it: may the folder be used, which checkpoint a resume
continues, is that checkpoint part of this run (its identity), and on another process count the
grad_accum that keeps its global batch. Each refusal is one UsageError line.

What makes a checkpoint part of a run is defined once, here: the run identity.

A resume must continue the same run: the same model, data, data order, optimisation trajectory and
state layout. Those are the identity:

  - the config sections in SECTIONS, as written (run.yaml keeps them for the run folder);
  - minus ELASTIC: fields a resume may change on purpose (grad_accum, which an elastic resume on
    another process count adapts; the global batch is checked instead, by `elastic_grad_accum`);
  - the effective mixed precision (the config's or the launcher's: `accelerator.mixed_precision`);
  - the training data's fingerprint (the token blocks' content key: the documents, the tokenizer,
    seq_len), so a data file changed under the same path is seen.

Every checkpoint records its identity (`checkpoint_identity`, in trainer_state.json) and the run
folder it belongs to; `identity_changes` names what differs. The process count is recorded too but
is not part of the identity: an elastic resume keeps the global batch (`elastic_grad_accum`, below).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import yaml

from uptrain.errors import UsageError
from uptrain.train.config import TrainConfig, to_dict
from uptrain.train.state.run_files import (  # noqa: F401 (RUN_OUTPUTS, checkpoint_state: public here too)
    FINISHED_FILE, RUN_FILE, RUN_OUTPUTS, STATE_FILE, checkpoint_state, complete_checkpoints,
)


# Config sections that decide the data, the data order, the trajectory and the checkpoint layout.
SECTIONS = ("model", "tokenizer", "seed", "data", "budget", "batch", "optim", "distill", "trainable",
            "trainable_stages", "shard", "mixed_precision")
# Fields inside SECTIONS that a resume may change: section -> field names.
ELASTIC = {"batch": ("grad_accum",)}
# What each section is called in a refusal, with what to do about it.
_HINTS = {"shard": "a sharded (shard=fsdp2) checkpoint holds per-rank shards, an unsharded one whole tensors",
          "mixed_precision": "the master weights' trajectory depends on it",
          "data_fingerprint": "the training text or the tokenizer changed since the checkpoint was written"}


def config_identity(config_dict: dict) -> dict:
    """The identity sections of a config (as `to_dict` gives it), elastic fields left out."""
    out = {}
    for key in SECTIONS:
        value = copy.deepcopy(config_dict.get(key))
        if isinstance(value, dict):
            for field in ELASTIC.get(key, ()):
                value.pop(field, None)
        out[key] = value
    return out


def run_identity(config_dict: dict, mixed_precision: str, data_fingerprint: str | None) -> dict:
    """The identity of a run: its config sections, the effective mixed precision, the data's fingerprint."""
    identity = config_identity(config_dict)
    identity["mixed_precision"] = mixed_precision  # the launcher's when the config leaves it unset (None)
    identity["data_fingerprint"] = data_fingerprint
    return identity


def identity_changes(recorded: dict, now: dict) -> list[str]:
    """Dotted names of the identity fields that differ between two identities (sorted by section).

    A field absent from `recorded` (a checkpoint of an older version that did not record it) is not
    compared."""
    changed = []
    for key in (*SECTIONS, "data_fingerprint"):
        if key not in recorded:
            continue
        a, b = recorded.get(key), now.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            changed += [f"{key}.{name}" for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
        else:
            changed.append(key)
    return changed


def describe_changes(changed: list[str], recorded: dict, now: dict) -> str:
    """'seed (checkpoint 0, now 5), optim.lr (checkpoint 0.002, now 0.005)': what a refusal names."""
    def value(identity: dict, dotted: str):
        section, _, field = dotted.partition(".")
        got = identity.get(section)
        return got.get(field) if field and isinstance(got, dict) else got

    parts = []
    for name in changed:
        hint = _HINTS.get(name.split(".")[0])
        shown = "" if name == "data_fingerprint" else f"checkpoint {value(recorded, name)!r}, now {value(now, name)!r}"
        parts.append(f"{name} ({'; '.join(p for p in (shown, hint) if p)})")
    return ", ".join(parts)


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
    by a run of another identity than `now` (`run_identity`, above)."""
    recorded = state.get("identity")
    if not recorded:  # written before checkpoints recorded their run's identity: run.yaml was compared
        return
    changed = identity_changes(recorded, now)
    if changed:
        raise UsageError(
            f"checkpoint {path} was written by a run with other settings: {describe_changes(changed, recorded, now)}; "
            "resume with the settings it was written with, or start a new run (another run_dir, without resume)"
        )


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
