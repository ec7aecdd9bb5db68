"""The plan's time of a refining conversion: calibration + refinement, an upper bound measured on
`--device` by the probes here (`probe_refine`, `probe_layer_forward`; `refine_layer.LayerRefiner.plan` runs them).

A user plans an hour, or a night, from this figure, so the run must stay under it, also on a
machine other jobs keep busy (issue 43: the run at most 1.5x the printed figure; results/plan-estimate.md
measures it). Everything is measured while planning, on the device, in the converter's process with
the torch threads the conversion will run with, so the machine's load at that time is in the figures:
each probe times runs for a window of ~1 s, many scheduler periods (a mean of 3 runs of 6 ms could
be lucky on a busy machine: that figure was exceeded at load 5), and every sequence is counted as
long as the sequences' root-mean-square length (`typical_length`): a pass's cost is at most
quadratic in the length (a + bL + cL²), so a pass at sqrt(mean L²) costs at least the mean over the
sequences (sqrt(mean L²) >= mean L), which is what 400 steps of randomly drawn sequences add up to.
Counting each as long as the longest (before issue 50) was safe but loose by longest / mean: at 7B
width on 51 stories of 61-503 tokens, actual / bound was 0.41 with 200 of 400 steps run:

calibration  per layer, a forward of one decoder layer (random weights, float32, the original's K/V
             heads taken as many as the query heads: an upper bound, with the moments' x̃ᵀx̃) over
             each calibration sequence, x (layers + 1): the stream's embedding pass (each sequence
             through the skeleton) counted as one more layer. Probed over at most PROBE_TOKENS tokens
             and scaled linearly to the typical sequence (at 7B widths a 2048-token forward takes
             seconds on a CPU; the attention's quadratic part is under a tenth of it there).
refinement   per layer, `steps` x the slowest probed step (`refine_layer.probe_refine`), plus the
             forwards without gradients, each at most the slowest probed forward: a held-out
             measurement every EVAL_EVERY steps and at the last (the held-out sequences), the errors
             before (all sequences) and after (the training ones), the output solve (the training
             ones) and its check (held out).
Not counted: reading each layer's weights from the checkpoint (a layer, against a pass of the
calibration text through it) and early stopping, which only ends sooner.

What it assumes: the machine stays as busy as while planning (the 1-minute load average then is
in the record, `probe.load_1min`). Nothing measured before the run can foresee load that starts
after it, so the run checks itself: after each refined layer, `pace` projects calibration +
refinement at the pace so far and `pace_note` says, on the layer's line, whether the run is within
the plan's bound or, where it is not, by how much and what the load is now.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from uptrain.convert.math import refine
from uptrain.convert.math.capture import Moments, summing_moments
from uptrain.units import human_seconds

PROBE_TOKENS = 256  # the calibration probe's longest forward (scaled linearly beyond)
# The probes' figure against the run's own, at one load: 0.97-1.03 at stories260K's width (a 6 ms
# step, where the loop's own overhead counts), ~0.9 at 7B width (results/plan-estimate.md, issue 50);
# the bound is the probed figure x this, so that a run doing every step stays under it
PROBE_MARGIN = 1.25


def _probe_student(config: Any, device: torch.device) -> tuple[nn.Module, nn.Module | None]:
    """An attention module of the converted family and shape (random weights, float32, on `device`)
    and the model's rotary embedding module (None where the attention has its own), built like
    `refine_layer.student_attention`: the class of a decoder layer's attention of a one-layer model made on `meta`."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.num_hidden_layers = 1
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    attention = refine.attention_modules(model)[0]
    with torch.device(device):
        student = type(attention)(model.config, layer_idx=0).to(device, torch.float32)
        rotary = next((type(m)(config=model.config) for name, m in model.named_modules()
                       if name.endswith("rotary_emb")), None)
    return student, rotary


PROBE_RUNS = 500  # at most this many timed runs in a probe's window (a stories260K step is ~6 ms)


