"""What makes a checkpoint part of a run, defined once: the run identity.

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
is not part of the identity: an elastic resume keeps the global batch (plan/resume.py, elastic_grad_accum).
"""

from __future__ import annotations

import copy

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
