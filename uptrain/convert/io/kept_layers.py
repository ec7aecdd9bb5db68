"""Finished layers kept beside the output, so that a rerun of an interrupted conversion continues
from the last finished layer instead of starting again.

A conversion with `--method fit`, `--grouping similar` or `--refine` makes its attention layers one
at a time (`layers/layerwise.py`); refining one layer of a 7B model on a CPU takes an hour. Each
layer, once made, is written at once to `.DIR.layers-KEY/layer-00012.safetensors` beside the
output DIR: under a temporary name, fsynced, then renamed, so a file there is always a whole
layer. The folder is made with the first layer and removed once DIR is in place.

KEY (`conversion_key`) is a hash of everything a layer's tensors depend on: the source's config
and every file of the source folder and its weight files (names, sizes, modification times: the
tokenizer's too, which the calibration reads), the K/V count, method, grouping, seed, output
dtype, the calibration text (its content; over 256 MiB: path, size, modification time), every calibration and refinement
setting (`pipeline.layer_settings`), uptrain's code (`uptrain.code_fingerprint`, a hash of its
files) and the versions of torch and transformers. A rerun with the
same arguments finds the folder and takes its layers as they are (the calibration stream still
runs through them: later layers need its statistics and activations); other arguments give
another KEY, and the plan names the folder they left.

What a kept layer holds: the layer's output tensors exactly as the conversion made them (keys
"q.weight", "o.weight", "norm:<name>", ...), with `--refine-inputs converted` also the refined
attention module's float32 parameters ("student:<name>", which advance the converted activations
exactly as an uninterrupted run does), and a JSON note (the refinement's record row, the head
order of `--grouping similar`, the clamp's activity for clip_qkv, the errors each measured choice of
grouping or start was made by). Standard library, torch and
safetensors only; no model code.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from uptrain.stopping import at_once

LAYER_FILE = re.compile(r"^layer-(\d{5})\.safetensors$")


def _file_facts(path: Path) -> list[Any]:
    """What identifies a file's content without reading it: resolved path, size, modification time."""
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


CONTENT_HASH_LIMIT = 256 << 20  # a calibration text up to this size is keyed by its content


def _text_identity(path: Path) -> list[Any]:
    """A calibration text by its content (the same text rewritten, as the demo does on a rerun, is the
    same text); a larger one by its facts, not read whole for a key."""
    if path.stat().st_size > CONTENT_HASH_LIMIT:
        return _file_facts(path)
    return ["sha256", hashlib.sha256(path.read_bytes()).hexdigest()]


def conversion_key(source_dir: Path, weight_files: Iterable[Path], settings: dict[str, Any],
                   calib_file: Path | None) -> str:
    """A 16-hex-digit hash of a layer-at-a-time conversion's inputs (see the module doc).

    settings: the conversion's arguments that change its layers (K/V count, method, grouping, seed,
    dtype, calibration tokens/unit/device, refinement settings), JSON-serialisable values."""
    import transformers

    from uptrain import code_fingerprint

    weights = {Path(f).resolve() for f in weight_files}
    source_files = [p for p in Path(source_dir).iterdir() if p.is_file() and not p.name.startswith(".")]
    parts = {
        "config": (Path(source_dir) / "config.json").read_text(encoding="utf-8"),
        # the source's other files (tokenizer, generation config) by content: an edit that keeps the size and
        # the date (a copy that preserves dates) is another source; the weights by their facts, not read for a key
        "files": sorted([p.name, *_text_identity(p)] for p in source_files if p.resolve() not in weights),
        "weights": sorted(_file_facts(f) for f in weights),
        "calib": _text_identity(Path(calib_file)) if calib_file is not None else None,
        "settings": settings,
        "versions": [code_fingerprint(), torch.__version__, transformers.__version__],
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _as_os_error(err: BaseException, path: Path) -> BaseException:
    """safetensors reports a failed write (a full disk, a quota) as its own error type with the OS
    error's number in its message: as an OSError, so it reads as the system's refusal it is."""
    found = re.search(r"os error (\d+)", str(err))
    if isinstance(err, OSError) or not found:
        return err
    code = int(found[1])
    return OSError(code, os.strerror(code), str(path))


class KeptLayers:
    """The kept layers of one conversion, in `folder` (made on the first `save`)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    @classmethod
    def beside(cls, out: Path, key: str) -> "KeptLayers":
        """Those of the conversion with `key` into output `out`: `.OUT.layers-KEY` beside it."""
        out = Path(out).absolute()
        return cls(out.parent / f".{out.name}.layers-{key}")

    def indices(self) -> list[int]:
        """The layers kept, in order (temporary files of an interrupted write are not layers)."""
        if not self.folder.is_dir():
            return []
        return sorted(int(m[1]) for p in self.folder.iterdir() if (m := LAYER_FILE.match(p.name)))

    def others(self) -> list[Path]:
        """Kept-layer folders beside the same output left by conversions with other arguments."""
        stem = self.folder.name.rsplit("-", 1)[0]  # '.OUT.layers'
        return sorted(p for p in self.folder.parent.glob(f"{glob.escape(stem)}-*") if p.is_dir() and p != self.folder)

    def _path(self, index: int) -> Path:
        return self.folder / f"layer-{index:05d}.safetensors"

    def load(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """Layer `index`'s tensors (as saved, on the CPU) and its note, or None if it is not kept.

        A file that cannot be read as a kept layer (damaged on the disk, or by hand) is removed and
        None returned: the layer is made again, as if it had never been kept."""
        from safetensors import safe_open

        path = self._path(index)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                tensors = {name: f.get_tensor(name) for name in f.keys()}
                note = json.loads((f.metadata() or {}).get("uptrain", "{}"))
        except Exception:  # noqa: BLE001 - safetensors' own error type, a bad header, bad JSON: all "not a layer"
            path.unlink(missing_ok=True)
            return None
        return tensors, note

    def save(self, index: int, tensors: dict[str, torch.Tensor], note: dict[str, Any]) -> None:
        """Keep layer `index`: written under a temporary name, fsynced, renamed into place (whole or absent)."""
        from safetensors.torch import save_file

        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(index)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp),
                      metadata={"uptrain": json.dumps(note, default=str)})
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            at_once.pause(f"keeping-written-{index}")  # test hook: a kill between the write and the rename
            os.replace(tmp, path)
        except BaseException as err:
            tmp.unlink(missing_ok=True)
            system = _as_os_error(err, tmp)
            if system is err:
                raise
            raise system from err
        directory = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def remove(self) -> None:
        """Forget the kept layers (the output they were for is in place)."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def describe(self) -> str:
        """What a stopped run leaves here, for its one line ('' when no layer is kept yet)."""
        kept = self.indices()
        if not kept:
            return ""
        return (f"{len(kept)} finished layer{'s' if len(kept) != 1 else ''} kept in {self.folder}: the same command "
                f"continues from there")