def probe_kwargs(module: nn.Module, rotary: nn.Module | None, config: Any, x: Tensor) -> dict[str, Any]:
    """The call arguments a probe runs `module` (an attention or a decoder layer) with on x [1, T, D]:
    no mask (causal), positions 0..T-1 and the rotary embedding where its forward takes them."""
    import inspect

    length, dev = x.shape[1], x.device
    kwargs: dict[str, Any] = {"attention_mask": None}
    wanted = inspect.signature(module.forward).parameters
    position_ids = torch.arange(length, device=dev)[None]
    if rotary is not None and "position_embeddings" in wanted:
        extra = {}  # Gemma 3, OLMo-3: one rotary module, frequencies per layer type
        if "layer_type" in inspect.signature(rotary.forward).parameters:
            extra["layer_type"] = (getattr(config, "layer_types", None) or ["full_attention"])[0]
        with torch.no_grad():
            kwargs["position_embeddings"] = rotary(x, position_ids, **extra)
    if "position_ids" in wanted:
        kwargs["position_ids"] = position_ids
    return kwargs


def timed(run: Callable[[], None], device: torch.device, runs: int, budget_s: float) -> list[float]:
    """Seconds of each of up to `runs` calls of `run` after one warm-up (allocation, kernel choice),
    fewer once `budget_s` is spent; synchronised on an accelerator."""
    def once() -> float:
        began = time.perf_counter()
        run()
        if device.type != "cpu":
            getattr(torch, device.type).synchronize()
        return time.perf_counter() - began
    once()
    times: list[float] = []
    while len(times) < runs and sum(times) < budget_s:
        times.append(once())
    return times


