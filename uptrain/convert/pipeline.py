"""The conversion pipeline: plan (read headers only), then stream tensors into a new folder.

Streams the source one tensor at a time into new safetensors shards inside a temporary folder
beside DIR, which is renamed to DIR only when everything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from uptrain.convert.architectures import family_for
from uptrain.convert.calibrate import Calibration
from uptrain.convert.layerwise import describe_layerwise, layerwise_settings
from uptrain.convert.source import (SourceCheckpoint, auxiliary_files, count_hub_bytes, has_weights, hub_model_id,
                                    open_checkpoint, open_hub_headers, read_config, resolve_source)
from uptrain.errors import UsageError
from uptrain.convert.hfconfig import attention_dims, load_hf_config, target_config
from uptrain.convert.modelcard import render_model_card, source_card_metadata
from uptrain.convert.plan import ConversionPlan, human_bytes, plan_conversion
from uptrain.convert.heads import divisors
from uptrain.convert.shards import ShardWriter, atomic_output_dir, check_output_path, sync_tree
from uptrain.units import parse_size
from uptrain.convert.tensors import HeadChange, OutputTensor, plan_outputs

RECORD_FILE = "uptrain_conversion.json"


def prepare(checkpoint: str, kv_heads: int, method: str = "mean", seed: int = 0,
            revision: str | None = None, dtype: torch.dtype | None = None, allow_expand: bool = False,
            grouping: str = "contiguous", calibration: Calibration | None = None, headers_only: bool = False
            ) -> tuple[SourceCheckpoint, ConversionPlan, list[OutputTensor], dict]:
    """Resolve and inspect the source and plan the conversion; reads no tensor data.

    headers_only (`--dry-run`): a Hub id not already in the local cache is planned from its
    config and safetensors headers (HTTP range requests), without downloading the weights;
    the plan's notes say how many bytes were fetched. Such a source cannot be written.

    grouping / calibration: see `layerwise` (`--grouping similar`, `--method fit`) and `calibrate`;
    the calibration runs lazily, when the first attention layer is written.

    allow_expand: also accept more K/V heads than the source has (each head repeated in place,
    the same function): how GQA checkpoints become the MHA test fixtures. Not offered on the CLI.
    """
    start = time.perf_counter()
    remote = headers_only and not Path(checkpoint).expanduser().exists()  # a Hub id
    with count_hub_bytes() if remote else nullcontext([0]) as fetched:
        folder = resolve_source(checkpoint, revision, weights=not remote)
    raw = read_config(folder)
    # The model type first: a type we cannot convert is refused before we ask for its weights.
    family = family_for(load_hf_config(raw).to_dict() | raw)
    header_note = None
    if remote and not has_weights(folder):
        source, header_bytes = open_hub_headers(checkpoint, revision, folder, raw)
        weight_bytes = sum(i.nbytes for i in source.tensors)
        header_note = (f"read the safetensors headers over HTTP: {human_bytes(fetched[0] + header_bytes)} fetched "
                       f"(config, index, headers); the {human_bytes(weight_bytes)} of weights "
                       f"were not downloaded")
    else:
        source = open_checkpoint(folder, raw)
    cfg = load_hf_config(source.config)
    dims = attention_dims(cfg, family)
    valid = [1, dims.kv_heads] if family.mqa_only else divisors(dims.kv_heads)
    if allow_expand and not family.mqa_only:
        valid = sorted(set(valid) | {k for k in divisors(dims.heads) if k % dims.kv_heads == 0})
    if kv_heads not in valid:
        if kv_heads <= 0:
            problem = f"--kv-heads must be positive, got {kv_heads}"
        elif kv_heads > dims.kv_heads:
            problem = (f"the checkpoint has {dims.kv_heads} K/V heads ({dims.heads} query heads); "
                       f"pooling cannot make {kv_heads}")
        elif family.mqa_only:
            problem = f"{source.config['model_type']} can only be multi-query (one K/V head)"
        else:
            problem = f"{kv_heads} does not divide the {dims.kv_heads} K/V heads"
        raise UsageError(f"{problem}; valid --kv-heads: {', '.join(map(str, valid))}")
    layerwise = layerwise_settings(cfg.to_dict() | source.config, dims.heads, dims.kv_heads, dims.head_dim,
                                   kv_heads, method, grouping, calibration and calibration.bind(source.path))
    change = HeadChange(family, dims, kv_heads, method, float(getattr(cfg, "initializer_range", 0.02) or 0.02), seed,
                        layerwise)
    outputs = plan_outputs(source.tensors, change, dtype)
    kv_names = {o.spec.name for o in outputs if any(r.match(o.spec.name) for r in family.tensors)}
    kv_dtype = next((o.spec.dtype for o in outputs if o.spec.name in kv_names and o.spec.dtype.is_floating_point),
                    dtype or torch.float32)
    plan = plan_conversion(checkpoint, revision, source.config, family, dims, kv_heads, method, seed,
                     sum(i.numel for i in source.tensors), outputs, kv_dtype)
    describe_layerwise(plan, layerwise, calibration, sum(i.numel for i in source.tensors))
    if header_note:
        plan.notes.append(header_note)
    new_config = target_config(source.config, cfg, family, kv_heads, dtype)
    plan.timing_s["plan"] = time.perf_counter() - start
    return source, plan, outputs, new_config


class Phases:
    """Seconds spent per phase, summed over calls: `with phases("read"): ...`."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds = seconds

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def _write_tensors(source: SourceCheckpoint, outputs: list[OutputTensor], writer: ShardWriter,
                   phases: Phases) -> None:
    """Unchanged safetensors tensors are copied as bytes (kernel to kernel); the rest are built
    from their source tensors (read, then pool) and written.

    The next tensor to build is built in a worker thread while the kernel copies the unchanged
    tensors before it (both release the GIL), so pooling overlaps the byte copy; at most one
    built tensor waits ahead of the writer.
    """
    def copied(o: OutputTensor) -> bool:
        return o.unchanged and o.sources[0].offset is not None

    def build(output: OutputTensor) -> torch.Tensor:
        with phases("read"):
            tensors = [source.read(s) for s in output.sources]
        with phases("pool"):
            return output.make(tensors).to(output.spec.dtype)

    to_build = iter([o for o in outputs if not copied(o)])
    fds: dict[Path, int] = {}
    with ThreadPoolExecutor(1, thread_name_prefix="uptrain-pool") as pool:
        ahead = None  # (output, future) of the next tensor to build
        try:
            for output in outputs:
                if ahead is None:
                    following = next(to_build, None)
                    ahead = None if following is None else (following, pool.submit(build, following))
                info = output.sources[0]
                if copied(output):
                    with phases("copy"):
                        if info.file not in fds:
                            fds[info.file] = os.open(info.file, os.O_RDONLY)
                        writer.copy(output.spec, fds[info.file], info.offset)
                    continue
                assert ahead is not None and ahead[0] is output
                with phases("wait for pool"):
                    tensor = ahead[1].result()
                ahead = None
                with phases("write"):
                    writer.write(output.spec.name, tensor)
                del tensor
            writer.close()
        finally:
            if ahead is not None:
                ahead[1].cancel()
            writer.release()
            for fd in fds.values():
                os.close(fd)


