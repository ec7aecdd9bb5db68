"""Writing the output: a streaming safetensors shard writer and an all-or-nothing output folder.

safetensors' own `save_file` needs every tensor of a shard in memory at once. Here the output
layout (names, shapes, dtypes) is known before any data is read, so each shard's header is
written first and tensors are streamed into it one at a time: peak memory is one tensor, not
one shard. The files are standard safetensors (8-byte header length, JSON header, raw data),
read back by `safetensors.safe_open` in the tests.

A conversion writes two streams at once, each with its own `ShardWriter`: the tensors it keeps
(byte ranges copied by the kernel) and the tensors it builds (pooled K/V). `finish_shards` then
names all their files `model-0000i-of-0000N.safetensors` and writes the index. Standard library
only (torch is imported by `ShardWriter.write` when it is first given a tensor), so the copy
can start before torch is imported.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from uptrain.convert.passthrough import SAFE_INDEX, StoredTensor
from uptrain.errors import UsageError

if TYPE_CHECKING:
    import torch

_CHUNK = 64 * 2**20  # bytes per write() from user space: write() caps one call below 2 GiB on Linux
_COPY_CHUNK = 2**30  # bytes per copy_file_range/sendfile call (no memory involved; fewer GIL hand-offs)
# copy_file_range/sendfile errors that mean "not between these files", not "failed": fall back
_NO_FAST_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.ETXTBSY}


def write_all(fd: int, data: memoryview) -> None:
    """Write every byte of `data` to `fd` (os.write may write fewer bytes than asked)."""
    data = data.cast("B")
    while data:
        data = data[os.write(fd, data[:_CHUNK]):]


def copy_range(src_fd: int, dst_fd: int, offset: int, nbytes: int) -> None:
    """Append `nbytes` of `src_fd` from `offset` to `dst_fd`, without passing them through Python.

    os.copy_file_range (Linux >= 4.5; the kernel copies, or shares blocks on CoW filesystems),
    else os.sendfile (Linux), else pread/write in 64 MiB chunks (any platform).
    """
    done = 0
    for fast in ("copy_file_range", "sendfile"):
        if not hasattr(os, fast):
            continue
        try:
            while done < nbytes:
                n = (os.copy_file_range(src_fd, dst_fd, min(nbytes - done, _COPY_CHUNK), offset + done)
                     if fast == "copy_file_range" else
                     os.sendfile(dst_fd, src_fd, offset + done, min(nbytes - done, _COPY_CHUNK)))
                if n == 0:
                    raise OSError(errno.EIO, f"source ended {nbytes - done} bytes early")
                done += n
            return
        except OSError as err:
            if err.errno not in _NO_FAST_COPY:
                raise
    while done < nbytes:
        chunk = os.pread(src_fd, min(nbytes - done, _CHUNK), offset + done)
        if not chunk:
            raise OSError(errno.EIO, f"source ended {nbytes - done} bytes early")
        write_all(dst_fd, memoryview(chunk))
        done += len(chunk)


def plan_shards(specs: list[StoredTensor], max_shard_bytes: int) -> list[list[StoredTensor]]:
    """Split tensors, in order, into shards of at most max_shard_bytes (a bigger tensor gets its own)."""
    shards: list[list[StoredTensor]] = []
    size = 0
    for spec in specs:
        if not shards or (shards[-1] and size + spec.nbytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


class ShardWriter:
    """Streams tensors into pre-planned safetensors shards `{stem}-0000i.safetensors` in `folder`.

    Call `write` (a tensor) or `copy` (its bytes from another file) once per planned tensor, in
    plan order; `close` checks that all were written; `finish_shards` gives the files their
    final names and writes the index.
    """

    def __init__(self, folder: Path, specs: list[StoredTensor], max_shard_bytes: int,
                 metadata: dict[str, str] | None = None, stem: str = "shard"):
        self.folder = folder
        self.shards = plan_shards(specs, max_shard_bytes)
        self.metadata = {"format": "pt", **(metadata or {})}
        self.files = [folder / f"{stem}-{i + 1:05d}.safetensors" for i in range(len(self.shards))]
        self._queue = [(i, spec) for i, shard in enumerate(self.shards) for spec in shard]
        self._position = 0
        self._fd: int | None = None
        self._open_shard = -1

    def _start_shard(self, index: int) -> None:
        self.release()
        header: dict[str, object] = {"__metadata__": self.metadata}
        offset = 0
        for spec in self.shards[index]:
            header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self._fd = os.open(self.files[index], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        write_all(self._fd, memoryview(len(raw).to_bytes(8, "little") + raw))
        self._open_shard = index

    def _next(self, name: str, shape: tuple[int, ...], dtype: str) -> None:
        """Check the next planned tensor against (name, shape, dtype) and open its shard."""
        if self._position == len(self._queue):
            raise RuntimeError(f"tensor {name} is one more than the {len(self._queue)} planned")
        shard, spec = self._queue[self._position]
        if (name, shape, dtype) != (spec.name, spec.shape, spec.dtype):
            raise RuntimeError(f"tensor {name} {shape} {dtype} does not match the "
                               f"plan {spec.name} {spec.shape} {spec.dtype}")
        if shard != self._open_shard:
            self._start_shard(shard)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next planned tensor; its name, shape and dtype must match the plan."""
        import torch

        from uptrain.convert.source import DTYPE_NAMES

        self._next(name, tuple(tensor.shape), DTYPE_NAMES[tensor.dtype])
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        write_all(self._fd, memoryview(data))
        self._position += 1

    def copy(self, spec: StoredTensor, src_fd: int, offset: int) -> None:
        """Append the next planned tensor as `spec.nbytes` raw bytes of `src_fd` from `offset`."""
        self._next(spec.name, spec.shape, spec.dtype)
        copy_range(src_fd, self._fd, offset, spec.nbytes)
        self._position += 1

    def release(self) -> None:
        """Close the open shard file, if any (after the last tensor, or after an error)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Finish the last shard; an error if any planned tensor is missing."""
        self.release()  # made durable by `atomic_output_dir`, which syncs every file it holds
        if self._position != len(self._queue):
            raise RuntimeError(f"wrote {self._position} of {len(self._queue)} planned tensors")

    def discard(self) -> None:
        """Close and delete whatever this writer wrote."""
        self.release()
        for file in self.files:
            file.unlink(missing_ok=True)


