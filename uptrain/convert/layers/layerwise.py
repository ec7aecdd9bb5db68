"""Conversions that change a whole attention layer at once: `--method fit`, `--grouping similar`, `--refine`.

The streaming converter makes each output tensor from its own source tensors. These couple the
projections of a layer (the fit folds key scales into q_proj and refits o_proj; a grouping
permutes q/k/v rows and o_proj columns together; refinement tunes them all), so here every
attention tensor of a layer is made from all of that layer's attention tensors (`transform_layer`),
read once with the layer's first output; how the outputs take from one made layer, in numeric
layer order, kept for a rerun of an interrupted conversion, is `layer_outputs.py`.

Which families the fit and the grouping can treat exactly is decided by `check_layerwise` from the
config: a one-line UsageError names what works instead (`--method mean`, `--grouping
contiguous`). What the fit's start follows (partial rotary, a key norm, clip_qkv) is `fit_start.py`.
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
from uptrain.convert.layers.fit_start import KeyRule, fit_refusal, fit_start, key_rule, rotary_dims
from uptrain.convert.math.fit import fit_keys_partial, fit_values, rotary_planes
from uptrain.convert.math.normfit import merge_keys_under_norm, output_rms
from uptrain.convert.math.grouping import candidate_groups, group_permutation, head_similarity
from uptrain.convert.math.heads import merge_qkv, repeat_heads, split_qkv
from uptrain.errors import UsageError


# --grouping similar with --calib: the candidate groupings measured per layer (`candidate_orders`), each
# on the first GROUP_SEQUENCES calibration sequences (the forward passes cost at 7B widths, not the choice)
GROUP_CANDIDATES = 3
GROUP_SEQUENCES = 8


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
    # what the fit's start follows (`layerwise_settings`, from the family and the config)
    rotary_dims: int | None = None  # RoPE covers the first rotary_dims rows of a head; None: all
    key_norm: str | None = None  # the fit merges keys behind this key norm (`KeyNorm`), None: no norm
    norm_centred: bool = False  # that norm is a LayerNorm (centres first), else an RMSNorm
    clip_qkv: float | None = None  # q/k/v outputs clamped to [-c, c]
    start_note: str | None = None  # the plan's line on the fit's start (`fit_start`)
    notes: list[str] | None = None  # the plan's notes (`describe_layerwise`): the clamp's activity is added
    clip_seen: dict[str, tuple[float, float]] = field(default_factory=dict)  # layer -> largest RMS / c (source, start)
    # finished layers kept beside the output for a rerun of an interrupted conversion (`io/kept_layers.KeptLayers`)
    kept: Any = None
    # `--method fit --calib` behind a key norm: picks, per layer, the fit's start or mean pooling's by
    # their output error on the calibration text (`refine_layer.LayerRefiner.choose`); None: the fit's
    chooser: Any = None
    chosen: dict[int, dict[str, Any]] = field(default_factory=dict)  # layer -> {"fit": error, "mean": error, "start"}
    # with the chooser and no refiner: the whole model of the chosen starts against mean pooling's
    # (`whole_check.WholeModelCheck`), and the outputs that write mean pooling's start on every layer
    # where it is the closer (`layer_outputs.rewrite_outputs`)
    checker: Any = None
    mean_outputs: list[Any] = field(default_factory=list)
    orders_fixed: bool = False  # --grouping similar: take each layer's head order from `permutations`
    # --grouping similar with --calib: measures each layer's candidate groupings (`candidate_orders`) by
    # their start's output error on the calibration text (`refine_layer.LayerRefiner.choose`); None: the similarity's
    group_chooser: Any = None
    group_candidates: int = GROUP_CANDIDATES  # how many (`--group-candidates`; 1: the similarity's best alone)
    group_choice: dict[int, dict[str, Any]] = field(default_factory=dict)  # layer -> {"errors": [...], "chosen": i}


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
    ("mean", "first" or "fit"; the fit's keys by `key_rule(settings)`). "knorm.weight" [kv_heads,
    head_dim], the key norm's weight per K/V head, comes back as the merged keys' norm weight
    [new_kv, head_dim] where the fit merges keys behind a per-head or whole-projection norm.
    Outputs keep each source tensor's dtype.
    """
    t = _mha_view(tensors, heads, kv_heads, qkv_layout)
    o = t["o.weight"]
    hd = o.shape[1] // heads
    d = t["q.weight"].shape[1]
    kv_bias = "k.bias" in t or "v.bias" in t
    full = _moments(settings, layer, d)
    sig_kv = full if kv_bias else full[:d, :d]
    sig_q = full if "q.bias" in t else full[:d, :d]
    wq = _augment(t["q.weight"], t.get("q.bias"), heads, "q.bias" in t)
    wk = _augment(t["k.weight"], t.get("k.bias"), heads, kv_bias)
    wv = _augment(t["v.weight"], t.get("v.bias"), heads, kv_bias)
    wo = o.double().reshape(o.shape[0], heads, hd).permute(1, 0, 2)  # [heads, d_out, hd]
    rule = key_rule(settings, hd)
    gamma = t.pop("knorm.weight", None)

    perm = list(range(heads))
    if settings.grouping == "similar" and settings.orders_fixed:
        # the order the layer was converted in (the whole-model check) or chosen among candidates (`_make_layer`)
        perm = settings.permutations[layer]
    elif settings.grouping == "similar":
        perm = group_permutation(_similarity(t, heads, full, method == "fit" and rule.norm is None, settings), new_kv)
        settings.permutations[layer] = perm
    if perm != list(range(heads)):  # one at a time: at 70B widths each is a 512 MiB float64 copy
        wq = wq[perm]
        wk = wk[perm]
        wv = wv[perm]
        wo = wo[perm]
        gamma = gamma[perm] if gamma is not None else None
    if settings.clip_qkv:
        source = [output_rms(w.flatten(0, 1), s) for w, s in ((wq, sig_q), (wk, sig_kv), (wv, sig_kv))]

    k_all, v_all, gamma = _merge_groups(wq, wk, wv, wo, new_kv, method, sig_kv, sig_q, rule, gamma)  # [new_kv, hd, D]
    if settings.clip_qkv:
        start = [output_rms(w.flatten(0, 1), s) for w, s in ((wq, sig_q), (k_all, sig_kv), (v_all, sig_kv))]
        settings.clip_seen[layer] = (max(source) / settings.clip_qkv, max(start) / settings.clip_qkv)
    del wk, wv  # the MHA-view K/V are done with
    out = _unaugmented(wq, k_all, v_all, wo, t, d)
    if gamma is not None:
        out["knorm.weight"] = gamma
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


