"""Writing the output: a streaming safetensors shard writer (the folder: `output_dir`).

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

Write-behind: each shard file starts the writeback of every `_WRITE_BEHIND` bytes it is given and,
`_WRITE_BEHIND_LAG` windows later, waits for that window and drops it from the page cache
(`WriteBehind`, in a helper thread). So the output holds at most about 0.5 GiB of page cache per writer instead of
its whole size: without it, writing a 12 GB output into the page cache beside a 13 GB cached
source forced the kernel to reclaim gigabytes during the copy (the copy thread paid for it, and
source pages it had not copied yet were evicted and read back from the disk), and the final
fsync waited for the last gigabytes. Only the page cache changes: the bytes, and the fsync that
makes them durable (`output_dir`), are the same.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import queue
import sys
import threading
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from uptrain.convert.io.passthrough import SAFE_INDEX, StoredTensor

if TYPE_CHECKING:
    import torch

_CHUNK = 64 * 2**20  # bytes per write() from user space: write() caps one call below 2 GiB on Linux
_COPY_CHUNK = 2**30  # bytes per copy_file_range/sendfile call (no memory involved; fewer GIL hand-offs)
_COPY_STEP = 256 * 2**20  # bytes moved between two write-behind updates (each a return to Python: the GIL)
_WRITE_BEHIND = 64 * 2**20  # bytes per writeback window of a shard file (see WriteBehind)
_WRITE_BEHIND_LAG = 8  # windows in writeback before the oldest is waited for and dropped from the cache
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


def _libc_sync_file_range():
    """libc's sync_file_range (Linux; the os module has none), or None."""
    if not sys.platform.startswith("linux") or not hasattr(os, "posix_fadvise"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4  # linux/fs.h


class WriteBehind:
    """Keeps a file written front to back from filling the page cache (Linux; elsewhere nothing).

    `wrote(end)` after each write: every complete `_WRITE_BEHIND`-byte window is handed to a
    helper thread, which starts its writeback (`sync_file_range(WRITE)`) and, once more than
    `_WRITE_BEHIND_LAG` windows are in flight, waits for the oldest and drops it from the page
    cache (`posix_fadvise(DONTNEED)`; its pages are clean by then). The helper, not the writer,
    waits for the disk (submitting writeback blocks when the device queue is full: measured, the
    copying thread then spent 30% of its time in the block layer). It works on its own duplicate
    of the descriptor and ends after `close()` once its windows are handed over. Nothing here
    makes data durable, and a file system that refuses either call turns it off for this file.
    """

    def __init__(self, fd: int, start: int = 0):
        self.submitted = start  # bytes before this offset have been handed to the helper
        self._queue: queue.SimpleQueue[tuple[int, int] | None] | None = None
        if _SYNC_FILE_RANGE is not None:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._run, args=(os.dup(fd), self._queue), daemon=True,
                             name="uptrain-writeback").start()

    def wrote(self, end: int) -> None:
        """The file now holds `end` bytes."""
        while self._queue is not None and end - self.submitted >= _WRITE_BEHIND:
            self._queue.put((self.submitted, _WRITE_BEHIND))
            self.submitted += _WRITE_BEHIND

    def close(self) -> None:
        """No more windows: the helper finishes the ones it has and closes its descriptor."""
        if self._queue is not None:
            self._queue.put(None)
            self._queue = None

    @staticmethod
    def _run(fd: int, windows: queue.SimpleQueue) -> None:
        pending: deque[tuple[int, int]] = deque()
        working = True
        try:
            while (window := windows.get()) is not None:
                if not working:
                    continue
                try:
                    if _SYNC_FILE_RANGE(fd, *window, _SFR_WRITE) != 0:
                        raise OSError(ctypes.get_errno(), "sync_file_range")
                    pending.append(window)
                    if len(pending) > _WRITE_BEHIND_LAG:
                        offset, nbytes = pending.popleft()
                        if _SYNC_FILE_RANGE(fd, offset, nbytes, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER) != 0:
                            raise OSError(ctypes.get_errno(), "sync_file_range")
                        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
                except OSError:
                    working = False  # only the page cache was at stake: the final fsync still runs
        finally:
            os.close(fd)


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
        self._end = 0  # bytes in the open shard file
        self._behind: WriteBehind | None = None

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
        self._end = 8 + len(raw)
        self._behind = WriteBehind(self._fd)
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

        from uptrain.convert.io.source import DTYPE_NAMES

        self._next(name, tuple(tensor.shape), DTYPE_NAMES[tensor.dtype])
        data = memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        for start in range(0, len(data), _COPY_STEP):
            piece = data[start:start + _COPY_STEP]
            write_all(self._fd, piece)
            self._wrote(len(piece))
        self._position += 1

    def copy(self, spec: StoredTensor, src_fd: int, offset: int) -> None:
        """Append the next planned tensor as `spec.nbytes` raw bytes of `src_fd` from `offset`."""
        self.copy_run([spec], src_fd, offset)

    def copy_run(self, specs: list[StoredTensor], src_fd: int, offset: int) -> None:
        """Append the next planned tensors, stored back to back in `src_fd` from `offset`: one
        kernel copy per output shard they fall in, instead of one per tensor."""
        start = pending = 0  # bytes of the run copied; checked against the plan, not yet copied
        for spec in specs:
            if pending and self._queue[min(self._position, len(self._queue) - 1)][0] != self._open_shard:
                self._copy_bytes(src_fd, offset + start, pending)  # the run goes on in the next shard
                start, pending = start + pending, 0
            self._next(spec.name, spec.shape, spec.dtype)
            self._position += 1
            pending += spec.nbytes
        if pending:
            self._copy_bytes(src_fd, offset + start, pending)

    def _copy_bytes(self, src_fd: int, offset: int, nbytes: int) -> None:
        for start in range(0, nbytes, _COPY_STEP):
            step = min(nbytes - start, _COPY_STEP)
            copy_range(src_fd, self._fd, offset + start, step)
            self._wrote(step)

    def _wrote(self, nbytes: int) -> None:
        self._end += nbytes
        self._behind.wrote(self._end)

    def release(self) -> None:
        """Close the open shard file, if any (after the last tensor, or after an error)."""
        if self._fd is not None:
            if self._behind is not None:  # None: a Ctrl-C came between the shard's open and its helper
                self._behind.close()
            os.close(self._fd)
            self._fd = None
            self._behind = None

    def close(self) -> None:
        """Finish the last shard; an error if any planned tensor is missing."""
        self.release()  # made durable by `atomic_output_dir`, which syncs every file it holds
        if self._position != len(self._queue):
            raise RuntimeError(f"wrote {self._position} of {len(self._queue)} planned tensors")

    def overwrite(self, name: str, tensor: torch.Tensor) -> None:
        """Write `tensor` over the written tensor `name` (closed writer), in place: its name, shape and
        dtype must be those planned. The position is read from the shard's own header."""
        import torch

        from uptrain.convert.io.source import DTYPE_NAMES

        if self._fd is not None or self._position != len(self._queue):
            raise RuntimeError("a tensor is overwritten only once every planned tensor is written and the writer closed")
        shard, spec = next(((i, s) for i, s in self._queue if s.name == name), (None, None))
        if spec is None or (tuple(tensor.shape), DTYPE_NAMES[tensor.dtype]) != (spec.shape, spec.dtype):
            raise RuntimeError(f"tensor {name} {tuple(tensor.shape)} does not match a planned tensor of this writer")
        data = memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        fd = os.open(self.files[shard], os.O_RDWR)
        try:
            size = int.from_bytes(os.pread(fd, 8, 0), "little")
            begin, end = json.loads(os.pread(fd, size, 8))[name]["data_offsets"]
            if end - begin != len(data):
                raise RuntimeError(f"tensor {name}: {len(data)} bytes for a place of {end - begin}")
            at, done = 8 + size + begin, 0
            while done < len(data):
                done += os.pwrite(fd, data[done:done + _CHUNK], at + done)
        finally:
            os.close(fd)

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
