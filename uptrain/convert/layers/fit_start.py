"""What `--method fit` does for a config: the RoPE rows, the key norm, the clamp; its one refusal
and the plan's lines about it. Facts from the registry (`Family`) and the config, no tensors but
the rotary plane indices; the math itself is in `math/fit.py` and `math/normfit.py`, the layer's
conversion in `layerwise.py`.

- Whole-head RoPE (or none on a layer): `fit.fit_keys` on every plane.
- Partial rotary (Phi, StableLM, GLM, Nemotron, Phi-3 with partial_rotary_factor): the planes of
  the first rotary_dims rows, and `fit.fit_linear_keys` on the rows RoPE leaves alone.
- A key norm after the projection (every family with one also normalises its queries): the keys
  merged behind it (`normfit.merge_keys_under_norm`), queries unchanged; with calibration, per layer
  the better of that start and mean pooling's by the attention-output error on the calibration text
  (`layer_outputs._make_layer`, `refine_layer.LayerRefiner.choose`).
- Every fit in the gauge that keeps the source's sizes (`keep_scale`): a merged key and value take the
  size of the heads they replace, the queries and o_proj columns the inverse (the same function: a
  per-plane complex factor on the key and its inverse on the queries; a matrix on the value head and
  its inverse on o_proj). So the cache holds values of the source's range: in the other gauge the
  keys took the queries' size too (up to 716 on stories260K at 2 K/V heads, beyond float8 e4m3's
  448, which vLLM's fp8 cache at its default scale 1.0 saturates: +34% loss instead of +4.5%;
  results/kv-cache-trade.md). Heads identical within a group come back exactly, also where
  clip_qkv (OLMo-1) clamps the outputs; how close that clamp sits is measured per layer (`clip_note`).
- Refused: fused layouts with K/V heads between query heads (Falcon), and RoPE widths that do not
  pair into planes or differ between layer types.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from uptrain.convert.math.fit import rotary_planes
from uptrain.convert.registry.architectures import Family


def rotary_dims(config: dict[str, Any], head_dim: int) -> int | None:
    """How many leading rows of a head RoPE rotates (int(head_dim x partial_rotary_factor), the rule
    of Phi, StableLM, GLM, Nemotron, Phi-3), head_dim where it rotates all; None where layer types
    disagree (rope_parameters per layer type with different factors)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    nested = [r for r in rope.values() if isinstance(r, dict)]
    factors = {float(r.get("partial_rotary_factor", 1.0) or 1.0) for r in nested or [rope]}
    if config.get("partial_rotary_factor"):
        factors = {float(config["partial_rotary_factor"])}
    dims = [int(config[k]) for k in ("rotary_dim", "rotary_ndims") if config.get(k)]
    if len(factors) > 1:
        return None
    return min([int(head_dim * factors.pop())] + dims + [head_dim])


def fit_refusal(family: Family, config: dict[str, Any], head_dim: int) -> str | None:
    """Why the closed-form fit cannot convert this config ("fit cannot convert 'falcon' exactly:
    ..."), or None where it can (key norms, partial rotary and clip_qkv get their own start: `fit_start`)."""
    why = ""
    rotary = rotary_dims(config, head_dim)
    if family.kv_between_queries:
        why = "its fused query_key_value layout interleaves K/V heads with query heads"
    elif rotary is None:
        why = "its layer types rotate different numbers of dims (partial_rotary_factor per layer type)"
    elif rotary % 2:
        why = f"RoPE covers an odd number of dims ({rotary}), which do not pair into rotary planes"
    return f"fit cannot convert {config.get('model_type', '')!r} exactly: {why}" if why else None


def fit_start(family: Family, config: dict[str, Any], head_dim: int) -> str | None:
    """The plan's line on what `--method fit` does for this config where it is not the whole-head
    fit (partial rotary, a key norm, clip_qkv); None where it is."""
    parts = []
    rotary, norm = rotary_dims(config, head_dim), family.key_norm_in(config)
    if norm is not None:
        kept = ("the shared norm weight is kept, so only the merged key's direction is fitted, at the "
                "norm's length" if norm == "shared" else
                "the pooled norm weight carries the merged key's calibrated length")
        parts.append(f"keys merged behind the {norm.replace('_', '-')} key norm ({family.key_norm_module}): "
                     f"the query-weighted mean of each head's normalised keys (each head's RMS from the "
                     f"attention input's moments: --calib's, else Σ = I), {kept}; queries unchanged "
                     f"(their own norm would undo scales folded into them); values and outputs fitted; with --calib, "
                     f"each layer keeps the fit's start or mean pooling's, whichever has the lower attention-output "
                     f"error on the calibration text (the linear picture behind a norm can miss), and without "
                     f"--refine, where the whole model of those starts is further from the source than mean "
                     f"pooling's (KL on the calibration text), mean pooling's on every layer")
    elif rotary is not None and rotary < head_dim:
        parts.append(f"partial rotary: keys fitted on the {rotary // 2} rotary planes of the first {rotary} "
                     f"of {head_dim} dims and by a least-squares key block with a map per head folded "
                     f"into the queries on the other {head_dim - rotary}")
    if config.get("clip_qkv"):
        parts.append(f"clip_qkv {config['clip_qkv']:g} clamps q/k/v, which the fit treats as linear: fitted in "
                     f"the gauge that keeps the source's q/k/v sizes (exact where a group's heads are "
                     f"identical, clamp or not); how close the clamp sits to the outputs is measured per "
                     f"layer from the calibration statistics and noted in the record (uptrain_conversion.json) "
                     f"once converted")
    return "fit start: " + "; ".join(parts) if parts else None


class KeyRule(NamedTuple):
    """How the fit merges a layer's keys: RoPE's planes, the rows it leaves alone, the key norm."""

    planes: tuple[torch.Tensor, torch.Tensor]
    passthrough: torch.Tensor  # row indices RoPE leaves alone
    norm: str | None = None  # `KeyNorm` the keys pass through (merged behind it: `normfit`), or None
    centred: bool = False  # that norm is a LayerNorm
    keep_scale: bool = True  # merged keys and values keep the source heads' size (the cache's range, clip_qkv)


def key_rule(settings: Any, head_dim: int) -> KeyRule:
    """The `KeyRule` of a layer of head_dim rows per head under `settings` (a `layerwise.Layerwise`)."""
    rotary = settings.rotary_dims or head_dim
    return KeyRule(rotary_planes(rotary, settings.interleaved), torch.arange(rotary, head_dim),
                   settings.key_norm, settings.norm_centred)


def clip_note(seen: dict[str, tuple[float, float]], clip: float, calibrated: bool) -> str:
    """The plan's note on clip_qkv's activity: the largest q/k/v output RMS over the clamp, per layer."""
    worst = max(max(pair) for pair in seen.values())
    pairs = ", ".join(f"{a:.2g}/{b:.2g}" for a, b in seen.values())
    verdict = ("the clamp sits at least 3 RMS out, so it is rarely reached and the fit's linear start holds"
               if worst < 1 / 3 else "the clamp is within 3 RMS of some outputs: clipping is likely active there "
               "and the fit's start is approximate (--refine trains through the clamp)")
    source = "the calibration statistics" if calibrated else "Σ = I (no --calib: not the model's activations)"
    return (f"clip_qkv {clip:g}: largest q/k/v output RMS / clamp per layer, source/start, from {source}: "
            f"{pairs}; {verdict}")
