"""Writing the output: a streaming safetensors shard writer and an all-or-nothing output folder.

safetensors' own `save_file` needs every tensor of a shard in memory at once. Here the output
layout (names, shapes, dtypes) is known before any data is read, so each shard's header is
written first and tensors are streamed into it one at a time: peak memory is one tensor, not
one shard. The files are standard safetensors (8-byte header length, JSON header, raw data),
read back by `safetensors.safe_open` in the tests.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from uptrain.convert.source import SAFE_INDEX, SAFETENSORS_DTYPES, TensorSpec
from uptrain.errors import UsageError

_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split tensors, in order, into shards of at most max_shard_bytes (a bigger tensor gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


class ShardWriter:
    """Streams tensors into pre-planned safetensors shards and writes the HF index at the end.

    Call `write` once per planned tensor, in plan order; `close` checks that all were written.
    """

    def __init__(self, folder: Path, specs: list[TensorSpec], max_shard_bytes: int,
                 metadata: dict[str, str] | None = None):
        self.folder = folder
        self.shards = plan_shards(specs, max_shard_bytes)
        self.metadata = {"format": "pt", **(metadata or {})}
        n = len(self.shards)
        self.file_names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
                           for i in range(n)]
        self._queue = [(i, spec) for i, shard in enumerate(self.shards) for spec in shard]
        self._position = 0
        self._handle = None
        self._open_shard = -1

    def _start_shard(self, index: int) -> None:
        if self._handle:
            self._handle.close()
        header: dict[str, object] = {"__metadata__": self.metadata}
        offset = 0
        for spec in self.shards[index]:
            header[spec.name] = {"dtype": _DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self._handle = open(self.folder / self.file_names[index], "wb")
        self._handle.write(len(raw).to_bytes(8, "little"))
        self._handle.write(raw)
        self._open_shard = index

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next planned tensor; its name, shape and dtype must match the plan."""
        shard, spec = self._queue[self._position]
        if (name, tuple(tensor.shape), tensor.dtype) != (spec.name, spec.shape, spec.dtype):
            raise RuntimeError(f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} does not match the "
                               f"plan {spec.name} {spec.shape} {spec.dtype}")
        if shard != self._open_shard:
            self._start_shard(shard)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._handle.write(memoryview(data))
        self._position += 1

    def close(self) -> None:
        """Finish the last shard and write `model.safetensors.index.json`."""
        if self._position != len(self._queue):
            raise RuntimeError(f"wrote {self._position} of {len(self._queue)} planned tensors")
        if self._handle:  # made durable by `atomic_output_dir`, which syncs every file it holds
            self._handle.close()
        weight_map = {spec.name: self.file_names[i] for i, spec in self._queue}
        total = sum(spec.nbytes for _, spec in self._queue)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.folder / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def check_output_path(out: Path, source: Path, force: bool) -> None:
    """Refuse an output that would touch the source or replace something without --force."""
    out, source = out.resolve(), source.resolve()
    if out == source or out.is_relative_to(source):
        raise UsageError(f"output {out} is inside the source checkpoint {source}; choose a folder outside it")
    if source.is_relative_to(out):
        raise UsageError(f"the source checkpoint {source} is inside output {out}; choose another output")
    if out.exists() and not force:
        raise UsageError(f"output {out} already exists; pass --force to replace it or choose another folder")
    if out.exists() and not out.is_dir():
        raise UsageError(f"output {out} is a file; choose a folder path")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(out: Path) -> None:
    """Delete temporary folders for `out` left by killed runs (their process is gone)."""
    for stale in out.parent.glob(f".{out.name}.partial-*"):
        pid = stale.name.rsplit("-", 2)[-2]
        if stale.is_dir() and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's data and metadata to the disk.

    Folders cannot be opened for fsync on Windows; there the folder step is skipped (NTFS
    journals the rename itself).
    """
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) * path.is_dir()
    try:
        fd = os.open(path, flags)
    except (IsADirectoryError, PermissionError):
        if path.is_dir():
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(folder: Path) -> None:
    """fsync every file under `folder`, then every folder, deepest first, `folder` last."""
    folders = []
    for root, _, names in os.walk(folder):
        folders.append(Path(root))
        for name in names:
            fsync_path(Path(root) / name)
    for sub in reversed(folders):
        fsync_path(sub)


@contextmanager
def atomic_output_dir(out: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; rename it to `out` only if the block completes.

    On any error (disk full, a bad tensor, Ctrl-C) the temporary folder is removed and `out`
    is untouched. An existing `out` is swapped out only after the new one is complete. A run
    killed outright (SIGKILL) leaves only a hidden `.NAME.partial-PID-*` folder, which the next
    run for the same output removes. Across a power loss too: every file and the folder are
    fsynced before the rename, and the parent folder after it, so after a crash `out` is either
    the old state or the complete new folder.
    """
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        sync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        out.rename(old)
    tmp.rename(out)
    fsync_path(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
