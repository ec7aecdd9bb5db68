"""The conversion pipeline: plan (read headers only), then stream tensors into a new folder.

Streams the source one tensor at a time into new safetensors shards inside a temporary folder
beside DIR, which is renamed to DIR only when everything is written. Two streams at once: the
tensors kept unchanged are copied by the kernel (`passthrough`) while a worker thread builds the
pooled ones; the kept tensors fill the first shards, the built ones the last.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from uptrain.stopping import at_once
from uptrain.convert.layers.calibrate import Calibration
from uptrain.convert.layers.layerwise import GROUP_CANDIDATES, describe_layerwise, fit_refusal, layerwise_settings
from uptrain.convert.layers.refine_layer import LayerRefiner, RefineSettings, check_refine
from uptrain.convert.layers.whole_check import WholeModelCheck
from uptrain.convert.io.passthrough import Phases, StoredRange, copy_beside
from uptrain.convert.io.source import (DTYPE_NAMES, SourceCheckpoint, auxiliary_files, count_hub_bytes, has_weights,
                                    hub_model_id, open_checkpoint, open_hub_headers, read_config, resolve_source)
from uptrain.convert.io.hfconfig import attention_dims, load_hf_config, source_family, target_config
from uptrain.convert.registry.architectures import Family
from uptrain.convert.modelcard import render_model_card, source_card_metadata
from uptrain.convert.plan import ConversionPlan, human_bytes, plan_conversion
from uptrain.convert.progress import layer_progress, sequence_progress, step_lines
from uptrain.convert.io.early import check_kv_heads  # noqa: F401 (also imported from here by the sweep and the demo)
from uptrain.convert.io.output_dir import atomic_output_dir, check_output_path, sync_tree
from uptrain.convert.io.kept_layers import KeptLayers, conversion_key
from uptrain.convert.io.shards import ShardWriter, finish_shards
from uptrain.units import parse_size
from uptrain.convert.tensors import HeadChange, OutputTensor, plan_outputs

RECORD_FILE = "uptrain_conversion.json"


def _open_source(checkpoint: str, revision: str | None, headers_only: bool):
    """(source checkpoint, registry family, a plan note or None): the folder resolved, the model type
    checked before any weights are asked for, and with `headers_only` a Hub id not in the cache
    opened from its safetensors headers (the note says how many bytes that fetched)."""
    remote = headers_only and not Path(checkpoint).expanduser().exists()  # a Hub id
    with count_hub_bytes() if remote else nullcontext([0]) as fetched:
        folder = resolve_source(checkpoint, revision, weights=not remote)
    raw = read_config(folder)
    # The model type first: a type we cannot convert is refused before we ask for its weights.
    family = source_family(raw)
    if not (remote and not has_weights(folder)):
        return open_checkpoint(folder, raw), family, None
    source, header_bytes = open_hub_headers(checkpoint, revision, folder, raw)
    weight_bytes = sum(i.nbytes for i in source.tensors)
    return source, family, (f"read the safetensors headers over HTTP: {human_bytes(fetched[0] + header_bytes)} "
                            f"fetched (config, index, headers); the {human_bytes(weight_bytes)} of weights "
                            f"were not downloaded")


def prepare(checkpoint: str, kv_heads: int, method: str = "mean", seed: int = 0,
            revision: str | None = None, dtype: torch.dtype | None = None, allow_expand: bool = False,
            grouping: str = "contiguous", calibration: Calibration | None = None, headers_only: bool = False,
            refine: RefineSettings | None = None, user: int = 0, allow_same: bool = True,
            progress: Callable[[str], None] | None = None, out: Path | None = None,
            group_candidates: int = GROUP_CANDIDATES) -> tuple[SourceCheckpoint, ConversionPlan, list[OutputTensor], dict]:
    """Resolve and inspect the source and plan the conversion; reads no tensor data.

    headers_only (`--dry-run`): a Hub id not already in the local cache is planned from its
    config and safetensors headers (HTTP range requests), without downloading the weights;
    the plan's notes say how many bytes were fetched. Such a source cannot be written.

    grouping / calibration / group_candidates: see `layerwise` (`--grouping similar`, `--method fit`,
    `--group-candidates`) and `calibrate`; the calibration runs lazily, when the first attention layer
    is written. refine (`--refine`): each layer's closed-form start is refined against the original's attention
    outputs on the calibration text as it is written (`refine_layer`); `fit` where the fit refuses
    this family starts from `mean` instead (the plan says so). user: which of the calibration's
    users this conversion is (`several.convert_counts`: one stream for several K/V counts).

    allow_expand: also accept more K/V heads than the source has (each head repeated in place,
    the same function): how GQA checkpoints become the MHA test fixtures. Not offered on the CLI.
    allow_same: accept the source's own K/V count (the CLI refuses it: nothing to convert).
    progress: where the layer-at-a-time path writes its lines (`show_progress`: per layer, with the time
    left, the refinement's instead of to `refine.log`; inside a layer, the steps and sequences).
    out: the output folder, where the layer-at-a-time path keeps each finished layer beside it for
    a rerun of an interrupted conversion (`io/kept_layers.py`; the plan says what a rerun finds).
    """
    start = time.perf_counter()
    at_once.pause("plan")
    source, family, header_note = _open_source(checkpoint, revision, headers_only)
    cfg = load_hf_config(source.config)
    dims = attention_dims(cfg, family)
    check_kv_heads(kv_heads, dims.heads, dims.kv_heads, family.mqa_only, source.config["model_type"], allow_expand,
                   allow_same)
    full_config = cfg.to_dict() | source.config
    start_method, start_note = method, None
    if refine is not None:
        refine.check()
        check_refine(family, full_config, method, calibration is not None)
        calibration.keep = "layer" if refine.inputs == "converted" else "attention"
        why = fit_refusal(family, full_config, dims.head_dim) if method == "fit" else None
        if why:  # refine runs the family's own attention, so it can start from mean where the fit cannot
            start_method, start_note = "mean", f"refine starts from mean pooling: {why}"
    layerwise = layerwise_settings(family, full_config, dims.heads, dims.kv_heads, dims.head_dim, kv_heads,
                                   start_method, grouping, calibration and calibration.bind(source.path),
                                   refine=refine is not None, user=user, group_candidates=group_candidates)
    new_config = target_config(source.config, cfg, family, kv_heads, dtype)
    refiner = _layer_refiners(layerwise, refine, family, new_config, full_config, calibration, start_method, user)
    measurer = refiner or getattr(layerwise, "chooser", None) or getattr(layerwise, "group_chooser", None)
    show_progress(progress, layerwise, measurer, calibration, dims.layers)
    change = HeadChange(family, dims, kv_heads, start_method, float(getattr(cfg, "initializer_range", 0.02) or 0.02),
                        seed, layerwise)
    outputs = plan_outputs(source.tensors, change, dtype)
    kv_names = {o.spec.name for o in outputs if any(r.match(o.spec.name) for r in family.tensors)}
    kv_dtype = next((o.spec.dtype for o in outputs if o.spec.name in kv_names and o.spec.dtype.is_floating_point),
                    dtype or torch.float32)
    plan = plan_conversion(checkpoint, revision, source.config, family, dims, kv_heads, start_method, seed,
                     sum(i.numel for i in source.tensors), outputs, kv_dtype)
    describe_layerwise(plan, layerwise, calibration, sum(i.numel for i in source.tensors))
    if refiner is not None:
        text = source.config.get("text_config") or source.config
        refiner.record.update(start=start_method, requested_method=method,
                              **refiner.plan(dims, int(text.get("hidden_size", dims.heads * dims.head_dim)), kv_heads))
        plan.refinement = refiner.record  # the same dict: per-layer errors appear as layers are written
        if start_note:
            plan.notes.append(start_note)
    if getattr(layerwise, "checker", None) is not None:
        plan.rewrite = layerwise  # its check's verdict goes into the record once the last layer is converted
    if header_note:
        plan.notes.append(header_note)
    if out is not None and layerwise is not None and header_note is None:  # (not a plan from Hub headers)
        layerwise.kept = keep_layers(out, source, plan, kv_heads, seed, revision, dtype, calibration, refine,
                                     group_candidates)
    plan.timing_s["plan"] = time.perf_counter() - start
    return source, plan, outputs, new_config


# Calibration fields that do not change a layer's tensors: the file (keyed by its facts), what the
# record says, how many users share the stream, what each keeps (follows refine.inputs), the memory
# above which activations are kept in bfloat16 (by default half the memory free at the start: it
# differs from run to run, and a layer kept in the other mode differs by bfloat16 rounding only);
# and the stream's own state (fields named _*).
NOT_LAYER_SETTINGS = {"path", "record", "users", "keep", "activation_limit"}


def layer_settings(kv_heads: int, method: str, grouping: str, seed: int, revision: str | None,
                   dtype: torch.dtype | None, calibration: Calibration | None,
                   refine: RefineSettings | None, group_candidates: int = GROUP_CANDIDATES) -> dict[str, Any]:
    """Every setting a layer-at-a-time conversion's layers depend on, for the kept layers' key: every
    field of the calibration and the refinement but those that cannot change a layer (a new field
    counts until it is named in NOT_LAYER_SETTINGS or has compare=False)."""
    def fields_of(obj: Any, skip: set[str]) -> dict[str, Any] | None:
        if obj is None:
            return None
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
                if f.compare and f.name not in skip and not f.name.startswith("_")}
    return {"kv_heads": kv_heads, "method": method, "grouping": grouping, "seed": seed, "revision": revision,
            "group_candidates": group_candidates if grouping == "similar" and calibration is not None else 1,
            "dtype": str(dtype), "calibration": fields_of(calibration, NOT_LAYER_SETTINGS),
            "refine": fields_of(refine, set())}


def keep_layers(out: Path, source: SourceCheckpoint, plan: ConversionPlan, kv_heads: int, seed: int,
                revision: str | None, dtype: torch.dtype | None, calibration: Calibration | None,
                refine: RefineSettings | None, group_candidates: int = GROUP_CANDIDATES) -> KeptLayers:
    """Where this layer-at-a-time conversion keeps its finished layers (`io/kept_layers.py`), with the
    plan's notes on what an interrupted run with the same arguments, or with others, left there."""
    settings = layer_settings(kv_heads, plan.method, plan.grouping, seed, revision, dtype, calibration, refine,
                              group_candidates)
    kept = KeptLayers.beside(out, conversion_key(source.path, (i.file for i in source.tensors), settings,
                                          calibration.path if calibration is not None else None))
    found = kept.indices()
    plan.kept_layers = {"folder": str(kept.folder), "found": found}
    if found:
        plan.notes.append(f"continues an interrupted conversion: layer{'s' * (len(found) > 1)} {_spans(found)} of "
                          f"{plan.dims.layers} kept in {kept.folder}, taken as made (the calibration still "
                          f"runs through them)")
    for other in kept.others():
        plan.notes.append(f"{other} holds layers of an interrupted conversion with other arguments: rerun "
                          f"those to continue it, or delete it")
    return kept


def _spans(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)


def _layer_refiners(layerwise: Any, refine: RefineSettings | None, family: Family, new_config: dict[str, Any],
                    full_config: dict[str, Any], calibration: Any, start_method: str, user: int) -> LayerRefiner | None:
    """`--refine`'s `LayerRefiner` (None without it), set on `layerwise`; and, behind a key norm with
    --calib, the chooser of each layer's start (the fit's or mean pooling's: issue 50), the refiner
    itself where there is one; with --grouping similar and --calib, the measurer of each layer's
    candidate groupings (`layer_outputs._grouping_chosen`), the same object where there is one."""
    refiner, chooses = None, start_method == "fit" and calibration is not None and family.key_norm_in(full_config)
    groupings = (calibration is not None and layerwise is not None and layerwise.grouping == "similar"
                 and layerwise.group_candidates > 1)
    text_config = load_hf_config(new_config).get_text_config() if refine is not None or chooses or groupings else None
    if refine is not None:
        refiner = LayerRefiner(refine, family, text_config, calibration, user=user)
        layerwise.refiner = refiner
    if chooses:
        layerwise.chooser = refiner or LayerRefiner(RefineSettings(), family, text_config, calibration, user=user)
        if refiner is None:  # the start is the result: the whole model is checked too (`whole_check`)
            calibration.keep = "all"  # the attention's inputs and outputs to measure both starts on, the layer to run
            layerwise.checker = WholeModelCheck(calibration, text_config, family, text_config.num_hidden_layers,
                                                user=user)
    if groupings:  # each layer's candidate groupings measured on the calibration text (`_grouping_chosen`)
        layerwise.group_chooser = layerwise.chooser or refiner or LayerRefiner(RefineSettings(), family, text_config,
                                                                              calibration, user=user)
        if calibration.keep == "moments":
            calibration.keep = "attention"  # the attention's inputs and outputs, to measure the starts on
    return refiner


def show_progress(progress: Callable[[str], None] | None, layerwise: Any, refiner: LayerRefiner | None,
                  calibration: Any, layers: int) -> None:
    """`prepare`'s progress: a line per layer converted (`layerwise.on_layer`) and, ~10 s apart, lines
    inside a layer: the refinement's steps and the calibration pass's sequences (a sweep's handles on
    a shared stream stay silent: one stream for several counts)."""
    if progress is None or layerwise is None:
        return
    layerwise.on_layer = log = layer_progress(layers, progress)  # every line through it: the heartbeat hears them
    if refiner is not None:
        refiner.progress = lambda index: step_lines(index, log.note)
        refiner.phases = log.phase
    if isinstance(calibration, Calibration):
        calibration.progress = lambda what, total: sequence_progress(what, total, log.note)


@dataclass
class Planned:
    """A planned conversion (what `prepare` returns) and, once written, the shards of the tensors it builds."""

    source: SourceCheckpoint
    plan: ConversionPlan
    outputs: list[OutputTensor]
    new_config: dict
    built: ShardWriter | None = None


def copied_as_bytes(output: OutputTensor) -> bool:
    """Whether an output is an unchanged safetensors tensor: copied byte for byte, never read."""
    return output.unchanged and output.sources[0].offset is not None


def kept_ranges(outputs: list[OutputTensor]) -> list[StoredRange]:
    """The outputs copied byte for byte (unchanged safetensors tensors), in (file, offset) order."""
    kept = [StoredRange(o.spec.name, o.spec.shape, DTYPE_NAMES[o.spec.dtype], o.sources[0].file, o.sources[0].offset)
            for o in outputs if copied_as_bytes(o)]
    return sorted(kept, key=lambda t: (str(t.file), t.offset))


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside the block (process-wide), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_outputs(tmp: Path, source: SourceCheckpoint, plan: ConversionPlan, outputs: list[OutputTensor],
                  kept_names: set[str], max_shard_bytes: int, phases: Phases, cancel: threading.Event
                  ) -> ShardWriter:
    """Build every output not in `kept_names` (read its sources, pool) and write it into `built-*`
    shards in plan order, one tensor in memory at a time; stops unfinished once `cancel` is set.
    Unchanged ones among them (K/V heads kept as they are) are copied as bytes here too.

    Plain pooling (no `--method fit`, contiguous groups) is a few additions per byte: it runs on
    all cores but one, which is left to the kernel's copy and writeback beside it (on 2 cores,
    measured on Llama-2-7B shapes: 2 pooling threads made the conversion 10-20% slower).
    """
    built = [o for o in outputs if o.spec.name not in kept_names]
    writer = ShardWriter(tmp, [o.spec.stored() for o in built], max_shard_bytes, stem="built")
    plain = plan.method != "fit" and plan.grouping == "contiguous"
    threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) - 1)) if plain else torch.get_num_threads()
    try:
        with _torch_threads(threads):
            for output in built:
                if cancel.is_set():
                    return writer
                at_once.pause("write")
                at_once.check()
                if copied_as_bytes(output):
                    info = output.sources[0]
                    with phases("write built"), open(info.file, "rb") as f:
                        writer.copy(output.spec.stored(), f.fileno(), info.offset)
                    continue
                tensor = _made(source, output, phases)
                with phases("write built"):
                    writer.write(output.spec.name, tensor)
                del tensor
        writer.close()
        write_mean_if_closer(writer, source, plan, phases)
    finally:
        writer.release()
    return writer


