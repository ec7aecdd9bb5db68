"""A layer-at-a-time conversion's outputs: every attention tensor of a layer made from all of that
layer's attention tensors, read once with the layer's first output, in numeric layer order.

`rewrite_outputs` replaces the planned (per-tensor) attention outputs by ones that take from a
per-layer cache (`_LayerCache`): the layer is made once (`_convert_layer`: kept by an interrupted
run, else its start by `layerwise.transform_layer`, refined where `--refine` asks, and kept at
once: `io/kept_layers.py`), then dropped as its outputs are taken (memory stays near one layer).
Layers are built in numeric order, so that the calibration stream holds layer L's original module
and inputs when layer L is refined. The tensor math is `layerwise.py`'s; this is the plumbing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch

from uptrain.stopping import at_once
from uptrain.convert.layers.calibrate import layer_index
from uptrain.convert.layers.fit_start import clip_note
from uptrain.convert.layers.layerwise import GROUP_SEQUENCES, Layerwise, candidate_orders, transform_layer
from uptrain.convert.registry.architectures import Family
from uptrain.errors import UsageError


class _LayerCache:
    """One layer's converted tensors: computed from the layer's source tensors, which only the
    layer's first output carries (so each is read once), and forgotten after the last is taken."""

    def __init__(self, compute: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                 keys: list[str], wanted: set[str], layer: str):
        self.compute, self.keys, self.remaining, self.layer = compute, keys, set(wanted), layer
        self.result: dict[str, torch.Tensor] | None = None

    def take(self, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.result is None:
            if len(tensors) != len(self.keys):  # outputs must be built in plan order
                raise RuntimeError(f"{self.layer}{key} was built before the first output of its layer")
            self.result = self.compute(dict(zip(self.keys, tensors)))
        out = self.result.pop(key)
        self.remaining.discard(key)
        if not self.remaining:
            self.result = None
        return out


def rewrite_outputs(outputs: list, infos: list, change) -> list:
    """Replace the attention outputs of a planned conversion by layer-at-a-time ones.

    outputs: `OutputTensor`s as planned for mean pooling (names, shapes and dtypes are right);
    infos: the source tensors; change: the `HeadChange` (with `.layerwise` set).
    """
    from dataclasses import replace

    d, settings, attention = change.dims, change.layerwise, change.family.attention
    layers: dict[str, dict[str, Any]] = {}
    for info in infos:
        p = attention.match(info.name)
        if p:
            layers.setdefault(p.layer, {})[f"{p.role}.{p.param}"] = info
    if len(layers) != d.layers:
        raise UsageError(f"found attention projections in {len(layers)} of {d.layers} layers; "
                         f"the layer-at-a-time conversion does not know this checkpoint's tensor names")
    layout = change.family.qkv_layout[0] if change.family.qkv_layout else None
    # --refine trains the key norms that carry K/V heads (StableLM, Cohere, OLMo-2) with the layer, and
    # the fit merges keys behind them with their weights: their outputs join the layer's computation
    norms: dict[str, dict[str, Any]] = {}  # layer -> {"norm:<name inside the attention>": planned output}
    if settings.refiner is not None or (change.method == "fit" and settings.key_norm in ("per_head", "whole")):
        for output in outputs:
            layer = _norm_layer(output.spec.name, change.family)
            if layer in layers:
                norms.setdefault(layer, {})["norm:" + output.spec.name[len(layer):]] = output
    caches: dict[str, _LayerCache] = {}
    sources_of: dict[str, list] = {}
    first_layer = min(layers, key=layer_index)
    for layer, parts in layers.items():
        keys = sorted(parts)
        if not {"o.weight"} <= set(keys) or not ({"q.weight", "k.weight", "v.weight"} <= set(keys)
                                                   or "qkv.weight" in keys):
            raise UsageError(f"layer {layer.rstrip('.')} lacks some of its q/k/v/o projections")
        layer_norms = norms.get(layer, {})
        norm_keys = [f"{k}#{j}" for k, o in layer_norms.items() for j in range(len(o.sources))]
        sources_of[layer] = [parts[k] for k in keys] + [o.sources[j] for o in layer_norms.values()
                                                         for j in range(len(o.sources))]
        compute = partial(_convert_layer, layer=layer, layer_norms=layer_norms, change=change, layout=layout,
                          first=layer == first_layer, layers=len(layers))
        caches[layer] = _LayerCache(compute, keys + norm_keys, set(keys) | set(layer_norms), layer)
    if settings.checker is not None:  # mean pooling's start of every layer, written where the check says
        settings.mean_outputs = _mean_outputs(outputs, change, layers, sources_of, norms, layout)
    result = []
    started: set[str] = set()
    for output in outputs:
        p = attention.match(output.spec.name)
        layer = p.layer if p else _norm_layer(output.spec.name, change.family)
        if layer not in caches or (not p and layer not in norms):
            result.append(output)
            continue
        key = f"{p.role}.{p.param}" if p else "norm:" + output.spec.name[len(layer):]
        cache = caches[layer]
        # The layer's first output reads all its tensors; the others take from the cache.
        sources = () if layer in started else tuple(sources_of[layer])
        started.add(layer)
        result.append(replace(output, sources=sources,
                              make=lambda ts, cache=cache, key=key: cache.take(key, ts),
                              unchanged=False))  # rewritten: never a byte copy of its source
    return _in_layer_order(result, change.family)


def _convert_layer(ts: dict[str, torch.Tensor], layer: str, layer_norms: dict[str, Any], change, layout: str | None,
                   first: bool, layers: int) -> dict[str, torch.Tensor]:
    """One layer's outputs (`_LayerCache.compute`): kept by an interrupted run with the same arguments
    (`settings.kept`, `io/kept_layers.py`), else made (`_make_layer`) and kept at once."""
    settings, index = change.layerwise, layer_index(layer)
    if first and settings.on_layer is not None and hasattr(settings.on_layer, "begin"):
        settings.on_layer.begin()  # the time left counts from the first layer, not from the start
    found = settings.kept.load(index) if settings.kept is not None else None
    if found is not None:
        done = _kept_layer(found, layer, index, settings, layers)
        if settings.checker is not None:  # the kept start is the chosen one; mean pooling's made again
            mean = _start(ts, layer, layer_norms, _without_calibration(change), layout, "mean")
            _check_whole(settings, layer, done, mean)
        return done
    done, check = _make_layer(ts, layer, layer_norms, change, layout, layers)
    if settings.kept is not None:
        refiner = settings.refiner
        student = getattr(refiner, "last_state", None) or {}
        note = {"head_order": settings.permutations.get(layer), "clip_seen": settings.clip_seen.get(layer),
                "refine": (refiner.record.get("layers") or [None])[-1] if refiner is not None else None,
                "grouping_choice": settings.group_choice.get(index), "start_choice": settings.chosen.get(index)}
        at_once.pause(f"keeping-{index}")
        settings.kept.save(index, {**done, **{f"student:{k}": v for k, v in student.items()}}, note)
        at_once.pause(f"kept-{index}")
    if settings.on_layer is not None:
        chosen = settings.chosen.get(index)
        settings.on_layer(getattr(settings.refiner, "last_line", "") or (
            f"layer {index} converted ({change.method}; start: {'the fit' if chosen['start'] == 'fit' else 'mean pooling'}"
            f"'s, calibration error {chosen['fit']:.4f} fit, {chosen['mean']:.4f} mean)" if chosen
            else f"layer {index} converted ({change.method})"))
    if check is not None:  # after the layer's line
        _check_whole(settings, layer, *check)
    return done


def _kept_layer(found: tuple[dict[str, torch.Tensor], dict[str, Any]], layer: str, index: int,
                settings: Layerwise, layers: int) -> dict[str, torch.Tensor]:
    """A layer an interrupted run kept: its tensors as they were made, the calibration stream taken
    past it as making it would (its moments, the refiner's layer and converted activations), and
    what the plan records of it (head order, the clamp's activity, the refinement's row, the measured
    grouping and start choices) put back."""
    tensors, note = found
    student = {k[len("student:"):]: v for k, v in tensors.items() if k.startswith("student:")}
    done = {k: v for k, v in tensors.items() if not k.startswith("student:")}
    if settings.sigma is not None:
        settings.sigma(layer)  # taken and dropped: the stream frees a layer once its users took its moments
    if note.get("head_order") is not None:
        settings.permutations[layer] = note["head_order"]
    if note.get("clip_seen") is not None:
        settings.clip_seen[layer] = tuple(note["clip_seen"])
    if settings.refiner is not None:
        settings.refiner.replay(layer, student, note.get("refine") or {})
    for key, measured, note_of in (("grouping_choice", settings.group_choice, grouping_note),
                                   ("start_choice", settings.chosen, chosen_note)):
        if note.get(key) is not None:  # what was measured when the layer was made: the record and notes keep it
            measured[index] = note[key]
            if len(measured) == layers and settings.notes is not None:
                settings.notes.append(note_of(measured))
    if settings.clip_qkv and len(settings.clip_seen) == layers and settings.notes is not None:
        settings.notes.append(clip_note(settings.clip_seen, settings.clip_qkv, settings.sigma is not None))
    if settings.on_layer is not None:
        line = getattr(settings.refiner, "last_line", "") or f"layer {index} kept from the interrupted run"
        kept = getattr(settings.on_layer, "kept", None)
        (kept or settings.on_layer)(line)
    return done


def _make_layer(ts: dict[str, torch.Tensor], layer: str, layer_norms: dict[str, Any], change, layout: str | None,
                layers: int) -> tuple[dict[str, torch.Tensor], tuple[dict, dict] | None]:
    """One layer made: its start (`_start`; behind a key norm with --calib the fit's or mean pooling's,
    whichever the calibration text says is closer: `Layerwise.chooser`), refined where `--refine` asks."""
    settings, check = change.layerwise, None
    choosing = settings.chooser is not None and change.method == "fit"
    if (choosing or settings.group_chooser is not None) and settings.sigma is not None:
        sigma = settings.sigma(layer)  # taken once, read by every start (a sweep's user takes it once)
        change = replace(change, layerwise=replace(settings, sigma=lambda _: sigma))
    if settings.group_chooser is not None and not settings.orders_fixed:
        change, start = _grouping_chosen(ts, layer, layer_norms, change, layout, layers)
    else:
        start = _start(ts, layer, layer_norms, change, layout, change.method)
    if settings.chooser is not None and change.method == "fit":
        mean = _start(ts, layer, layer_norms, change, layout, "mean")
        picked = settings.chooser.choose(layer, {"fit": start, "mean": mean})
        if picked is not None:
            settings.chosen[layer_index(layer)] = {**picked[1], "start": picked[0]}
            start = mean if picked[0] == "mean" else start
        if settings.chosen and len(settings.chosen) == layers and settings.notes is not None:
            settings.notes.append(chosen_note(settings.chosen))
        if picked is not None and settings.checker is not None:
            check = (start, mean)  # the chosen start and mean pooling's, for the whole-model check
    done = settings.refiner(layer, start) if settings.refiner is not None else start
    if settings.clip_qkv and len(settings.clip_seen) == layers and settings.notes is not None:
        settings.notes.append(clip_note(settings.clip_seen, settings.clip_qkv, settings.sigma is not None))
    return done, check


def _grouping_chosen(ts: dict[str, torch.Tensor], layer: str, layer_norms: dict[str, Any], change, layout: str | None,
                     layers: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """`--grouping similar` with --calib: the layer's start made in each candidate head order
    (`candidate_orders`) and the one with the lowest output error on the calibration text kept
    (`Layerwise.group_chooser`; the first, the similarity's best, where nothing was measured);
    (`change` with the head order fixed, that start). The order goes into `permutations`, the errors
    into `group_choice` and, after the last layer, the plan's notes."""
    settings, d = change.layerwise, change.dims
    projections = {k: v for k, v in ts.items() if not k.startswith("norm:")}
    orders = candidate_orders(projections, d.heads, d.kv_heads, change.new_kv_heads, change.method, settings,
                              layer, layout, settings.group_candidates)
    fixed = replace(change, layerwise=replace(settings, orders_fixed=True))  # the same dicts: permutations, clip_seen
    starts, clipped = [], []
    for order in orders:
        settings.permutations[layer] = order
        starts.append(_start(ts, layer, layer_norms, fixed, layout, change.method))
        clipped.append(settings.clip_seen.get(layer))
    picked = (settings.group_chooser.choose(layer, dict(enumerate(starts)), "the candidate groupings'",
                                            GROUP_SEQUENCES) if len(orders) > 1 else None)
    best = picked[0] if picked is not None else 0
    settings.permutations[layer] = orders[best]
    if clipped[best] is not None:
        settings.clip_seen[layer] = clipped[best]
    settings.group_choice[layer_index(layer)] = {
        "errors": [picked[1][i] for i in range(len(orders))] if picked is not None else None, "chosen": best}
    if len(settings.group_choice) == layers and settings.notes is not None:
        settings.notes.append(grouping_note(settings.group_choice))
    return fixed, starts[best]


def grouping_note(choice: dict[int, dict[str, Any]]) -> str:
    """The plan's note on the head groupings measured per layer (`_grouping_chosen`)."""
    moved = [i for i, c in sorted(choice.items()) if c["chosen"] != 0]
    errors = "; ".join(f"{i}: {'/'.join(f'{e:.4g}' for e in c['errors']) if c['errors'] else 'one candidate'}"
                       for i, c in sorted(choice.items()))
    which = (f"another than the similarity's best on layer{'s' if len(moved) > 1 else ''} {', '.join(map(str, moved))}"
             if moved else "the similarity's best on every layer")
    return (f"head grouping chosen per layer among the candidates by the start's output error on "
            f"the calibration text (layer: the candidates' errors, the similarity's best first; {errors}): {which}")


def _check_whole(settings: Layerwise, layer: str, chosen: dict[str, torch.Tensor],
                 mean: dict[str, torch.Tensor]) -> None:
    """Layer `layer` run in both whole models of the check (`whole_check`); after the last, its note
    in the plan and a progress line."""
    from uptrain.convert.layers.whole_check import verdict_note

    named = getattr(settings.on_layer, "phase", None)
    what = f"layer {layer_index(layer)}: the whole-model check (the chosen starts' model and mean pooling's)"
    with named(what) if named else nullcontext():
        verdict = settings.checker.advance(layer, {"chosen": chosen, "mean": mean})
    if verdict is None:
        return
    note = verdict_note(verdict)
    if settings.notes is not None:
        settings.notes.append(note)
    line = getattr(settings.on_layer, "note", None)
    if line is not None:
        line(note)


def _mean_outputs(outputs: list, change, layers: dict[str, dict[str, Any]], sources_of: dict[str, list],
                  norms: dict[str, dict[str, Any]], layout: str | None) -> list:
    """The attention outputs (and key norms carrying K/V heads) made as mean pooling's start of each
    layer, in the head order the layer was converted in: what the whole-model check writes over the
    chosen starts (`pipeline.build_outputs`). Built after every layer, so without the calibration."""
    attention, made = change.family.attention, {}

    def fallback():  # the settings once every layer is converted (their head orders known)
        if "change" not in made:
            made["change"] = _without_calibration(change)
        return made["change"]

    caches: dict[str, _LayerCache] = {}
    for layer, parts in layers.items():
        keys = sorted(parts)
        layer_norms = norms.get(layer, {})
        norm_keys = [f"{k}#{j}" for k, o in layer_norms.items() for j in range(len(o.sources))]
        compute = (lambda ts, layer=layer, layer_norms=layer_norms:
                   _start(ts, layer, layer_norms, fallback(), layout, "mean"))
        caches[layer] = _LayerCache(compute, keys + norm_keys, set(keys) | set(layer_norms), layer)
    result, started = [], set()
    for output in outputs:
        p = attention.match(output.spec.name)
        layer = p.layer if p else _norm_layer(output.spec.name, change.family)
        if layer not in caches or (not p and layer not in norms):
            continue
        key = f"{p.role}.{p.param}" if p else "norm:" + output.spec.name[len(layer):]
        sources = () if layer in started else tuple(sources_of[layer])
        started.add(layer)
        result.append(replace(output, sources=sources, unchanged=False,
                              make=lambda ts, cache=caches[layer], key=key: cache.take(key, ts)))
    return _in_layer_order(result, change.family)


def _without_calibration(change):
    """`change` for making mean pooling's start again once a layer's moments are taken: no moments
    (mean pooling reads them only to order heads), each layer in the head order it was converted in,
    nothing recorded, refined, kept or shown."""
    s = change.layerwise
    return replace(change, layerwise=replace(
        s, sigma=None, clip_qkv=None, clip_seen={}, permutations=dict(s.permutations), orders_fixed=True,
        refiner=None, chooser=None, group_chooser=None, checker=None, kept=None, on_layer=None, notes=None))


def chosen_note(chosen: dict[int, dict[str, Any]]) -> str:
    """The plan's note on the per-layer choice of start behind a key norm (`_make_layer`)."""
    mean = [i for i, c in sorted(chosen.items()) if c["start"] == "mean"]
    errors = ", ".join(f"{c['fit']:.4g}/{c['mean']:.4g}" for _, c in sorted(chosen.items()))
    which = (f"mean pooling's on layer{'s' if len(mean) > 1 else ''} {', '.join(map(str, mean))}, the fit's on the "
             f"others" if mean else "the fit's on every layer")
    return (f"start behind the key norm chosen per layer by the output error on the calibration text "
            f"(fit/mean per layer: {errors}): {which}")


def _start(ts: dict[str, torch.Tensor], layer: str, layer_norms: dict[str, Any], change, layout: str | None,
           method: str) -> dict[str, torch.Tensor]:
    """Layer `layer`'s closed-form start by `method` (`transform_layer`), the key norms carrying K/V
    heads as the fit merged them or as planned."""
    settings, d = change.layerwise, change.dims
    projections = {k: v for k, v in ts.items() if not k.startswith("norm:")}
    weights = sorted((k for k in layer_norms if k.endswith(".weight")), key=_head_number)
    hd = projections["o.weight"].shape[1] // d.heads
    gamma = [ts[f"{k}#{j}"].reshape(-1) for k in weights for j in range(len(layer_norms[k].sources))]
    if method == "fit" and gamma and sum(x.numel() for x in gamma) == d.kv_heads * hd:  # a row per K/V head
        projections["knorm.weight"] = torch.cat(gamma).reshape(d.kv_heads, hd)
    named = getattr(settings.on_layer, "phase", None)  # never silent: a line while it runs (`progress.Heartbeat`)
    with named(f"layer {layer_index(layer)}: the closed-form start ({method})") if named else nullcontext():
        at_once.pause("start")
        start = transform_layer(projections, d.heads, d.kv_heads, change.new_kv_heads, method, settings, layer,
                                layout)
    merged = start.pop("knorm.weight", None)
    for key, output in layer_norms.items():  # the planned pooling of the norm, where the fit did not merge it
        start[key] = output.make([ts[f"{key}#{j}"] for j in range(len(output.sources))]).to(output.spec.dtype)
    if merged is not None:  # the fit's norm weights, in the planned outputs' order and shapes
        rows = merged.reshape(-1)
        for key in weights:
            n = layer_norms[key].spec.numel
            start[key], rows = rows[:n].reshape(layer_norms[key].spec.shape).to(layer_norms[key].spec.dtype), rows[n:]
    return start


def _head_number(key: str) -> tuple[int, ...]:
    """The numbers in a norm's key ("norm:k_layernorm.norms.10.weight" -> (10,)): head order, 2 before 10."""
    return tuple(int(n) for n in re.findall(r"\d+", key))


def _norm_layer(name: str, family: Family) -> str | None:
    """The attention prefix of a key-norm tensor that carries K/V heads (`Family.norms`), else None."""
    if not any(rule.match(name) for rule in family.norms):
        return None
    marker = f".{family.attention.module}."
    return name[: name.index(marker) + len(marker)] if marker in name else None


def _in_layer_order(outputs: list, family: Family) -> list:
    """The attention outputs moved into numeric layer order (0, 1, 2, ..., 10: tensor names sort
    10 before 2), the others left where they are: the calibration stream runs layer by layer, so
    layer L is built while the stream's state is at layer L (`--refine` needs its inputs)."""
    def layer(name: str) -> str | None:
        p = family.attention.match(name)
        return p.layer if p else _norm_layer(name, family)

    slots = [i for i, o in enumerate(outputs) if layer(o.spec.name)]
    ordered = sorted(slots, key=lambda i: (layer_index(layer(outputs[i].spec.name)), i))
    result = list(outputs)
    for slot, i in zip(slots, ordered):
        result[slot] = outputs[i]
    return result
