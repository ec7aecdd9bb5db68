"""`--refine` inside the streaming converter: each layer's closed-form start refined on the spot.

The conversion builds attention layers in numeric order (`layerwise.rewrite_outputs`); asking for
layer L's moments runs the calibration stream through layer L (`Calibration.sigma`), so right
after the closed-form start (`layerwise.transform_layer`) the stream's `Layer` L (`layer.py`) holds
the ORIGINAL attention module and its inputs, call arguments and outputs on every calibration sequence. Here
the student (the family's own attention class built with the converted config, float32, on the
calibration device) is loaded with the start, the targets are the original module's outputs on
the original inputs, `refine.refine_attention` tunes it, and the refined tensors become the
layer's outputs. One pass over the original model; memory: one layer, the activations, the
student and its Adam state.

What is trained: the q/k/v/o (or fused qkv) weights and biases, and key norms that carry K/V
heads (StableLM's per-head LayerNorms, Cohere's per-head and OLMo-2's whole-K norm weights: the
values the start gives them, keys "norm:<name inside the attention>" (pooled with `mean`, set to
the merged keys' length by `fit`: `layers/fit_start.py`), start the student and the refined ones
are written). A shared key/query norm (Qwen3, Gemma 3, Phi qk_layernorm: one [head_dim] weight,
kept unchanged by the conversion) is copied from the original and frozen, because the converter
copies it byte for byte.

`--refine-inputs converted`: each refiner keeps its own converted model's activations (started
from the stream's layer-0 inputs, `Calibration.first_inputs`; one set per K/V count in a sweep);
layer L's attention inputs are taken from them (`Layer.examples_on`: the layer's input path is the
original's), the targets stay the original module's outputs on those inputs, and after refinement
the converted layer (`Layer.run_with`: the original layer with the refined student as its
attention) advances them.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from uptrain.convert.math import refine
from uptrain.convert.layers.time_estimate import (conversion_seconds, load_1min, pace, pace_note, probe_layer_forward,
                                                probe_refine, probe_seconds_per_step, typical_length)  # noqa: F401 (imported from here too)
from uptrain.convert.registry.architectures import Family
from uptrain.convert.registry.choices import REFINE_INPUTS, REFINE_NOT_RANDOM
from uptrain.errors import UsageError
from uptrain.stopping import at_once



@dataclass
class RefineSettings:
    """`--refine` options (defaults measured in results/refine-speed.md; before issue 43: results/refine.md)."""

    steps: int = refine.STEPS
    lr: float = refine.LR
    inputs: str = "original"
    seed: int = 0
    log: Callable[[str], None] | None = field(default=None, repr=False, compare=False)  # a line per layer

    def check(self) -> None:
        """UsageError (one line) for values refine cannot run with."""
        if self.steps < 1:
            raise UsageError(f"--refine-steps must be at least 1, got {self.steps}")
        if not self.lr > 0:
            raise UsageError(f"--refine-lr must be positive, got {self.lr}")
        if self.inputs not in REFINE_INPUTS:
            raise UsageError(f"--refine-inputs must be one of {', '.join(REFINE_INPUTS)}, not {self.inputs!r}")


def check_refine(family: Family, config: dict[str, Any], method: str, calibrated: bool) -> None:
    """UsageError (one line) where `--refine` cannot run for this family/method."""
    model_type = config.get("model_type", "")
    if not calibrated:
        raise UsageError("--refine needs --calib FILE (the text whose attention outputs the converted layers "
                         "are tuned to match)")
    if method == "random":
        raise UsageError(REFINE_NOT_RANDOM)
    if family.qkv_layout is not None and family.qkv_layout[0] == "grouped":
        raise UsageError(f"--refine is not supported for {model_type!r} (its fused grouped query_key_value "
                         f"layout has no layer-at-a-time conversion); convert without --refine")


def estimate(dims, tokens: int, hidden: int, settings: RefineSettings, new_kv: int) -> dict[str, Any]:
    """What the plan says about a refinement: settings and memory (bytes) beyond the calibration's.

    Memory: the student in float32 and Adam's two moments (3x the converted attention weights),
    plus the layer's attention inputs and the targets (tokens x hidden x 4 bytes each), and with
    converted inputs the converted model's activations too.
    """
    weights = (2 * dims.heads + 2 * new_kv) * dims.head_dim * hidden
    memory = 3 * weights * 4 + (3 if settings.inputs == "converted" else 2) * tokens * hidden * 4
    return {"steps": settings.steps, "lr": settings.lr, "inputs": settings.inputs, "batch": refine.BATCH,
            "holdout_fraction": refine.HOLDOUT, "patience": refine.PATIENCE, "seed": settings.seed,
            "memory_bytes": memory, "optimizer_steps_at_most": settings.steps * dims.layers}


def plan_held_out(lengths: list[int], documents: list[int], seed: int) -> dict[str, Any]:
    """What the refinement will hold out of calibration windows of `lengths` tokens cut from
    `documents` (`refine.split_held_out` with the defaults): for the record and the plan."""
    held, _ = refine.split_held_out(lengths, documents, refine.HOLDOUT, refine.MIN_HOLDOUT_TOKENS, seed)
    tokens = sum(lengths[i] for i in held)
    return {"tokens": tokens, "documents": len({documents[i] for i in held}), "sequences": len(held),
            "of_tokens": sum(lengths), "of_documents": len(set(documents)), "min_tokens": refine.MIN_HOLDOUT_TOKENS,
            "by": "document" if len(set(documents)) > 1 else "tail windows of the only document",
            "too_small": tokens < refine.MIN_HOLDOUT_TOKENS}


def _empty_student(original, config: Any, device: torch.device) -> nn.Module:
    """The family's attention class with the converted config (the `original` layer's kernel), float32 on `device`."""
    config = copy.deepcopy(config)
    config._attn_implementation = original.attention.config._attn_implementation
    return type(original.attention)(config, layer_idx=original.index).to(device, torch.float32)



def student_attention(original, config: Any, family: Family, start: dict[str, Tensor], device: torch.device) -> nn.Module:
    """The family's attention class with the converted config, float32, holding `start`; what the
    conversion leaves unchanged (a shared key/query norm) copied from the `original` layer's attention."""
    attention = original.attention
    student = _empty_student(original, config, device)
    loaded: set[str] = set()
    with torch.no_grad():
        for module, role in family.modules.roles().items():
            for param in ("weight", "bias"):
                if f"{role}.{param}" in start:
                    getattr(student.get_submodule(module), param).copy_(start[f"{role}.{param}"])
                    loaded.add(f"{module}.{param}")
        for key, value in start.items():  # key norms carrying K/V heads: pooled, trained with the layer
            if key.startswith("norm:"):
                student.get_parameter(key[5:]).copy_(value)
                loaded.add(key[5:])
        original = dict(attention.named_parameters())
        for name, p in student.named_parameters():
            if name in loaded:
                continue
            if name not in original or original[name].shape != p.shape:
                raise RuntimeError(f"refine cannot start {type(student).__name__}.{name}: no tensor of the "
                                   f"conversion and none of that shape in the original")
            p.copy_(original[name])  # a shared norm, unchanged by the conversion: kept as it is
            p.requires_grad_(False)
    return student