def write_mean_if_closer(writer: ShardWriter, source: SourceCheckpoint, plan: ConversionPlan, phases: Phases) -> None:
    """Where the whole-model check found mean pooling's start closer to the source than the starts
    chosen per layer (`whole_check`), write mean pooling's over them, tensor by tensor in place
    (same names, shapes and dtypes), while the output is still the temporary folder."""
    layerwise = plan.rewrite
    verdict = getattr(getattr(layerwise, "checker", None), "verdict", None)
    if verdict is None:
        return
    plan.whole_model = verdict
    if verdict["written"] != "mean":
        return
    for output in layerwise.mean_outputs:
        at_once.check()
        tensor = _made(source, output, phases)
        with phases("write built"):
            writer.overwrite(output.spec.name, tensor)


def _made(source: SourceCheckpoint, output: OutputTensor, phases: Phases) -> torch.Tensor:
    """One output tensor made from its source tensors (read, then pooled), in its planned dtype."""
    with phases("read"):
        tensors = [source.read(s) for s in output.sources]
    with phases("pool"):
        return output.make(tensors).to(output.spec.dtype)


def write_tensors(tmp: Path, planned: Planned, max_shard_bytes: int, phases: Phases) -> list[ShardWriter]:
    """Both streams of a planned conversion: this thread copies the kept tensors while a worker
    builds the others (the kernel's copy and torch's pooling both release the GIL)."""
    kept = kept_ranges(planned.outputs)
    writer = ShardWriter(tmp, kept, max_shard_bytes, stem="kept")
    names = {t.name for t in kept}
    built = copy_beside(kept, writer, phases, lambda cancel: build_outputs(
        tmp, planned.source, planned.plan, planned.outputs, names, max_shard_bytes, phases, cancel))
    return [writer, built]