def finish_shards(folder: Path, writers: list[ShardWriter]) -> None:
    """Rename the closed writers' files, in order, to `model-0000i-of-0000N.safetensors` (one file:
    `model.safetensors`) and write `model.safetensors.index.json`."""
    files = [file for w in writers for file in w.files]
    names = ([f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
             if len(files) > 1 else ["model.safetensors"])
    final = dict(zip(files, names))
    weight_map: dict[str, str] = {}
    for w in writers:
        for shard, file in zip(w.shards, w.files):
            file.rename(folder / final[file])
            weight_map.update({spec.name: final[file] for spec in shard})
    total = sum(spec.nbytes for w in writers for shard in w.shards for spec in shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def check_output_path(out: Path, source: Path, force: bool) -> None:
    """Refuse an output that would touch the source or replace something without --force.

    First finishes a replacement of `out` that a killed run left half done (`recover_output`), so
    that what exists is judged as it will be.
    """
    out, source = out.resolve(), source.resolve()
    if out == source or out.is_relative_to(source):
        raise UsageError(f"output {out} is inside the source checkpoint {source}; choose a folder outside it")
    if source.is_relative_to(out):
        raise UsageError(f"the source checkpoint {source} is inside output {out}; choose another output")
    recover_output(out)
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


# Hidden siblings of an output folder DIR, each `.DIR.<kind>-PID-HEX` (PID: the process that made it):
#   partial   being written; after an exchange, the old output being removed: always garbage once its process is gone
#   complete  written and fsynced, waiting for the two-step swap: the new output
#   old       the previous DIR, moved aside by the two-step swap
_KINDS = ("partial", "complete", "old")


def _sibling(out: Path, kind: str, tag: str) -> Path:
    return out.parent / f".{out.name}.{kind}-{tag}"


def _leftovers(out: Path, kind: str) -> list[Path]:
    """`kind` siblings of `out` whose process is gone (an `old` folder without a PID, left by
    versions before the PID was added to its name, counts as gone), oldest first."""
    found = []
    for path in out.parent.glob(f".{glob.escape(out.name)}.{kind}-*"):
        pid = path.name[len(out.name) + len(kind) + 3:].split("-")[0]
        if path.is_dir() and not path.is_symlink() and not (pid.isdigit() and _pid_alive(int(pid))):
            found.append(path)
    return sorted(found, key=lambda p: p.stat().st_mtime_ns)


def recover_output(out: Path) -> None:
    """Finish what a killed run left half done for output `out`; folders of live processes are left alone.

    Without `out`: the newest complete new folder is renamed into place, else the old output is
    restored. Then every leftover (partial, complete, old) of a dead process is deleted.
    """
    out = out.resolve()
    if not out.parent.is_dir():
        return
    for path in _leftovers(out, "partial"):  # unfinished, or an old output already swapped out
        shutil.rmtree(path, ignore_errors=True)
    if not out.exists() and not out.is_symlink():
        restore = (_leftovers(out, "complete") or _leftovers(out, "old"))[-1:]
        for path in restore:
            try:
                path.rename(out)
                fsync_path(out.parent)
            except OSError:  # another run restored it first, or `out` appeared meanwhile
                pass
    for kind in ("complete", "old"):
        for path in _leftovers(out, kind):
            shutil.rmtree(path, ignore_errors=True)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
# renameat2 errors that mean "no exchange here" (old kernel, filesystem without it), not "failed"
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV}


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step: renameat2(RENAME_EXCHANGE), Linux >= 3.15 with
    glibc >= 2.28, on filesystems that support it (ext4, xfs, btrfs, tmpfs, ...). False, with
    nothing changed, where there is none (another OS, older glibc, a filesystem without it)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


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
    """Yield a temporary folder beside `out`; it becomes `out` only if the block completes.

    On any error (disk full, a bad tensor, Ctrl-C) the temporary folder is removed and `out` is
    untouched. Every file and the folder are fsynced before the folder is put in place, and the
    parent folder after each rename, so even across a power loss or a SIGKILL `out` ends as the
    old state or the complete new folder:

    - no `out` yet: one rename;
    - an existing `out` (--force): one atomic exchange of the two folders where the OS has one
      (`exchange_paths`), then the old one is removed; else two renames, with the new folder
      first marked complete (`.NAME.complete-*`) so that a run killed between them is finished by
      `recover_output`, which the next run for `out` calls (here and in `check_output_path`).

    A run killed while writing leaves a hidden `.NAME.partial-PID-*` folder, which the next run removes.
    """
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_output(out)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = _sibling(out, "partial", tag)
    tmp.mkdir()
    try:
        yield tmp
        sync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not out.exists() and not out.is_symlink():
        tmp.rename(out)
        fsync_path(out.parent)
        return
    if exchange_paths(tmp, out):  # `tmp` now holds the old output
        fsync_path(out.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    complete, old = _sibling(out, "complete", tag), _sibling(out, "old", tag)
    tmp.rename(complete)
    fsync_path(out.parent)  # marked complete on disk before `out` moves
    out.rename(old)
    try:
        complete.rename(out)
    except BaseException:
        old.rename(out)
        shutil.rmtree(complete, ignore_errors=True)
        raise
    fsync_path(out.parent)
    shutil.rmtree(old, ignore_errors=True)