def probe_refine(config: Any, length: int, batch: int, device: str, steps: int = 3,
                 budget_s: float = 1.0) -> dict[str, float]:
    """What one refine step and one held-out forward cost on `device`, measured on an attention module
    of the converted shape (random weights, float32) over ONE sequence x [length, hidden] (random).
    Steps (forward, backward, Adam) are timed for `budget_s` (at least one; on a CPU of a busy
    machine a 6 ms step is preempted now and then, so only a window of many scheduler periods shows
    the share of the CPU the run will get), forwards without gradients (held-out measurements, the
    output solve) for half that:
    seconds_per_step: `batch` x the mean step over the window (the Adam update counted `batch` times);
    seconds_per_step_slowest: `batch` x the slowest of the first `steps` (the figure before, kept to
    compare: results/plan-estimate.md); forward_seconds / forward_seconds_slowest: the same for a
    forward. config: the converted model's text config."""
    dev = torch.device(device)
    student, rotary = _probe_student(config, dev)
    x = torch.randn(1, length, int(config.hidden_size), device=dev)
    kwargs = probe_kwargs(student, rotary, config, x)
    opt = torch.optim.Adam(student.parameters(), lr=1e-6)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = student(hidden_states=x, **kwargs)
        (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()
        opt.step()

    def forward() -> None:
        with torch.no_grad():
            student(hidden_states=x, **kwargs)
    steps_s, forwards_s = timed(step, dev, PROBE_RUNS, budget_s), timed(forward, dev, PROBE_RUNS, budget_s / 2)
    return {"seconds_per_step": batch * sum(steps_s) / len(steps_s),
            "seconds_per_step_slowest": batch * max(steps_s[:steps]),
            "forward_seconds": sum(forwards_s) / len(forwards_s), "forward_seconds_slowest": max(forwards_s[:2]),
            "timed_steps": len(steps_s)}


def probe_seconds_per_step(config: Any, length: int, batch: int, device: str, steps: int = 3,
                           budget_s: float = 1.0) -> float:
    """Seconds one refine step (`batch` sequences of `length` tokens) takes at most on `device`
    (`probe_refine`'s seconds_per_step)."""
    return probe_refine(config, length, batch, device, steps, budget_s)["seconds_per_step"]


def probe_layer_forward(config: Any, length: int, device: str, budget_s: float = 1.0) -> dict[str, float]:
    """Seconds one decoder layer's calibration forward over ONE sequence of `length` tokens takes on
    `device`: forwards over min(length, PROBE_TOKENS) random tokens (the moments summed as the stream
    sums them) timed for `budget_s` (at least one), x length / that: {"mean": over the window,
    "slowest": of the first 2}. config: the converted model's text config; its K/V heads are set to
    the query heads (the original's at most)."""
    from transformers import AutoModelForCausalLM

    from uptrain.convert.layers.layer_stream import PROJECTIONS

    config = copy.deepcopy(config)
    config.num_hidden_layers = 1
    if getattr(config, "num_key_value_heads", None):
        config.num_key_value_heads = config.num_attention_heads
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dev = torch.device(device)
    with torch.device(dev):
        layer = type(model.base_model.layers[0])(model.config, layer_idx=0).to(dev, torch.float32).eval()
        rotary = next((type(m)(config=model.config) for name, m in model.named_modules()
                       if name.endswith("rotary_emb")), None)
    probe = min(length, PROBE_TOKENS)
    x = torch.randn(1, probe, int(config.hidden_size), device=dev)
    kwargs = probe_kwargs(layer, rotary, model.config, x)
    projection = next(m for n, m in layer.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS)

    def forward() -> None:
        with torch.no_grad(), summing_moments(projection, Moments()):
            layer(x, **kwargs)
    times = timed(forward, dev, PROBE_RUNS, budget_s)
    return {"mean": sum(times) / len(times) * length / probe, "slowest": max(times[:2]) * length / probe}


def conversion_seconds(refine_probe: dict[str, float], layer_forward_s: float | None, sequences: int,
                       held: int, steps: int, layers: int) -> dict[str, float]:
    """The plan's bound (seconds): `calibration` ((layers + 1) x sequences x layer_forward_s; 0 where
    it was not measured), `refinement` (per layer steps x seconds_per_step plus its forwards without
    gradients, see the module doc), each x PROBE_MARGIN, and their sum `total`. sequences: the
    calibration's forward passes; held: how many of them are held out."""
    train = sequences - held
    measurements = steps // refine.EVAL_EVERY + (steps % refine.EVAL_EVERY != 0)
    forwards = measurements * held + sequences + 2 * train + held + 1  # +1: the solve finds its projection
    per_layer = PROBE_MARGIN * (steps * refine_probe["seconds_per_step"] + forwards * refine_probe["forward_seconds"])
    calibration = PROBE_MARGIN * (layers + 1) * sequences * (layer_forward_s or 0.0)
    return {"calibration": calibration, "refinement": layers * per_layer,
            "total": calibration + layers * per_layer}


def typical_length(lengths: list[int]) -> int:
    """The length every pass is counted at: the root-mean-square of the sequences' `lengths`, rounded
    up (at least the mean; the longest where all are equal)."""
    return max(1, math.ceil(math.sqrt(sum(n * n for n in lengths) / max(len(lengths), 1)) - 1e-9))


def load_1min() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def pace(spent_s: float, calibration_s: float, layer_s: list[float], layers: int) -> float:
    """Calibration + refinement seconds in all at the pace measured so far, an upper bound while the
    machine stays as it is now: `spent_s` plus, for each of the `layers` not yet refined, the slowest
    refined layer's seconds (`layer_s`, this run's) and the calibration's mean seconds per stream pass
    (`calibration_s` over len(layer_s) + 1 passes: the embedding pass counted as one, as the bound does)."""
    done = len(layer_s)
    if done == 0:
        return spent_s
    return spent_s + max(layers - done, 0) * (max(layer_s) + calibration_s / (done + 1))


def pace_note(spent_s: float, projected_s: float, bound_s: float, load_then: float | None,
              load_now: float | None) -> str:
    """The layer line's word on the plan: within its bound, or slower than planned (by how much,
    with the load when planned and now, where known)."""
    if projected_s <= bound_s:
        return f"within the plan ({human_seconds(spent_s)} of up to {human_seconds(bound_s)})"
    load = (f"; load {load_then:.1f} when planned, {load_now:.1f} now" if load_then is not None
            and load_now is not None else "")
    return (f"slower than planned: at this pace up to {human_seconds(projected_s)}, "
            f"{projected_s / bound_s:.1f}x the plan's {human_seconds(bound_s)}{load}")
