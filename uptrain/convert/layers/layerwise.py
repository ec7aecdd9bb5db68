"""Conversions that change a whole attention layer at once: `--method fit`, `--grouping similar`, `--refine`.

The streaming converter makes each output tensor from its own source tensors. These couple the
projections of a layer (the fit folds key scales into q_proj and refits o_proj; a grouping
permutes q/k/v rows and o_proj columns together; refinement tunes them all), so here every
attention tensor of a layer is made from all of that layer's attention tensors, read once with
the layer's first output: the layer is transformed once, cached, and dropped as its outputs are
taken (memory stays near one layer). Layers are built in numeric order, so that the calibration
stream holds layer L's original module and inputs when layer L is refined.

Which families the fit and the grouping can treat exactly is decided by `check_layerwise` from the
config: a one-line UsageError names what works instead (`--method mean`, `--grouping
contiguous`); with `--refine` a family the fit refuses starts from `mean`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from uptrain.convert.registry.architectures import Family
from uptrain.convert.registry.choices import (CALIB_HAS_NO_EFFECT, GROUPINGS, SIMILAR_NOT_RANDOM, Grouping,
                                             calibration_applies)
from uptrain.convert.math.fit import fit_keys, fit_values, rotary_planes
from uptrain.convert.math.grouping import group_permutation, head_similarity
from uptrain.convert.math.heads import merge_qkv, repeat_heads, split_qkv
from uptrain.errors import UsageError


@dataclass
class Layerwise:
    """Settings of a layer-at-a-time conversion (part of `HeadChange`)."""

    grouping: Grouping = "contiguous"
    interleaved: bool = False
    # attention-input second moment per layer prefix, augmented with a constant 1 (last row/col);
    # None: Σ = I (weights only)
    sigma: Callable[[str], torch.Tensor] | None = None
    permutations: dict[str, list[int]] = field(default_factory=dict)  # filled as layers are converted
    # --refine: (layer prefix, closed-form start) -> refined tensors (`refine_layer.LayerRefiner`)
    refiner: Callable[[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    # a line per layer converted (`progress.layer_progress`); with a refiner, the refiner's line
    on_layer: Callable[[str], None] | None = None


def _partial_rotary(config: dict[str, Any], head_dim: int) -> bool:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) or 1.0
    dims = [config.get(k) for k in ("rotary_dim", "rotary_ndims") if config.get(k)]
    return float(factor) < 1.0 or any(int(x) < head_dim for x in dims)


def check_layerwise(family: Family, config: dict[str, Any], head_dim: int, method: str, grouping: str) -> None:
    """UsageError (one line) where `method`/`grouping` cannot be done exactly for this config.

    config: the config as transformers reads it (class defaults included); the family's facts
    (fused layout, key norms) come from the registry.
    """
    model_type = config.get("model_type", "")
    key_norm = family.key_norm_in(config)
    if grouping == "similar":
        if method == "random":
            raise UsageError(SIMILAR_NOT_RANDOM)
        if family.kv_between_queries or key_norm in ("per_head", "whole"):
            raise UsageError(f"--grouping similar is not supported for {model_type!r} (key norms or a fused "
                             f"grouped layout tie heads to their place); use --grouping contiguous")
    why = fit_refusal(family, config, head_dim) if method == "fit" else None
    if why:
        raise UsageError(f"--method {why}; use --method mean")


def fit_refusal(family: Family, config: dict[str, Any], head_dim: int) -> str | None:
    """Why the closed-form fit cannot convert this config exactly ("fit cannot convert 'phi' exactly:
    ..."), or None where it can."""
    why = ""
    if family.kv_between_queries:
        why = "its fused query_key_value layout interleaves K/V heads with query heads"
    elif family.key_norm_in(config) is not None:
        why = "it normalises keys after the projection, which would undo the fitted per-head key scales"
    elif _partial_rotary(config, head_dim):
        why = "RoPE covers only part of each head (partial rotary), and the fit treats whole heads as rotary planes"
    elif config.get("clip_qkv"):
        why = "clip_qkv clamps q/k/v outputs, which the fitted scales would change"
    return f"fit cannot convert {config.get('model_type', '')!r} exactly: {why}" if why else None


def _per_head_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads*hd, *rest] -> [heads, hd, *rest]."""
    return t.reshape(heads, t.shape[0] // heads, *t.shape[1:])


def _augment(weight: torch.Tensor, bias: torch.Tensor | None, heads: int, with_bias: bool) -> torch.Tensor:
    """[heads*hd, d] (+ bias [heads*hd]) -> [heads, hd, d (+1)] float64."""
    w = weight.double()
    if with_bias:
        b = bias.double() if bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
        w = torch.cat([w, b[:, None]], dim=1)
    return _per_head_rows(w, heads)


def transform_layer(tensors: dict[str, torch.Tensor], heads: int, kv_heads: int, new_kv: int, method: str,
                    settings: Layerwise, layer: str, qkv_layout: str | None = None) -> dict[str, torch.Tensor]:
    """One attention layer converted: keys "q.weight", "k.weight", ..., "qkv.weight", "o.weight" in and out.

    Works in the MHA view: K/V heads are first repeated to one per query head (the same function),
    heads are permuted into groups (`settings.grouping`), then each group's K/V is merged by `method`
    ("mean", "first" or "fit"). Outputs keep each source tensor's dtype.
    """
    t = dict(tensors)
    if qkv_layout is not None:  # fused (Phi-3): split, convert, merge back
        hd_guess = t["o.weight"].shape[1] // heads
        for param in ("weight", "bias"):
            if f"qkv.{param}" in t:
                t[f"q.{param}"], t[f"k.{param}"], t[f"v.{param}"] = split_qkv(
                    t.pop(f"qkv.{param}"), qkv_layout, heads, kv_heads, hd_guess)
    o = t["o.weight"]
    hd = o.shape[1] // heads
    d = t["q.weight"].shape[1]
    for name in ("k.weight", "k.bias", "v.weight", "v.bias"):  # the MHA view
        if name in t and kv_heads != heads:
            t[name] = repeat_heads(t[name], kv_heads, heads)
    kv_bias = "k.bias" in t or "v.bias" in t
    full = settings.sigma(layer).double() if settings.sigma else torch.eye(d + 1, dtype=torch.float64)
    sig_kv = full if kv_bias else full[:d, :d]
    sig_q = full if "q.bias" in t else full[:d, :d]
    wq = _augment(t["q.weight"], t.get("q.bias"), heads, "q.bias" in t)
    wk = _augment(t["k.weight"], t.get("k.bias"), heads, kv_bias)
    wv = _augment(t["v.weight"], t.get("v.bias"), heads, kv_bias)
    wo = o.double().reshape(o.shape[0], heads, hd).permute(1, 0, 2)  # [heads, d_out, hd]
    planes = rotary_planes(hd, settings.interleaved)

    perm = list(range(heads))
    if settings.grouping == "similar":
        sim = head_similarity(_augment(t["k.weight"], t.get("k.bias"), heads, True),
                              _augment(t["v.weight"], t.get("v.bias"), heads, True), full,
                              aligned=method == "fit", planes=planes)
        perm = group_permutation(sim, new_kv)
        settings.permutations[layer] = perm
    if perm != list(range(heads)):  # one at a time: at 70B widths each is a 512 MiB float64 copy
        wq = wq[perm]
        wk = wk[perm]
        wv = wv[perm]
        wo = wo[perm]

    k_all, v_all = _merge_groups(wq, wk, wv, wo, new_kv, method, sig_kv, sig_q, planes)  # [new_kv, hd, D]
    del wk, wv  # the MHA-view K/V are done with

    out: dict[str, torch.Tensor] = {}
    out["q.weight"] = wq[..., :d].reshape(heads * hd, d)
    if "q.bias" in t:
        out["q.bias"] = wq[..., d].reshape(heads * hd)
    for name, w in (("k", k_all), ("v", v_all)):
        out[f"{name}.weight"] = w[..., :d].reshape(new_kv * hd, d)
        if f"{name}.bias" in t:
            out[f"{name}.bias"] = w[..., d].reshape(new_kv * hd)
    out["o.weight"] = wo.permute(1, 0, 2).reshape(o.shape[0], heads * hd)
    del wq, wo
    if qkv_layout is None:  # each output in its source's dtype now, not all float64 copies at once
        out = {name: value.to(tensors[name].dtype) for name, value in out.items()}
    if "o.bias" in t:
        out["o.bias"] = t["o.bias"]
    if qkv_layout is not None:
        for param in ("weight", "bias"):
            if f"q.{param}" in out:
                parts = [out.pop(f"{x}.{param}") for x in "qkv"]
                dtype = tensors[f"qkv.{param}"].dtype
                out[f"qkv.{param}"] = merge_qkv(*[p.to(dtype) for p in parts], qkv_layout, hd)
    return {name: value.to(tensors[name].dtype).contiguous() for name, value in out.items()}


def _merge_groups(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, new_kv: int, method: str,
                  sig_kv: torch.Tensor, sig_q: torch.Tensor, planes) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group of heads // new_kv consecutive heads' K/V merged into one: (K, V), each [new_kv, hd, D].

    wq, wk, wv: [heads, hd, D] (augmented with the bias column where there is one), wo: [heads, d_out,
    hd], all in group order. "fit" also compensates the group's queries and outputs: wq and wo are
    updated in place."""
    g = wk.shape[0] // new_kv
    new_k, new_v = [], []
    for s in range(new_kv):
        grp = slice(s * g, (s + 1) * g)
        if method == "fit":
            k1, wq[grp] = fit_keys(wk[grp], wq[grp], sig_kv, sig_q, planes)
            v1, wo[grp] = fit_values(wv[grp], wo[grp], sig_kv)
        elif method == "mean":
            k1, v1 = wk[grp].mean(0), wv[grp].mean(0)
        elif method == "first":
            k1, v1 = wk[grp][0], wv[grp][0]
        else:
            raise ValueError(f"transform_layer takes mean, first or fit, not {method!r}")
        new_k.append(k1)
        new_v.append(v1)
    return torch.stack(new_k), torch.stack(new_v)


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
    # --refine trains the key norms that carry K/V heads (StableLM, Cohere, OLMo-2) with the layer:
    # their pooled outputs join the layer's computation, so they too are made once and refined
    norms: dict[str, dict[str, Any]] = {}  # layer -> {"norm:<name inside the attention>": planned output}
    if settings.refiner is not None:
        for output in outputs:
            layer = _norm_layer(output.spec.name, change.family)
            if layer in layers:
                norms.setdefault(layer, {})["norm:" + output.spec.name[len(layer):]] = output
    caches: dict[str, _LayerCache] = {}
    sources_of: dict[str, list] = {}
    from uptrain.convert.layers.calibrate import layer_index

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

        def compute(ts, layer=layer, layer_norms=layer_norms):
            if layer == first_layer and settings.on_layer is not None and hasattr(settings.on_layer, "begin"):
                settings.on_layer.begin()  # the time left counts from the first layer, not from the start
            start = transform_layer({k: v for k, v in ts.items() if not k.startswith("norm:")}, d.heads, d.kv_heads,
                                    change.new_kv_heads, change.method, settings, layer, layout)
            for key, output in layer_norms.items():  # the planned pooling of the norm: the refinement's start
                start[key] = output.make([ts[f"{key}#{j}"] for j in range(len(output.sources))]).to(output.spec.dtype)
            done = settings.refiner(layer, start) if settings.refiner is not None else start
            if settings.on_layer is not None:
                settings.on_layer(getattr(settings.refiner, "last_line", "")
                                  or f"layer {layer_index(layer)} converted ({change.method})")
            return done
        caches[layer] = _LayerCache(compute, keys + norm_keys, set(keys) | set(layer_norms), layer)
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
    from uptrain.convert.layers.calibrate import layer_index

    def layer(name: str) -> str | None:
        p = family.attention.match(name)
        return p.layer if p else _norm_layer(name, family)

    slots = [i for i, o in enumerate(outputs) if layer(o.spec.name)]
    ordered = sorted(slots, key=lambda i: (layer_index(layer(outputs[i].spec.name)), i))
    result = list(outputs)
    for slot, i in zip(slots, ordered):
        result[slot] = outputs[i]
    return result


