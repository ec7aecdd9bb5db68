"""The conversion plan: what changes, parameter counts and KV-cache sizes, before anything is written.

`--dry-run` prints it; a real conversion writes it into the model card and `uptrain_conversion.json`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch

from uptrain import __version__
from uptrain.convert.registry.architectures import Family
from uptrain.units import human_seconds, kv_cache_bytes_per_token  # noqa: F401 (human_seconds: imported from here too)
from uptrain.convert.io.hfconfig import AttentionDims
from uptrain.convert.tensors import OutputTensor


@dataclass
class ConversionPlan:
    """Everything a user wants to know about a conversion (sizes in bytes)."""

    source: str
    model_type: str
    dims: AttentionDims
    new_kv_heads: int
    method: str
    seed: int
    dtype: str
    params_before: int
    params_after: int
    kv_bytes_per_token_before: int
    kv_bytes_per_token_after: int
    max_context: int | None
    notes: list[str] = field(default_factory=list)
    revision: str | None = None
    cache_shrinks: bool = True  # False: transformers' cache for this type keeps K/V of every query head
    timing_s: dict[str, float] = field(default_factory=dict)  # seconds per phase of the conversion
    grouping: str = "contiguous"  # which query heads share a K/V head (layerwise.py)
    calibration: dict[str, Any] | None = None  # --calib: file, tokens, device, seconds (calibrate.py)
    refinement: dict[str, Any] | None = None  # --refine: settings, estimates, per-layer errors (refine_layer.py)
    head_order: dict[str, list[int]] | None = None  # --grouping similar: layer -> source query head per position
    # --grouping similar with --calib: layer -> {"errors": each candidate grouping's start's output error
    # on the calibration text (the similarity's best first; None: one candidate, or nothing to measure on),
    # "chosen": the index written} (`layer_outputs._grouping_chosen`)
    grouping_choice: dict[int, dict[str, Any]] | None = None
    # tensors copied byte for byte / built, their bytes, and whether the copy started before planning
    streams: dict[str, Any] | None = None
    # layer at a time with an output: where finished layers are kept while converting, and those an
    # interrupted run with the same arguments had kept (`io/kept_layers.py`)
    kept_layers: dict[str, Any] | None = None
    # behind a key norm, --method fit --calib without --refine: the KL to the source of the model of the
    # starts chosen per layer and of mean pooling's, and which was written (`layers/whole_check.py`)
    whole_model: dict[str, Any] | None = None
    # (not recorded) the layer-at-a-time settings whose mean pooling outputs that check may write
    rewrite: ClassVar[Any] = None

    @property
    def group_size(self) -> int:
        return self.dims.kv_heads // self.new_kv_heads

    @property
    def kv_reduction(self) -> float:
        return self.kv_bytes_per_token_before / self.kv_bytes_per_token_after

    def record(self) -> dict[str, Any]:
        """The machine-readable record written beside the converted weights."""
        return {"uptrain_version": __version__, **asdict(self), "kv_reduction": self.kv_reduction}


def plan_conversion(source: str, revision: str | None, config: dict[str, Any], family: Family,
              dims: AttentionDims, new_kv: int, method: str, seed: int,
              source_params: int, outputs: list[OutputTensor], kv_dtype: torch.dtype) -> ConversionPlan:
    """Sizes from the planned outputs; the cache is counted in `kv_dtype` (that of the K/V outputs)."""
    bytes_per = kv_dtype.itemsize
    notes: list[str] = []
    if family.approximate:
        notes.append(f"approximate conversion: {family.approximate}")
    if not family.cache_shrinks:
        notes.append("no KV-cache saving in transformers for this type: its cache stores K/V for every "
                     "query head; the saving is in parameters and in runtimes that cache grouped K/V")
    if config.get("sliding_window"):
        notes.append(f"sliding-window layers cap their cache at {config['sliding_window']} tokens")
    before = kv_cache_bytes_per_token(dims.layers, dims.kv_heads, dims.head_dim, bytes_per)
    after = kv_cache_bytes_per_token(dims.layers, new_kv, dims.head_dim, bytes_per)
    if not family.cache_shrinks:
        before = after = kv_cache_bytes_per_token(dims.layers, dims.heads, dims.head_dim, bytes_per)
    return ConversionPlan(
        source=source, revision=revision, model_type=config["model_type"], dims=dims,
        new_kv_heads=new_kv, method=method, seed=seed, dtype=str(kv_dtype).removeprefix("torch."),
        params_before=source_params, params_after=sum(o.spec.numel for o in outputs),
        kv_bytes_per_token_before=before, kv_bytes_per_token_after=after,
        max_context=config.get("max_position_embeddings") or config.get("n_positions"), notes=notes,
        cache_shrinks=family.cache_shrinks)


BESIDE_THE_COPY = ("import", "plan", "read", "pool", "write built")  # worker-thread phases, when overlapped


def format_timing(plan: ConversionPlan) -> str:
    """One line of phase times: 'import 3.9 s, plan 1.2 s, copy 27.0 s, ...; wall 31.2 s (...)'."""
    t = plan.timing_s
    beside = [k for k in BESIDE_THE_COPY if k in t and (k not in ("import", "plan") or
                                                        (plan.streams or {}).get("copied_while_planning"))]
    line = ", ".join(f"{k} {v:.2f} s" for k, v in t.items() if k != "wall")
    if "wall" in t:
        line += f"; wall {t['wall']:.2f} s"
    return line + (f" ({', '.join(beside)} beside the copy)" if beside else "")


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def cache_change(plan: ConversionPlan) -> str:
    """'4.0x smaller', or why the cache does not shrink for this model type."""
    if not plan.cache_shrinks:
        return "does not shrink in transformers: its cache for this type stores K/V for every query head"
    return f"{plan.kv_reduction:.1f}x smaller"


def refine_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The plan's rows on what a refinement holds out and how long it may take (`refine_layer.LayerRefiner.plan`)."""
    rows = []
    held = r.get("held_out")
    if held:
        rows.append(("held out", f"{held['tokens']:,} of {held['of_tokens']:,} calibration tokens "
                                 f"({held['documents']} of {held['of_documents']} documents, {held['sequences']} "
                                 f"sequences; split by {held['by']}), never trained on: the stop rule's test"))
        if held["too_small"]:
            rows.append(("note", f"only {held['tokens']:,} tokens held out, under the {held['min_tokens']:,} a "
                                 f"reliable stop needs: the calibration text is too small; give a larger "
                                 f"--calib-tokens or a --calib file with more documents"))
    probe = r.get("probe")
    if probe and "not_measured" in probe:
        rows.append(("refine time", f"not measured ({probe['not_measured']}); at most {r['steps']} steps x "
                                    f"{probe['layers']} layers"))
    elif probe:
        rows.append(("refine time", f"at most {r['steps']} steps x {probe['layers']} layers at "
                                    f"{probe['seconds_per_step']:.3g} s/step measured on {probe['device']} = up to "
                                    f"{human_seconds(probe['seconds_at_most'])} (early stopping usually ends sooner)"
                                    + ("; on a GPU: --device cuda" if probe["device"] == "cpu" else "")))
    bound = (probe or {}).get("bound_s")
    if bound:
        rows.append(("calibration + refinement", conversion_time({**bound, "load_1min": probe.get("load_1min"),
                                                                  "cpus": probe.get("cpus")})))
    return rows


