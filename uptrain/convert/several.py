"""Several K/V counts from one read of the source and one calibration pass (`uptrain.sweep`).

The calibration statistics and the original model's activations do not depend on the K/V count,
nor do the source tensors: converting to N counts one after another would read the checkpoint N
times and run the calibration stream N times. Here each count is an ordinary conversion
(`pipeline.prepare` + `pipeline.write_tensors`), each in its own thread, into a hidden folder beside
its output; the folders take their places together once every count is complete (all or none).
The N conversions share

- one calibration stream (`Calibration.share(N)`: each count reads it through its own handle,
  with its own keep and threads; `layers/schedule.py` is the contract): each layer runs once; a
  layer is freed once every count has moved past it, so the counts advance layer by layer together
  and memory stays one original layer plus each count's student;
- one read of each source tensor the conversions build from (`SharedReads`): the first count to
  ask reads it, the others take the same tensor, and it is dropped after the last.

The kept tensors (MLP, embeddings) are copied byte for byte by the kernel into each folder, as a
single conversion copies them (a write per folder; the source pages are read once into the page
cache and then served from it while it holds them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from uptrain.convert.io.output_dir import atomic_output_dirs, check_output_path
from uptrain.convert.io.passthrough import Phases
from uptrain.convert.io.source import SourceCheckpoint, TensorInfo
from uptrain.convert.layers.calibrate import Calibration
from uptrain.convert.layers.layerwise import GROUP_CANDIDATES
from uptrain.convert.layers.refine_layer import RefineSettings
from uptrain.convert.pipeline import Planned, copied_as_bytes, finish_folder, kept_ranges, prepare, write_tensors
from uptrain.convert.plan import ConversionPlan
from uptrain.errors import UsageError
from uptrain.units import parse_size


class SharedReads:
    """A source checkpoint whose tensors several conversions read once between them.

    `expect(keys)` registers one conversion's reads (before any conversion reads); `read(info)`
    reads a tensor the first time it is asked for and hands the same tensor to the others, keeping
    it only until the last expected reader took it. Everything else is the source's.
    """

    def __init__(self, source: SourceCheckpoint):
        self._source, self._lock = source, threading.Lock()
        self._left: dict[tuple[str, str], int] = {}
        self._held: dict[tuple[str, str], torch.Tensor] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    @staticmethod
    def key(info: TensorInfo) -> tuple[str, str]:
        return str(info.file), info.name

    def expect(self, infos: list[TensorInfo]) -> None:
        with self._lock:
            for info in infos:
                self._left[self.key(info)] = self._left.get(self.key(info), 0) + 1

    def read(self, info: TensorInfo) -> torch.Tensor:
        key = self.key(info)
        with self._lock:  # one reader at a time: a tensor is never read twice because two asked at once
            tensor = self._held.get(key)
            if tensor is None:
                tensor = self._source.read(info)
            left = self._left.get(key, 1) - 1
            if left > 0:
                self._left[key], self._held[key] = left, tensor
            else:
                self._left.pop(key, None)
                self._held.pop(key, None)
        return tensor


def built_reads(planned: Planned) -> list[TensorInfo]:
    """The source tensors a conversion reads to build its outputs (what `build_outputs` reads:
    the sources of outputs that are neither kept byte ranges nor copied as bytes among the built)."""
    kept = {t.name for t in kept_ranges(planned.outputs)}
    return [s for o in planned.outputs if o.spec.name not in kept and not copied_as_bytes(o) for s in o.sources]


def _check(outs: dict[int, Path], calibration: Calibration | None) -> None:
    if not outs:
        raise UsageError("no K/V counts to convert")
    if calibration is not None and calibration.record.get("passes"):
        raise ValueError("convert_counts needs a calibration that has not run yet")


def _labelled(refine: RefineSettings | None, count: int) -> RefineSettings | None:
    """`refine` whose per-layer lines name the count they belong to (the counts refine side by side)."""
    if refine is None or refine.log is None:
        return refine
    log = refine.log
    return replace(refine, log=lambda line: log(f"kv{count}: {line}"))


def convert_counts(checkpoint: str, outs: dict[int, Path], method: str = "mean", *, seed: int = 0,
                   dtype: torch.dtype | None = None, max_shard_size: str = "5GB", force: bool = False,
                   grouping: str = "contiguous", calibration: Calibration | None = None,
                   refine: RefineSettings | None = None,
                   on_planned: Callable[[dict[int, ConversionPlan]], None] | None = None,
                   extra_files: dict[str, str] | None = None,
                   progress: Callable[[int, str], None] | None = None,
                   group_candidates: int = GROUP_CANDIDATES) -> dict[int, ConversionPlan]:
    """Convert `checkpoint` to each K/V count `n` into `outs[n]` (as `convert` would, one folder
    each), with one calibration pass and one read of each source tensor for all of them.

    All or nothing across the counts (`atomic_output_dirs`): each count is written into a hidden
    folder beside its output, and only when every count is complete do they all take their place;
    a failure in any count (or in putting one in place) stops them all and leaves every output as
    it was. on_planned: called with every count's plan once all are planned, before any tensor is
    read (the sweep prints its estimate). extra_files: name -> text written into every folder
    (the sweep's ownership mark). progress: called with (count, line) for each layer a count has
    converted on the layer-at-a-time path (`prepare`'s progress: the layers done and the time left,
    the refinement's line in it). group_candidates: `--group-candidates` (`prepare`). Returns each
    count's plan (its record: `plan.record()`).
    """
    _check(outs, calibration)  # --refine without --calib: prepare's one-line error, as for one count
    max_shard = parse_size(max_shard_size)
    counts = list(outs)
    users = calibration.share(len(counts)) if calibration is not None else [None] * len(counts)
    for handle in users:  # every count's layer runs at the threads the counts start with, whoever starts one
        if handle is not None:
            handle.threads = torch.get_num_threads()
    planned: dict[int, Planned] = {}
    errors: list[BaseException] = []
    # every count's reads are registered before any count reads; then the caller sees the plans
    ready = threading.Barrier(len(counts), action=lambda: on_planned and on_planned(
        {n: planned[n].plan for n in counts}))
    shared: list[SharedReads] = []
    lock = threading.Lock()

    def one(user: int, count: int, tmp: Path) -> None:
        try:
            source, plan, outputs, new_config = prepare(
                checkpoint, count, method, seed, None, dtype, False, grouping, users[user],
                refine=_labelled(refine, count), user=user, group_candidates=group_candidates,
                progress=None if progress is None else lambda line, k=count: progress(k, line))
            check_output_path(outs[count], source.path, force)
            plan.notes.append(f"converted together with K/V counts {', '.join(map(str, counts))}: one read of the "
                              f"source{' and one calibration stream' if calibration else ''} for all")
            with lock:  # the first count's source object reads for all
                if not shared:
                    shared.append(SharedReads(source))
            job = planned[count] = Planned(shared[0], plan, outputs, new_config)
            shared[0].expect(built_reads(job))
            ready.wait()
            phases = Phases()
            finish_folder(tmp, job, write_tensors(tmp, job, max_shard, phases), phases)
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
        except BaseException as err:  # noqa: BLE001 (raised below, after every thread has stopped)
            errors.append(err)
            ready.abort()
            if users[user] is not None:
                users[user].leave(failed=f"K/V count {count}: {type(err).__name__}: {err}")
            return
        if users[user] is not None:
            users[user].leave()

    with atomic_output_dirs([outs[n] for n in counts], replace=force) as tmps:
        _run_threads([threading.Thread(target=one, args=(u, n, tmps[u]), name=f"convert-kv{n}")
                      for u, n in enumerate(counts)])
        if errors:  # the first cause: a one-line usage error where there is one, not a broken barrier
            raise next((e for e in errors if isinstance(e, UsageError)),
                       next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0]))
    return {n: planned[n].plan for n in counts}


def _run_threads(threads: list[threading.Thread]) -> None:
    """Start and join `threads`, torch's thread count as it was after (each conversion's writing sets
    and restores it, `pipeline.build_outputs`, and torch's count is one for the process)."""
    torch_threads = torch.get_num_threads()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(torch_threads)
