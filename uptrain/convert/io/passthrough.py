"""Tensors a conversion keeps byte for byte: listed from safetensors headers, copied by the kernel.

Standard library only (no torch, no transformers): `python -m uptrain.convert` lists and starts
copying these tensors at once, while another thread imports torch and transformers (seconds)
and plans the conversion. A safetensors file is `u64 header length | JSON header | data`; the
header gives every tensor's dtype, shape and byte range, which is all a copy needs.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from uptrain.stopping import at_once  # standard library only
from uptrain.convert.registry.architectures import FAMILIES  # plain data, no torch

T = TypeVar("T")

SAFE_INDEX = "model.safetensors.index.json"
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class StoredTensor:
    """A tensor as a safetensors header describes it: name, shape, dtype name ("BF16")."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class StoredRange(StoredTensor):
    """A stored tensor and where its bytes are: `file`, from absolute byte `offset`."""

    file: Path = Path()
    offset: int = 0


def read_header(file: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the byte offset where its data starts;
    ValueError when the file is too short for the header it announces."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > os.fstat(f.fileno()).st_size - 8:
            raise ValueError(f"{file.name}: a {n}-byte header does not fit in the file")
        return json.loads(f.read(n)), 8 + n


def _file_tensors(file: Path) -> list[StoredRange] | None:
    """The tensors of one file in data order, or None when its header does not add up."""
    try:
        header, start = read_header(file)
        size = file.stat().st_size
        tensors = []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            t = StoredRange(name, tuple(int(d) for d in entry["shape"]), entry["dtype"], file, start + begin)
            if end - begin != t.nbytes or start + end > size:
                return None
            tensors.append(t)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # not a readable safetensors file
        return None
    return sorted(tensors, key=lambda t: t.offset)


def stored_tensors(folder: Path) -> list[StoredRange] | None:
    """Every tensor of the folder's safetensors weights (through the index when there is one),
    file by file in data order; None when there are none or a header does not add up (the full
    reader, `source.open_checkpoint`, then says what is wrong)."""
    index = folder / SAFE_INDEX
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({Path(os.path.normpath(folder / shard)) for shard in weight_map.values()})
            if any(f.parent != Path(os.path.normpath(folder)) for f in files):
                return None
        else:
            weight_map, files = None, sorted(folder.glob("*.safetensors"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    tensors: list[StoredRange] = []
    for file in files:
        found = _file_tensors(file)
        if found is None:
            return None
        tensors += [t for t in found if weight_map is None or weight_map.get(t.name) == file.name]
    return tensors or None


def kept_by_pooling(folder: Path, config: dict[str, Any]) -> list[StoredRange] | None:
    """The tensors that pooling (`--method` mean, first or random, contiguous groups, dtypes kept)
    copies unchanged: all but the registry family's K/V tensors, in (file, offset) order.

    None when config.json and the headers alone cannot tell: the model type has several registry
    entries told apart by config values whose defaults live in transformers (Falcon,
    GPTBigCode), is not in the registry, or the weights are not readable safetensors. The plan
    made with transformers has the last word: `pipeline` checks every tensor named here against it.
    """
    families = [f for f in FAMILIES if config.get("model_type") in f.model_types]
    if len(families) != 1 or families[0].when or families[0].refuse:
        return None
    tensors = stored_tensors(folder)
    if tensors is None:
        return None
    return [t for t in tensors if not any(rule.match(t.name) for rule in families[0].tensors)]


def contiguous_runs(tensors: list[StoredRange]) -> list[list[StoredRange]]:
    """The tensors, in order, grouped into runs that are stored back to back in one file (a run
    is copied with one kernel call: on Llama-2-7B shapes the 227 kept tensors are 35 runs)."""
    runs: list[list[StoredRange]] = []
    for t in tensors:
        last = runs[-1][-1] if runs else None
        if last is not None and last.file == t.file and last.offset + last.nbytes == t.offset:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


def copy_tensors(tensors: list[StoredRange], copy: Callable[[list[StoredRange], int], None],
                 should_stop: Callable[[], bool] = lambda: False) -> bool:
    """Call `copy(run, fd of its file)` for each run of `contiguous_runs(tensors)` in turn (each
    source file opened once).

    Stops early, returning False, as soon as `should_stop()` says so between runs.
    """
    fds: dict[Path, int] = {}
    try:
        for run in contiguous_runs(tensors):
            if should_stop():
                return False
            file = run[0].file
            if file not in fds:
                fds[file] = os.open(file, os.O_RDONLY)
            copy(run, fds[file])
        return True
    finally:
        for fd in fds.values():
            os.close(fd)


class Phases:
    """Seconds spent per phase, summed over calls and threads: `with phases("copy"): ...`;
    `elapsed()`: seconds since it was made."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.started = time.perf_counter()
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


class RangeWriter(Protocol):
    """What `copy_beside` needs of a `shards.ShardWriter`."""

    def copy_run(self, specs: list[StoredTensor], src_fd: int, offset: int) -> None: ...
    def close(self) -> None: ...
    def release(self) -> None: ...


def copy_beside(tensors: list[StoredRange], writer: RangeWriter, phases: Phases,
                job: Callable[[threading.Event], T]) -> T:
    """Copy `tensors` into `writer` in this thread while `job(cancel)` runs in a worker; return
    what the job returns.

    If the job fails, the copy stops at the next tensor and the job's error is raised. If this
    thread fails (a full disk), `cancel` is set and the job, which checks it between tensors, is
    waited for before the error goes on, so nothing writes into a removed folder. On Ctrl-C
    (KeyboardInterrupt: the Python API) `at_once.CANCEL` is set too, so the job also stops
    inside a layer, at its next `at_once.check()` (refinement step, calibration sequence).
    """
    cancel = threading.Event()
    pool = ThreadPoolExecutor(1, thread_name_prefix="uptrain-build")
    future = pool.submit(job, cancel)

    def copy(run: list[StoredRange], fd: int) -> None:
        at_once.pause("copy")
        with phases("copy"):
            writer.copy_run(run, fd, run[0].offset)
    try:
        if copy_tensors(tensors, copy, lambda: future.done() and future.exception() is not None):
            writer.close()
        with phases("wait for build"):
            return future.result()
    except BaseException as err:
        cancel.set()
        stopping = isinstance(err, KeyboardInterrupt)
        if stopping:  # the API's Ctrl-C (the CLI's ends the process in `at_once`): stop the job's layer now
            at_once.CANCEL.set()
        try:
            wait([future])
        finally:
            if stopping:
                at_once.CANCEL.clear()
        raise
    finally:
        pool.shutdown(wait=False)
        writer.release()