@dataclass
class LayerRefiner:
    """Refines each layer's start right after it is made (`Layerwise.refiner`)."""

    settings: RefineSettings
    family: Family
    config: Any  # the converted model's (text) config, a transformers PretrainedConfig
    calibration: Any  # the bound `calibrate.Calibration` (keep='attention', or 'layer' for converted inputs)
    record: dict[str, Any] = field(default_factory=dict)  # the plan's `refinement`, filled layer by layer
    user: int = 0  # which of the calibration's users this conversion is (a sweep's K/V count)
    # `--refine-inputs converted`: this conversion's own model's activations entering the next layer
    _converted: list[Tensor] | None = field(default=None, repr=False)
    last_line: str = ""  # the line of the layer refined last (what `settings.log` is given)
    # layer index -> its `refine_attention` progress callback (`progress.step_lines`: a line every ~10 s,
    # a 7B layer takes an hour on a CPU), set by `pipeline.prepare`; None: `settings.log.steps` where it has one
    progress: Callable[[int], Callable[[refine.RefineProgress], None]] | None = field(default=None, repr=False)
    # what -> a context manager naming a phase without steps (`progress.Heartbeat`); None: the log's, if any
    phases: Callable[[str], Any] | None = field(default=None, repr=False)
    # `--refine-inputs converted`: the float32 parameters of the layer refined last (kept with the layer)
    last_state: dict[str, Tensor] | None = field(default=None, repr=False)

    def plan(self, dims, hidden: int, new_kv: int) -> dict[str, Any]:
        """The plan's `refinement` before any layer: `estimate`, what will be held out (the calibration
        is tokenized now), the measured seconds per step (`probe_refine`) and the bound on calibration +
        refinement seconds (probe['bound_s'], `time_estimate`). UsageError
        where the calibration gives fewer than 2 sequences."""
        sequences, documents, _, _ = self.calibration.windows()
        if len(sequences) < 2:
            raise UsageError(f"--refine needs at least 2 calibration sequences (one is held out), --calib gave "
                             f"{len(sequences)}; raise --calib-tokens or use more documents")
        lengths = [len(s) for s in sequences]
        device = self.calibration.device
        length = typical_length(lengths)  # what a pass over one sequence costs, on average at most
        held = plan_held_out(lengths, documents, self.settings.seed)
        try:
            probe: dict[str, Any] = probe_refine(self.config, length, refine.BATCH, device)
            probe["seconds_at_most"] = probe["seconds_per_step"] * self.settings.steps * dims.layers
        except (RuntimeError, TypeError, ValueError, AttributeError) as err:  # a family the probe cannot build
            probe = {"not_measured": " ".join(str(err).split())[:200] or type(err).__name__}
        else:
            probe["bound_s"] = self._bound(probe, length, len(sequences), held["sequences"], dims.layers)
            probe["load_1min"], probe["cpus"] = load_1min(), os.cpu_count()  # what the bound assumes stays
        return {**estimate(dims, self.calibration.tokens, hidden, self.settings, new_kv), "held_out": held,
                "probe": {**probe, "device": str(device), "sequence_tokens": length,
                          "longest_sequence_tokens": max(lengths), "layers": dims.layers}}

    def _bound(self, probe: dict[str, Any], length: int, sequences: int, held: int, layers: int) -> dict[str, Any]:
        """The plan's upper bound on calibration + refinement seconds (`time_estimate`); the
        calibration part 0, with the reason, where its probe cannot build this family's layer."""
        forward, why = {"mean": None, "slowest": None}, None
        try:
            forward = probe_layer_forward(self.config, length, self.calibration.device)
        except (RuntimeError, TypeError, ValueError, AttributeError, KeyError, IndexError, StopIteration) as err:
            why = " ".join(str(err).split())[:200] or type(err).__name__
        bound = conversion_seconds(probe, forward["mean"], sequences, held, self.settings.steps, layers)
        slowest = {"seconds_per_step": probe["seconds_per_step_slowest"],
                   "forward_seconds": probe["forward_seconds_slowest"]}
        bound["total_from_slowest"] = conversion_seconds(slowest, forward["slowest"], sequences, held,
                                                         self.settings.steps, layers)["total"]
        return {**bound, "layer_forward_seconds": forward["mean"],
                **({"calibration_not_measured": why} if why else {})}

    def __call__(self, layer: str, start: dict[str, Tensor]) -> dict[str, Tensor]:
        """The refined tensors of attention `layer` (its prefix) from its closed-form `start` (role.param -> tensor)."""
        began = time.perf_counter()
        if not self.calibration.streamed:
            raise UsageError(f"--refine needs the layer-by-layer calibration, which this model cannot do "
                             f"({self.calibration.record.get('why_not_streamed')}); convert without --refine")
        original = self.calibration.layer(layer, self.user)
        phase = self._phase(original.index)
        with phase("the student and its inputs"):
            at_once.pause("inputs")
            student = student_attention(original, self.config, self.family, start, original.device)
            inputs, call, targets = self._examples(original)
        if len(inputs) < 2:
            raise UsageError(f"--refine needs at least 2 calibration sequences (one is held out), --calib gave "
                             f"{len(inputs)}; raise --calib-tokens or use more documents")
        result = refine.refine_attention(student, call, inputs, targets, steps=self.settings.steps,
                                         lr=self.settings.lr, seed=self.settings.seed,
                                         documents=self.calibration.documents, **self._progress(original.index),
                                         phase=phase)
        if self._converted is not None:  # this layer converted: its outputs enter the next one
            original.run_with(student, self._converted)
            # kept with the layer (`io/kept_layers.py`): a rerun advances the activations exactly so
            self.last_state = {k: p.detach().clone() for k, p in student.named_parameters()}
        self._log(original.index, result, began)
        return self._refined(student, start)

    def choose(self, layer: str, starts: dict[Any, dict[str, Tensor]], what: str = "the fit's or mean pooling's",
               sequences: int | None = None) -> tuple[Any, dict[Any, float]] | None:
        """Which of `starts` (name -> a closed-form start of attention `layer`, role.param -> tensor) is
        closest to the original layer on the calibration text: the lowest relative output error
        ||y' - y||² / ||y||² over every calibration sequence, or the first `sequences`
        (`refine.relative_error`); (its name, each start's error); None where the model was calibrated
        whole (no layer's inputs to measure on). `what` names the starts in the progress line.
        Behind a key norm the fit's linear picture can miss (issue 50: trained Qwen3-style layers where
        mean pooling's start was closer), so the start is the better of the two, measured; a head
        grouping is chosen the same way (`layer_outputs._grouping_chosen`)."""
        if not self.calibration.streamed:
            return None
        original = self.calibration.layer(layer, self.user)
        with self._phase(original.index)(f"the start: {what}, by their calibration error"):
            inputs, call, targets = self._examples(original)
            every = range(len(inputs) if sequences is None else min(sequences, len(inputs)))
            errors = {name: refine.relative_error(
                student_attention(original, self.config, self.family, start, original.device), call, inputs, targets,
                every) for name, start in starts.items()}
        return min(errors, key=errors.__getitem__), errors

    def replay(self, layer: str, state: dict[str, Tensor], row: dict[str, Any]) -> None:
        """A layer an interrupted run kept (`layerwise._kept_layer`): the stream taken past it as `__call__`
        takes it, with converted inputs the activations advanced through the kept attention (`state`:
        its float32 parameters), and its record row added again (marked "kept")."""
        if not self.calibration.streamed:
            raise UsageError(f"--refine needs the layer-by-layer calibration, which this model cannot do "
                             f"({self.calibration.record.get('why_not_streamed')}); convert without --refine")
        original = self.calibration.layer(layer, self.user)
        if self.settings.inputs == "converted":
            if self._converted is None:
                self._converted = self.calibration.first_inputs()
            student = _empty_student(original, self.config, original.device)
            with torch.no_grad():
                for name, p in student.named_parameters():
                    if name not in state:
                        raise RuntimeError(f"the kept layer {original.index} lacks {name}; delete "
                                           f"the kept layers folder and convert again")
                    p.copy_(state[name])
            original.run_with(student, self._converted)
        self.record.setdefault("layers", []).append({**row, "layer": original.index, "kept": True})
        before, after = row.get("error_before"), row.get("error_after")
        errors = f" (held-out error {before:.4f} -> {after:.4f})" if before is not None and after is not None else ""
        self.last_line = f"refine layer {original.index}: kept from the interrupted run{errors}"
        if self.settings.log:
            self.settings.log(self.last_line)

    def _phase(self, index: int) -> Callable[[str], Any]:
        """Layer `index`'s phases without steps, named (`progress.Heartbeat` through the log's `phase`:
        a line whenever ~10 s pass with none); a no-op where nobody shows progress."""
        named = self.phases or getattr(self.settings.log, "phase", None)
        if named is None:
            return lambda what: contextlib.nullcontext()
        return lambda what: named(f"refine layer {index}: {what}")

    def _progress(self, index: int) -> dict[str, Any]:
        """`refine_attention`'s progress keywords for layer `index` (none where nobody shows them)."""
        lines = self.progress or getattr(self.settings.log, "steps", None)
        if lines is None:
            return {}
        line = lines(index)
        return {"progress": line, "progress_every": getattr(line, "every", refine.PROGRESS_EVERY)}

    def _examples(self, original) -> tuple[list[Tensor], refine.AttentionCall, list[Tensor]]:
        """The student's inputs, its call and its targets on the calibration sequences: the original
        attention's recorded inputs and outputs, or (converted inputs) the attention inputs of this
        conversion's own model (layers before refined) and the original module's outputs on them."""
        device = original.device
        if self.settings.inputs == "converted":
            if self._converted is None:
                self._converted = self.calibration.first_inputs()
            captured = original.examples_on(self._converted)
        else:
            captured = original.recorded()  # the original's matrices are freed since: its outputs were recorded
        return ([x.to(device) for x in captured.inputs], refine.call_with(captured.kwargs),
                [y.to(device) for y in captured.outputs])

    def _refined(self, student: nn.Module, start: dict[str, Tensor]) -> dict[str, Tensor]:
        """The student's trained tensors under the keys (and dtypes) of `start`."""
        params = dict(student.named_parameters())
        out = {}
        for module, role in self.family.modules.roles().items():
            for param in ("weight", "bias"):
                key = f"{role}.{param}"
                if key in start:
                    out[key] = params[f"{module}.{param}"].detach().to("cpu", start[key].dtype).contiguous()
        for key in start:
            if key.startswith("norm:"):
                out[key] = params[key[5:]].detach().to("cpu", start[key].dtype).contiguous()
        return out

    def _against_plan(self) -> str:
        """'; within the plan (...)' or '; slower than planned: ...' (`time_estimate.pace_note`): this
        run's calibration + refinement so far against the plan's bound; '' where there is none."""
        probe = self.record.get("probe") or {}
        bound = (probe.get("bound_s") or {}).get("total")
        made = [x["seconds_with_setup"] for x in self.record.get("layers", []) if not x.get("kept")]
        if not bound or not made:
            return ""
        calibration = float(self.calibration.record.get("seconds", 0.0))
        spent = calibration + sum(made)
        kept = len(self.record["layers"]) - len(made)
        projected = pace(spent, calibration, made, probe["layers"] - kept)
        return "; " + pace_note(spent, projected, bound, probe.get("load_1min"), load_1min())

    def _log(self, index: int, result, began: float) -> None:
        row = {"layer": index, **result.as_dict(), "seconds_with_setup": round(time.perf_counter() - began, 3)}
        self.record.setdefault("layers", []).append(row)
        self.last_line = (f"refine layer {index}: held-out error {result.error_before:.4f} -> "
                          f"{result.error_after:.4f} ({result.steps_run} steps, {result.seconds:.1f} s)"
                          + self._against_plan())
        if self.settings.log:
            self.settings.log(self.last_line)