def layerwise_settings(family: Family, config: dict[str, Any], heads: int, kv_heads: int, head_dim: int,
                       new_kv: int, method: str, grouping: str, calibration=None, refine: bool = False,
                       user: int = 0) -> Layerwise | None:
    """The `Layerwise` of a conversion, None for the per-tensor path; UsageError where not possible.

    calibration: a bound `calibrate.Calibration` (Σ from real text) or None (Σ = I).
    refine: `--refine` (every method goes layer at a time; the pipeline sets `refiner`).
    user: which of the calibration's users takes the moments (a sweep's K/V count).
    """
    if grouping not in GROUPINGS:
        raise UsageError(f"--grouping must be one of {', '.join(GROUPINGS)}, not {grouping!r}")
    if not calibration_applies(method, grouping, refine):  # the one rule (registry/choices.py)
        if calibration is not None:
            raise UsageError(CALIB_HAS_NO_EFFECT)
        return None
    check_layerwise(family, config, head_dim, method, grouping)
    if new_kv > kv_heads:
        raise UsageError("--method fit and --grouping similar only reduce the K/V head count")
    return Layerwise(grouping=grouping, interleaved=family.interleaved_rope,
                     sigma=partial(calibration.sigma, user=user) if calibration is not None else None)


def describe_layerwise(plan, settings: Layerwise | None, calibration, source_params: int) -> None:
    """Put grouping and calibration into a `ConversionPlan` (printed, in the card and the record)."""
    if settings is None:
        return
    plan.grouping = settings.grouping
    if settings.grouping == "similar":
        plan.head_order = settings.permutations  # the same dict: filled as layers are converted
    if calibration is not None:
        plan.calibration = calibration.record  # the same dict: tokens used and seconds appear once it ran
        note, plan.calibration["memory_bytes"] = calibration.describe(source_params)
        plan.notes.append(note)
