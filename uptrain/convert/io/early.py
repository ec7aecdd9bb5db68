"""The refusals of `python -m uptrain.convert` that need no model (standard library only).

Importing torch and transformers takes 6-7 s on an idle machine and half a minute on a busy one,
so what config.json and the file system can answer is checked before: a local checkpoint folder
that is missing or has no config.json, --kv-heads not positive or not possible from the config's
K/V heads (or equal to them: nothing to convert), a missing --calib file, an existing output
without --force. The full checks after the imports still run (a Hub id, families whose head
counts have other keys): this only answers earlier where it can.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
from pathlib import Path
from typing import Any

from uptrain.convert.io.output_dir import check_output_path
from uptrain.errors import UsageError


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_kv_heads(kv_heads: int, heads: int, kv: int, mqa_only: bool, model_type: str,
                   allow_expand: bool = False, allow_same: bool = True) -> None:
    """UsageError naming the valid counts unless `kv_heads` can be made from `kv` K/V heads
    (`heads` query heads; `mqa_only` families only 1; `allow_expand` also multiples of `kv`).
    Without `allow_same`, `kv` itself is refused too: converting to it changes nothing."""
    valid = [1, kv] if mqa_only else divisors(kv)
    if allow_expand and not mqa_only:
        valid = sorted(set(valid) | {k for k in divisors(heads) if k % kv == 0})
    if kv_heads == kv and not allow_same:
        fewer = [str(k) for k in valid if k < kv]
        raise UsageError(f"--kv-heads {kv_heads} is the checkpoint's own K/V head count: nothing to convert; use "
                         f"the checkpoint as it is" + (f", or pass fewer: {', '.join(fewer)}" if fewer else ""))
    if kv_heads in valid:
        return
    if kv_heads <= 0:
        problem = f"--kv-heads must be positive, got {kv_heads}"
    elif kv_heads > kv:
        problem = f"the checkpoint has {kv} K/V heads ({heads} query heads); pooling cannot make {kv_heads}"
    elif mqa_only:
        problem = f"{model_type} can only be multi-query (one K/V head)"
    else:
        problem = f"{kv_heads} does not divide the {kv} K/V heads"
    raise UsageError(f"{problem}; valid --kv-heads: {', '.join(map(str, valid))}")


def near_folder(name: str) -> str | None:
    """A folder beside where `name` points whose name is close to it (a likely typo), else None.

    Only when `name` looks like a path: it starts with . / ~, holds a path separator, or its
    parent folder exists (so `examples/stories260K-mha` with `examples/` here is a path, while
    a Hub id `org/model` without an `org/` folder here is not). Shown as the user spelled the parent.
    """
    path = Path(name).expanduser()
    looks_like_path = name.startswith((".", "/", "~")) or os.sep in name or "/" in name
    parent = path.parent
    if not looks_like_path or not parent.is_dir() or path.exists():
        return None
    try:
        siblings = {p.name: p for p in parent.iterdir() if p.is_dir()}
    except OSError:
        return None
    close = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.8)
    if not close:
        lower = {n.lower(): n for n in siblings}
        close = [lower[path.name.lower()]] if path.name.lower() in lower else []
    return str(Path(name).parent / close[0]) if close else None


def run_model_folder(name: str) -> str | None:
    """`name`/model when `name` is a training run's folder (no config.json, its final model in
    model/), else None."""
    folder = Path(name).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file() and (folder / "model" / "config.json").is_file():
        return str(Path(name) / "model")
    return None


def missing_folder_hint(name: str) -> str:
    """'; did you mean X?' for a model folder that is absent (a near name) or a run folder, else ''."""
    if run_model := run_model_folder(name):
        return f"; did you mean {run_model} (a training run's final model)?"
    near = near_folder(name)
    return f"; did you mean {near}?" if near else ""


def not_a_hub_id(name: str) -> bool:
    """Whether a checkpoint name that is no local folder cannot be a Hub id either (as `source.resolve_source`)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep in name.replace("/", "")


def local_folder(name: str, what: str = "checkpoint") -> Path | None:
    """The local model folder `name` names, resolved (None: a Hub id); one-line UsageError for a folder
    that is missing (with a near name where there is one), a file, or one without config.json. `what`:
    how the refusals name it ("checkpoint" for convert, "model" for the samples command)."""
    folder = Path(name).expanduser()
    if not folder.exists():
        if near := near_folder(name):
            raise UsageError(f"no folder {name}; did you mean {near}?")
        if not_a_hub_id(name):
            raise UsageError(f"{what} folder {name} does not exist; check the path")
        return None
    if not folder.is_dir():
        raise UsageError(f"{name} is a file; pass the {what} folder that holds config.json")
    if not (folder / "config.json").is_file():
        raise UsageError(f"{folder.resolve()} has no config.json; pass a Hugging Face {what} folder"
                         f"{missing_folder_hint(name)}")
    return folder.resolve()


def _local_config(checkpoint: str) -> dict[str, Any] | None:
    """config.json of a local checkpoint folder (None: a Hub id, or a config the full reader judges);
    UsageError where the folder is missing or has no config.json."""
    folder = local_folder(checkpoint)
    if folder is None:
        return None
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _head_counts(raw: dict[str, Any]) -> tuple[int, int, bool] | None:
    """(query heads, K/V heads, multi-query only) where config.json names both the usual way and the
    model type is one registry family told by its type alone (as `passthrough.kept_by_pooling`);
    else None (Falcon's K/V heads, for one, depend on defaults that live in transformers)."""
    from uptrain.convert.registry.architectures import FAMILIES  # plain data, no torch

    families = [f for f in FAMILIES if raw.get("model_type") in f.model_types]
    if len(families) != 1 or families[0].when or families[0].refuse:
        return None
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    heads, kv = text.get("num_attention_heads"), text.get("num_key_value_heads")
    if type(heads) is int and type(kv) is int and heads > 0 and kv > 0:
        return heads, kv, families[0].mqa_only
    return None


def check_before_imports(args: argparse.Namespace) -> None:
    """UsageError for what the arguments, the file system and a local config.json can tell (module doc)."""
    raw = _local_config(args.checkpoint)
    counts = _head_counts(raw) if raw is not None else None
    if counts is not None:
        heads, kv, mqa_only = counts
        check_kv_heads(args.kv_heads, heads, kv, mqa_only, str(raw.get("model_type", "?")), allow_same=False)
    elif args.kv_heads <= 0:
        raise UsageError(f"--kv-heads must be positive, got {args.kv_heads}")
    if args.calib is not None and not args.calib.exists():
        raise UsageError(f"--calib file {args.calib} does not exist; pass a text file (.txt, .jsonl, .json or "
                         f".parquet)")
    if not args.dry_run:
        check_output_path(args.out, Path(args.checkpoint).expanduser(), args.force)
