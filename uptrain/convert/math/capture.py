"""What a module sees and gives on a forward pass: the one capture hook and the one moment sum.

Every place that records an attention module's inputs, call arguments and outputs (the layer
stream, refinement on whole models, refinement on the converted model's own inputs) uses
`recording`; every place that sums the second moment of a projection's input (the layer stream,
the whole-model fallback of calibration) uses `Moments` through `summing_moments`. Modules and
tensors only, no paths.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

# call arguments never recorded: the hidden states are recorded apart, and a cache object (None
# under use_cache=False) belongs to one forward pass, not to the sequence
NOT_RECORDED = ("hidden_states", "cache", "past_key_values", "past_key_value")


@dataclass
class Captured:
    """What one module saw and gave on each sequence, batch dim dropped, float32."""

    inputs: list[Tensor] = field(default_factory=list)  # [T_i, D] its hidden_states (after the layer's input norm)
    kwargs: list[dict[str, Any]] = field(default_factory=list)  # the rest of its call: position_embeddings, masks, ...
    outputs: list[Tensor] = field(default_factory=list)  # [T_i, D] its output (before the residual add)

    def clear(self) -> None:
        self.inputs.clear()
        self.kwargs.clear()
        self.outputs.clear()


class StopForward(Exception):
    """Raised by `recording(stop=True)` once the inputs are recorded: the rest of the forward is not run."""


def _first(output: Any) -> Tensor:
    return output[0] if isinstance(output, tuple) else output


@contextmanager
def recording(module: nn.Module, into: Captured, outputs: bool = True, stop: bool = False,
              device: torch.device | str | None = None) -> Iterator[Captured]:
    """Record `module`'s inputs and call arguments (and, with `outputs`, its outputs) into `into`
    on every forward inside the block; tensors stored float32 on `device` (None: where they are).
    stop: raise `StopForward` right after recording the inputs (the caller catches it), so a
    layer runs only up to this module."""
    def keep(x: Tensor) -> Tensor:
        x = x[0].detach().float()
        return x if device is None else x.to(device)

    def before(_module, args, kwargs):
        into.inputs.append(keep(args[0] if args else kwargs["hidden_states"]))
        into.kwargs.append({k: v for k, v in kwargs.items() if k not in NOT_RECORDED})
        if stop:
            raise StopForward

    def after(_module, _args, _kwargs, output):
        into.outputs.append(keep(_first(output)))

    handles = [module.register_forward_pre_hook(before, with_kwargs=True)]
    if outputs and not stop:
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    try:
        yield into
    finally:
        for h in handles:
            h.remove()


@dataclass
class Moments:
    """The running second moment E[x̃ x̃ᵀ] of rows x [..., D], x̃ = [x; 1] (so biases are fitted too), float64."""

    total: Tensor | None = None  # [D+1, D+1] sum of x̃ x̃ᵀ
    tokens: int = 0  # rows added

    def add(self, x: Tensor) -> None:
        """Add x [..., D] in place (no [D+1, D+1] temporaries: 512 MiB each at width 8192)."""
        x = x.reshape(-1, x.shape[-1]).double()
        x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype, device=x.device)], dim=1)
        if self.total is None:
            self.total = x.T @ x
        else:
            self.total.addmm_(x.T, x)
        self.tokens += len(x)

    def mean(self) -> Tensor:
        """E[x̃ x̃ᵀ] [D+1, D+1] float64 on the CPU, divided in place (no second matrix: 512 MiB at width
        8192), so the sum is spent: asked again, or with nothing added, ValueError."""
        if self.total is None:
            raise ValueError("no rows were added to these moments, or their mean was taken already")
        total, self.total = self.total, None
        return total.div_(self.tokens).cpu()


@contextmanager
def summing_moments(module: nn.Module, moments: Moments) -> Iterator[Moments]:
    """Add the input of every forward of `module` (a q_proj/qkv_proj) to `moments` inside the block."""
    handle = module.register_forward_pre_hook(lambda _module, args: moments.add(args[0]))
    try:
        yield moments
    finally:
        handle.remove()