def plan_and_build(tmp: Path, kept: list[StoredRange], max_shard_bytes: int, phases: Phases,
                   cancel: threading.Event, on_planned: Callable[[ConversionPlan], None],
                   **prepare_args: Any) -> Planned:
    """`prepare`, then build what is not in `kept` (being copied meanwhile by another thread).

    `kept` was guessed from the headers alone (`passthrough.kept_by_pooling`). Only if the plan
    copies every one of those tensors unchanged, byte range for byte range, are the others built
    here; otherwise `built` stays None and the caller discards the copy and writes the plan.
    """
    planned = Planned(*prepare(**prepare_args))
    if cancel.is_set():  # the copy failed meanwhile
        return planned
    on_planned(planned.plan)
    if set(kept) <= set(kept_ranges(planned.outputs)):
        planned.built = build_outputs(tmp, planned.source, planned.plan, planned.outputs, {t.name for t in kept},
                                      max_shard_bytes, phases, cancel)
    return planned


def finish_folder(tmp: Path, planned: Planned, writers: list[ShardWriter], phases: Phases,
                  copied_while_planning: bool = False) -> None:
    """Name the shards, add config, tokenizer files, card and record, and make everything durable.

    writers: [kept (copied) tensors, built tensors].
    """
    finish_shards(tmp, writers)
    source, plan = planned.source, planned.plan
    kept, built = ([spec for shard in w.shards for spec in shard] for w in writers)
    plan.streams = {"kept_tensors": len(kept), "kept_bytes": sum(t.nbytes for t in kept),
                    "built_tensors": len(built), "built_bytes": sum(t.nbytes for t in built),
                    "copied_while_planning": copied_while_planning}
    with phases("write"):
        for path in auxiliary_files(source.path):
            shutil.copyfile(path, tmp / path.name)
        (tmp / "config.json").write_text(json.dumps(planned.new_config, indent=2) + "\n")
        card = render_model_card(plan, source_card_metadata(source.path / "README.md"),
                                 hub_model_id(plan.source, source.path))
        (tmp / "README.md").write_text(card, encoding="utf-8")
    with phases("fsync"):  # the weights; the record below is synced with the folder on exit
        sync_tree(tmp)
    plan.timing_s = {k: round(v, 3) for k, v in {**plan.timing_s, **phases.seconds}.items()}
    plan.timing_s["wall"] = round(phases.elapsed(), 3)
    (tmp / RECORD_FILE).write_text(json.dumps(plan.record(), indent=2, default=str) + "\n")


