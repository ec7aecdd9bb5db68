"""One decoder layer's life in the layer stream, owned by one object: run, asked, freed.

A `Layer` is made by `LayerStream.advance` with its module materialised from the checkpoint; it is
run over every calibration sequence once (`run`), which sums its attention-input moments and
records what the conversion will ask for, and right after keeps only that (`keep`):

  moments    the moments alone: the fit reads the checkpoint itself, so the whole module is freed
  attention  + the attention's inputs, call arguments and outputs per sequence (refinement on the
             original inputs: its inputs and targets) and, of the module, only the attention's norms
  layer      + the whole module (refinement on the converted model's own inputs runs it again)
  all        both: the attention's recordings and the whole module (the start chosen per layer on the
             recordings, the whole model's check running the converted models through the module)

Then it answers: `moments()` (once per user of the stream), `recorded()`, `examples_on(...)`,
`run_with(...)`; `free()` gives the module back to meta and drops the recordings (the stream frees
a layer when it runs the next one). Asking a layer for what it does not or no longer holds raises
`LayerGone`, never returns None.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn

from uptrain.stopping import at_once
from uptrain.convert.math.capture import Captured, Moments, StopForward, recording, summing_moments

KEEP = ("moments", "attention", "layer", "all")


class LayerGone(RuntimeError):
    """A layer was asked for something it does not or no longer holds (the message says what and why)."""


def trim_heap() -> None:
    """Give freed heap memory back to the system (glibc's malloc_trim; nothing elsewhere).

    Layers freed one after another leave glibc's heap fragmented: measured on a 48-layer model of
    width 512, RSS crept up ~5 MiB per layer (a 48-layer run ended 250 MiB above its start) and
    stayed flat with a trim after each layer.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def free_parameters(module: nn.Module, keep: nn.Module | None = None, linear_only: bool = False) -> None:
    """Move `module`'s parameters (except those of its submodule `keep`; with `linear_only`, only those
    of its nn.Linear projections, not its norms) to the meta device, freeing their memory; the module
    keeps its structure (shapes, dtypes) and runs no more."""
    kept = {id(p) for p in keep.parameters()} if keep is not None else set()
    for sub in module.modules():
        if linear_only and not isinstance(sub, nn.Linear):
            continue
        for key, param in list(sub._parameters.items()):
            if param is not None and id(param) not in kept and not param.is_meta:
                sub._parameters[key] = nn.Parameter(param.to("meta"), requires_grad=False)


class Layer:
    """Decoder layer `index` (attention prefix `prefix`, e.g. 'model.layers.3.self_attn.').

    state: 'new' (materialised, not run), 'ran', 'freed'. module: the decoder layer, float32 on its
    device; projection: its attention's input projection inside it ('self_attn.q_proj'); kwargs: its call arguments per sequence; users: how many
    conversions take its moments (a sweep converts to several K/V counts from one stream); device:
    where it runs.
    """

    def __init__(self, index: int, prefix: str, module: nn.Module, projection: str, kwargs: list[dict[str, Any]],
                 keep: str, users: int = 1, device: torch.device | str = "cpu"):
        if keep not in KEEP:
            raise ValueError(f"keep must be one of {KEEP}, not {keep!r}")
        self.index, self.prefix, self.keep, self.device = index, prefix, keep, torch.device(device)
        self._module, self._projection = module, projection
        self._attention_name = projection.rsplit(".", 1)[0]  # 'self_attn.q_proj' -> 'self_attn'
        # the original attention, held apart: `run_with` puts another module in its place for a while
        self._attention = module.get_submodule(self._attention_name) if projection else None
        self._use = threading.Lock()  # users of one stream (threads) run the module one at a time
        self._kwargs = kwargs
        self._captured = Captured()
        self._sigma: Tensor | None = None
        self._users_left = users
        self.state = "new"
        self._why_gone = ""

    @classmethod
    def moments_only(cls, index: int, prefix: str, sigma: Tensor, users: int, why: str) -> "Layer":
        """A layer whose moments came from elsewhere (the whole model run at once); it holds nothing else."""
        layer = cls(index, prefix, nn.Module(), "", [], "moments", users)
        layer._sigma, layer.state, layer._why_gone = sigma, "freed", why
        return layer

    # ------------------------------------------------------------------ the run

    @torch.no_grad()
    def run(self, activations: list[Tensor], dtype: torch.dtype,
            on_sequence: Callable[[int], None] | None = None) -> None:
        """Run every sequence ([T, D], `dtype`, CPU) through the layer, in place: the outputs replace
        them (the next layer's inputs). Sums the moments and records what `keep` names, then frees the rest.
        on_sequence(k): called after the k-th sequence (a progress line: at 7B a pass takes minutes)."""
        if self.state != "new":
            raise LayerGone(f"layer {self.index} has run already")
        moments = Moments()
        with ExitStack() as hooks:
            hooks.enter_context(summing_moments(self._module.get_submodule(self._projection), moments))
            if self.keep != "moments":  # inputs and call arguments; outputs (the targets) for original inputs
                hooks.enter_context(recording(self.attention, self._captured, outputs=self.keep != "layer",
                                              device="cpu"))
            for s, x in enumerate(activations):
                at_once.check()  # Ctrl-C: stop within a sequence, not at the end of the layer
                out = self._module(x.to(self.device, torch.float32)[None], **self._kwargs[s])
                out = out[0] if isinstance(out, tuple) else out
                activations[s] = out[0].to("cpu", dtype)
                if on_sequence is not None:
                    on_sequence(s + 1)
        self._sigma, self.state = moments.mean(), "ran"
        self._keep_only_what_is_asked()

    def _keep_only_what_is_asked(self) -> None:
        """At 70B widths the MLP alone is 2.6 GiB in float32 and the attention's matrices 1 GiB,
        otherwise held through the layer's fit and refinement."""
        if self.keep not in ("layer", "all"):
            attention = self.attention
            free_parameters(self._module, keep=attention if self.keep == "attention" else None)
            free_parameters(attention, linear_only=True)
            trim_heap()

    def free(self, why: str = "") -> None:
        """Module back to meta, recordings dropped (the moments stay until every user took them)."""
        if self.state == "freed":
            return
        self._module.to("meta")
        self._captured.clear()
        self.state, self._why_gone = "freed", why or "it was freed"
        trim_heap()

    # ------------------------------------------------------------------ what the conversion asks

    def _holding(self, what: str, needs: tuple[str, ...]) -> None:
        if self.state != "ran":
            raise LayerGone(f"layer {self.index} no longer holds {what}: {self._why_gone or 'it has not run'}")
        if self.keep not in needs:
            raise LayerGone(f"layer {self.index} kept only {self.keep}, not {what} (the stream was opened "
                            f"with keep={self.keep!r})")

    @property
    def moments_left(self) -> int:
        """How many users have yet to take the moments."""
        return self._users_left

    def moments(self) -> Tensor:
        """E[x̃ x̃ᵀ] [D+1, D+1] float64 of the attention input; each user takes it once (at width 8192 it is 512 MiB)."""
        if self._sigma is None or self._users_left <= 0:
            raise LayerGone(f"layer {self.index}'s moments were handed out already"
                            if self._users_left <= 0 else f"layer {self.index} has not run")
        sigma = self._sigma
        self._users_left -= 1
        if self._users_left == 0:
            self._sigma = None
        return sigma

    @property
    def module(self) -> nn.Module:
        """The decoder layer (float32 on `device`; after the run its weights are meta but for what `keep` names)."""
        if self.state == "freed":
            raise LayerGone(f"layer {self.index} no longer holds its module: {self._why_gone}")
        return self._module

    @property
    def attention(self) -> nn.Module:
        """The original attention module (its matrices are meta after the run unless keep='layer')."""
        if self.state == "freed":
            raise LayerGone(f"layer {self.index} no longer holds its attention module: {self._why_gone}")
        return self._attention

    def recorded(self) -> Captured:
        """The attention's inputs [T, D], call arguments and outputs [T, D] (float32, CPU) per sequence, as run."""
        self._holding("the attention's recorded inputs and outputs", ("attention", "all"))
        return self._captured

    @torch.no_grad()
    def examples_on(self, activations: list[Tensor]) -> Captured:
        """What refinement on the converted model's own inputs learns from: the attention's inputs and
        call arguments when the layer runs on `activations` (per sequence [T, D]; the layer stops at its
        attention: its input path is the original's), and as outputs the ORIGINAL attention's on them."""
        self._holding("its module", ("layer", "all"))
        captured = Captured()
        with self._use:
            with recording(self._attention, captured, stop=True, device="cpu"):
                for s, x in enumerate(activations):
                    try:
                        self._module(x.to(self.device, torch.float32)[None], **self._kwargs[s])
                    except StopForward:
                        pass
            for x, kwargs in zip(captured.inputs, captured.kwargs):
                out = self._attention(hidden_states=x.to(self.device)[None], **kwargs)
                captured.outputs.append((out[0] if isinstance(out, tuple) else out)[0].float().cpu())
        return captured

    @torch.no_grad()
    def run_with(self, attention: nn.Module, activations: list[Tensor]) -> None:
        """Run the layer with `attention` in place of its own over `activations`, in place: they become
        the next layer's inputs (the converted model's own, with this layer converted)."""
        self._holding("its module", ("layer", "all"))
        with self._use:
            self._module.set_submodule(self._attention_name, attention)
            try:
                for s, x in enumerate(activations):
                    at_once.check()
                    out = self._module(x.to(self.device, torch.float32)[None], **self._kwargs[s])
                    out = out[0] if isinstance(out, tuple) else out
                    activations[s] = out[0].to("cpu", x.dtype)
            finally:
                self._module.set_submodule(self._attention_name, self._attention)