def candidate_orders(tensors: dict[str, torch.Tensor], heads: int, kv_heads: int, new_kv: int, method: str,
                     settings: Layerwise, layer: str, qkv_layout: str | None, count: int) -> list[list[int]]:
    """`--grouping similar`'s candidate head orders of one layer (new position -> source head), up to
    `count`: the grouping `transform_layer` makes first, then other partitions the search ends at
    (`grouping.candidate_groups`), on the same similarity. `tensors` as `transform_layer` takes them."""
    t = _mha_view(tensors, heads, kv_heads, qkv_layout)
    hd = t["o.weight"].shape[1] // heads
    aligned = method == "fit" and key_rule(settings, hd).norm is None
    sim = _similarity(t, heads, _moments(settings, layer, t["q.weight"].shape[1]), aligned, settings)
    return [[h for part in parts for h in part] for parts in candidate_groups(sim, new_kv, count)]


def _mha_view(tensors: dict[str, torch.Tensor], heads: int, kv_heads: int,
              qkv_layout: str | None) -> dict[str, torch.Tensor]:
    """The layer's tensors with a fused qkv split (Phi-3) and every K/V tensor repeated to one per query head."""
    t = dict(tensors)
    if qkv_layout is not None:  # fused (Phi-3): split, convert, merge back
        hd_guess = t["o.weight"].shape[1] // heads
        for param in ("weight", "bias"):
            if f"qkv.{param}" in t:
                t[f"q.{param}"], t[f"k.{param}"], t[f"v.{param}"] = split_qkv(
                    t.pop(f"qkv.{param}"), qkv_layout, heads, kv_heads, hd_guess)
    for name in ("k.weight", "k.bias", "v.weight", "v.bias", "knorm.weight"):  # the MHA view
        if name in t and kv_heads != heads:
            t[name] = repeat_heads(t[name], kv_heads, heads)
    return t


def _moments(settings: Layerwise, layer: str, d: int) -> torch.Tensor:
    """[d+1, d+1] float64: the layer's augmented attention-input second moment, the identity without calibration."""
    return settings.sigma(layer).double() if settings.sigma else torch.eye(d + 1, dtype=torch.float64)


def _similarity(t: dict[str, torch.Tensor], heads: int, full: torch.Tensor, aligned: bool,
                settings: Layerwise) -> torch.Tensor:
    """[heads, heads] `head_similarity` of the MHA-view keys and values (bias columns included)."""
    hd = t["o.weight"].shape[1] // heads
    return head_similarity(_augment(t["k.weight"], t.get("k.bias"), heads, True),
                           _augment(t["v.weight"], t.get("v.bias"), heads, True), full,
                           aligned=aligned, planes=rotary_planes(hd, settings.interleaved))