def write_converted(source: SourceCheckpoint, plan: ConversionPlan, outputs: list[OutputTensor],
                    new_config: dict, out: Path, max_shard_bytes: int, phases: Phases | None = None,
                    replace: bool = True) -> None:
    """Stream the outputs into `out` (all or nothing) with config, tokenizer files, card and record
    (replace: an `out` that appeared meanwhile may be replaced, `atomic_output_dir`).

    Phase times (seconds; `phases`, started by the caller, or here) go into `plan.timing_s` and
    the record: copy (unchanged tensors, byte ranges moved by the kernel), wait for build (the
    copy done, waiting for the worker), write (config, tokenizer, card), fsync (all files made
    durable) run one after the other; read (opening source tensors: safetensors are mapped, so
    their pages are read in during pool), pool and write built run in the worker beside the
    copy, and so do import and plan where the CLI starts the copy before planning. wall: the
    whole, from the start of `phases`.
    """
    phases = phases or Phases()
    planned = Planned(source, plan, outputs, new_config)
    kept = KeptLayers(plan.kept_layers["folder"]) if plan.kept_layers else None
    at_once.leaving(kept.describe if kept is not None else None)  # a stop says what a rerun continues from
    with atomic_output_dir(out, replace) as tmp:
        finish_folder(tmp, planned, write_tensors(tmp, planned, max_shard_bytes, phases), phases)
    at_once.leaving(None)
    if kept is not None:  # the output is in place: its layers need not be kept any longer
        kept.remove()


def convert(checkpoint: str, out: Path, kv_heads: int, method: str = "mean", *, seed: int = 0,
            revision: str | None = None, dtype: torch.dtype | None = None, max_shard_size: str = "5GB",
            force: bool = False, allow_expand: bool = False, grouping: str = "contiguous",
            calibration: Calibration | None = None, refine: RefineSettings | None = None,
            group_candidates: int = GROUP_CANDIDATES) -> ConversionPlan:
    """Convert `checkpoint` into `out` with `kv_heads` K/V heads; the Python API behind the CLI."""
    phases = Phases()
    max_shard = parse_size(max_shard_size)
    source, plan, outputs, new_config = prepare(checkpoint, kv_heads, method, seed, revision, dtype, allow_expand,
                                                grouping, calibration, refine=refine, out=out,
                                                group_candidates=group_candidates)
    check_output_path(out, source.path, force)
    write_converted(source, plan, outputs, new_config, out, max_shard, phases, replace=force)
    return plan