def write_converted(source: SourceCheckpoint, plan: ConversionPlan, outputs: list[OutputTensor],
                    new_config: dict, out: Path, max_shard_bytes: int) -> None:
    """Stream the outputs into `out` (all or nothing) with config, tokenizer files, card and record.

    Phase times (seconds) go into `plan.timing_s` and the record: plan, copy (unchanged tensors,
    byte ranges moved by the kernel), read (opening source tensors: safetensors are mapped, so
    their pages are read in during pool), pool (in a worker thread, beside the copy), wait for
    pool (the writer idle until the next built tensor is ready), write, fsync (all files made
    durable). read + pool overlap copy, so the phases add up to more than the wall time.
    """
    phases = Phases(plan.timing_s)
    with atomic_output_dir(out) as tmp:
        _write_tensors(source, outputs, ShardWriter(tmp, [o.spec for o in outputs], max_shard_bytes), phases)
        with phases("write"):
            for path in auxiliary_files(source.path):
                shutil.copyfile(path, tmp / path.name)
            (tmp / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
            card = render_model_card(plan, source_card_metadata(source.path / "README.md"),
                                     hub_model_id(plan.source, source.path))
            (tmp / "README.md").write_text(card, encoding="utf-8")
        with phases("fsync"):  # the weights; the record below is synced with the folder on exit
            sync_tree(tmp)
        plan.timing_s = {k: round(v, 3) for k, v in plan.timing_s.items()}
        (tmp / RECORD_FILE).write_text(json.dumps(plan.record(), indent=2, default=str) + "\n")


def convert(checkpoint: str, out: Path, kv_heads: int, method: str = "mean", *, seed: int = 0,
            revision: str | None = None, dtype: torch.dtype | None = None, max_shard_size: str = "5GB",
            force: bool = False, allow_expand: bool = False, grouping: str = "contiguous",
            calibration: Calibration | None = None) -> ConversionPlan:
    """Convert `checkpoint` into `out` with `kv_heads` K/V heads; the Python API behind the CLI."""
    max_shard = parse_size(max_shard_size)
    source, plan, outputs, new_config = prepare(checkpoint, kv_heads, method, seed, revision, dtype, allow_expand,
                                                grouping, calibration)
    check_output_path(out, source.path, force)
    write_converted(source, plan, outputs, new_config, out, max_shard)
    return plan