def conversion_time(bound: dict[str, Any]) -> str:
    """'up to T (calibration ~C, refinement at most R)': the plan's upper bound on a refining
    conversion's calibration and refinement (`layers/time_estimate.py`), measured while planning."""
    calibration = (f"calibration not measured: {bound['calibration_not_measured']}" if "calibration_not_measured"
                   in bound else f"calibration ~{human_seconds(bound['calibration'])}")
    load = (f" (1-minute load {bound['load_1min']:.1f} on {bound['cpus']} CPUs)"
            if bound.get("load_1min") is not None and bound.get("cpus") else "")
    return (f"up to {human_seconds(bound['total'])} ({calibration}, refinement at most "
            f"{human_seconds(bound['refinement'])}; measured on this machine at its present load{load}, "
            f"assuming it stays so: each refined layer's line checks the run against it)")


def format_plan(plan: ConversionPlan) -> str:
    """A human-readable table of the plan."""
    d = plan.dims
    rows = [
        ("source", plan.source + (f" @ {plan.revision}" if plan.revision else "")),
        ("model type", plan.model_type),
        ("method", plan.method + (f" (seed {plan.seed})" if plan.method == "random" else "")
         + (f", {plan.grouping} grouping" if plan.grouping != "contiguous" else "")),
        ("layers", str(d.layers)),
        ("per layer", f"{d.heads} query heads, K/V heads {d.kv_heads} -> {plan.new_kv_heads} "
                      f"(groups of {plan.group_size}), head_dim {d.head_dim}"),
        ("parameters", f"{plan.params_before:,} -> {plan.params_after:,} "
                       f"({plan.params_after - plan.params_before:+,})"),
        ("KV cache / token", f"{human_bytes(plan.kv_bytes_per_token_before)} -> "
                             f"{human_bytes(plan.kv_bytes_per_token_after)} ({plan.dtype}, "
                             f"{cache_change(plan)})"),
    ]
    if plan.max_context:
        rows.append((f"KV cache @ {plan.max_context} tok",
                     f"{human_bytes(plan.kv_bytes_per_token_before * plan.max_context)} -> "
                     f"{human_bytes(plan.kv_bytes_per_token_after * plan.max_context)} per sequence"))
    if plan.calibration:
        c = plan.calibration
        rows.append(("calibration", f"{c['file']}, {c.get('tokens_used', c['tokens_requested']):,} tokens on "
                                    f"{c['device']}" + (f", {c['seconds']} s" if "seconds" in c else "")))
        if c.get("warning"):
            rows.append(("warning", c["warning"]))
    if plan.refinement:
        r = plan.refinement
        rows.append(("refine", f"from {r['start']}: Adam on each layer's attention output, at most {r['steps']} "
                               f"steps (batch {r['batch']} sequences, lr {r['lr']:g} x weight RMS, held-out stop), "
                               f"{r['inputs']} inputs; memory ~{human_bytes(r['memory_bytes'])} beyond the "
                               f"calibration's"))
        rows += refine_rows(r)
        done = r.get("layers") or []
        if done:
            rows.append(("refined", ", ".join(f"{x['error_before']:.3f}->{x['error_after']:.3f}" for x in done)
                         + f" held-out error per layer, {sum(x['seconds'] for x in done):.1f} s"))
    rows += [("note", n) for n in plan.notes]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