def _unaugmented(wq: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, wo: torch.Tensor,
                 t: dict[str, torch.Tensor], d: int) -> dict[str, torch.Tensor]:
    """The layer's projections as weight and bias tensors (the bias column split off where `t` has
    the bias): wq [heads, hd, D], k_all/v_all [new_kv, hd, D], wo [heads, d_out, hd]."""
    heads, hd = wq.shape[:2]
    out: dict[str, torch.Tensor] = {"q.weight": wq[..., :d].reshape(heads * hd, d)}
    if "q.bias" in t:
        out["q.bias"] = wq[..., d].reshape(heads * hd)
    for name, w in (("k", k_all), ("v", v_all)):
        out[f"{name}.weight"] = w[..., :d].reshape(-1, d)
        if f"{name}.bias" in t:
            out[f"{name}.bias"] = w[..., d].reshape(-1)
    out["o.weight"] = wo.permute(1, 0, 2).reshape(wo.shape[1], heads * hd)
    return out


def _merge_groups(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, new_kv: int, method: str,
                  sig_kv: torch.Tensor, sig_q: torch.Tensor, rule: KeyRule, gamma: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each group of heads // new_kv consecutive heads' K/V merged into one: (K, V, key norm weight),
    K and V [new_kv, hd, D], the norm weight [new_kv, hd] or None (the planned pooling stands).

    wq, wk, wv: [heads, hd, D] (augmented with the bias column where there is one), wo: [heads, d_out,
    hd], gamma: [heads, hd] the key norm weight per head or None, all in group order. "fit" also
    compensates the group's outputs (and, with no key norm, its queries): wq and wo are updated in
    place. Behind a key norm the keys are merged for the whole layer at once (`merge_keys_under_norm`:
    a whole-projection norm has one RMS for all groups)."""
    g = wk.shape[0] // new_kv
    new_k, new_v = [], []
    for s in range(new_kv):
        grp = slice(s * g, (s + 1) * g)
        if method == "fit":
            if rule.norm is None:
                k1, wq[grp] = fit_keys_partial(wk[grp], wq[grp], sig_kv, sig_q, rule.planes, rule.passthrough,
                                               rule.keep_scale)
                new_k.append(k1)
            v1, wo[grp] = fit_values(wv[grp], wo[grp], sig_kv, rule.keep_scale)
        elif method == "mean":
            new_k.append(wk[grp].mean(0))
            v1 = wv[grp].mean(0)
        elif method == "first":
            new_k.append(wk[grp][0])
            v1 = wv[grp][0]
        else:
            raise ValueError(f"transform_layer takes mean, first or fit, not {method!r}")
        new_v.append(v1)
    if method == "fit" and rule.norm is not None:
        per_head = gamma if rule.norm != "shared" else None
        k_all, gamma_new = merge_keys_under_norm(wq, wk, sig_kv, sig_q, new_kv, rule.planes, rule.centred,
                                                 rule.norm == "whole", per_head)
        return k_all, torch.stack(new_v), gamma_new
    return torch.stack(new_k), torch.stack(new_v), None


def layerwise_settings(family: Family, config: dict[str, Any], heads: int, kv_heads: int, head_dim: int,
                       new_kv: int, method: str, grouping: str, calibration=None, refine: bool = False,
                       user: int = 0, group_candidates: int = GROUP_CANDIDATES) -> Layerwise | None:
    """The `Layerwise` of a conversion, None for the per-tensor path; UsageError where not possible.

    calibration: a bound `calibrate.Calibration` (Σ from real text) or None (Σ = I).
    refine: `--refine` (every method goes layer at a time; the pipeline sets `refiner`).
    user: which of the calibration's users takes the moments (a sweep's K/V count).
    group_candidates: `--group-candidates` (measured only with `--grouping similar` and a calibration).
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
    fit = method == "fit"
    return Layerwise(grouping=grouping, interleaved=family.interleaved_rope,
                     sigma=partial(calibration.sigma, user=user) if calibration is not None else None,
                     rotary_dims=rotary_dims(config, head_dim), key_norm=family.key_norm_in(config) if fit else None,
                     norm_centred=family.key_norm_centred, clip_qkv=config.get("clip_qkv") if fit else None,
                     start_note=fit_start(family, config, head_dim) if fit else None,
                     group_candidates=group_candidates)


def describe_layerwise(plan, settings: Layerwise | None, calibration, source_params: int) -> None:
    """Put grouping and calibration into a `ConversionPlan` (printed, in the card and the record)."""
    if settings is None:
        return
    plan.grouping = settings.grouping
    settings.notes = plan.notes  # the same list: the clamp's activity is added once every layer is converted
    if settings.start_note:
        plan.notes.append(settings.start_note)
    if settings.grouping == "similar":
        plan.head_order = settings.permutations  # the same dict: filled as layers are converted
    if settings.group_chooser is not None:
        plan.grouping_choice = settings.group_choice  # idem
    if calibration is not None:
        plan.calibration = calibration.record  # the same dict: tokens used and seconds appear once it ran
        # the measured grouping keeps each layer's attention inputs and outputs (--refine's estimate counts them)
        measures = settings.group_chooser is not None and settings.refiner is None
        note, plan.calibration["memory_bytes"] = calibration.describe(source_params, measures)
        plan.notes.append(note)
