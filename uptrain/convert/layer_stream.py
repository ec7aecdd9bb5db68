"""Running a checkpoint one decoder layer at a time over calibration sequences (GPTQ-style).

The model is built as a skeleton whose parameters are on the meta device (buffers such as the
rotary frequencies are computed for real). The input embedding gets only the rows of the tokens
used, read from the checkpoint; one forward pass per sequence through the skeleton, with every
decoder layer replaced by a catcher, records what the model's own forward hands each layer:
the hidden states entering layer 0 (embedding scales, e.g. Gemma's, included) and each layer's
keyword arguments (rotary position embeddings, masks per layer type, position ids). Then each
layer in turn is materialised from the checkpoint (float32, on the device), every sequence is run
through it, its attention-input second moment is recorded, its outputs become the next layer's
inputs, and the layer goes back to meta.

Memory: one decoder layer in float32, the activations (tokens x hidden, float32, or bfloat16 when
float32 would exceed `activation_limit`), the embedding rows of the distinct tokens, and the
moments kept.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from uptrain.convert.source import SourceCheckpoint, TensorInfo

PROJECTIONS = ("q_proj", "qkv_proj")  # the attention's input projection: what it sees is the attention input


class StreamUnsupported(Exception):
    """This checkpoint cannot be run layer by layer (the message says why); run it whole instead."""


class _Caught(Exception):
    pass


@dataclass
class LayerState:
    """Decoder layer `index` after the calibration sequences ran through it.

    Valid until the stream advances: then `layer` goes back to meta and the lists are emptied. Right
    after the run only what the conversion uses stays: where the attention inputs are kept (refinement
    on the original inputs) those, the attention's outputs and its norms, not its projections; the whole
    layer where the converted activations are kept too (`--refine-inputs converted`); none of the layer's
    weights otherwise (the fit reads the checkpoint).
    """

    index: int
    prefix: str  # tensor-name prefix of its attention, e.g. 'model.layers.3.self_attn.'
    layer: nn.Module  # the decoder layer, float32 on the stream's device
    attention: nn.Module  # its attention module (the original, unconverted)
    sigma: torch.Tensor  # [D+1, D+1] float64: E[x̃ x̃ᵀ], x̃ = [x; 1], x the attention input
    tokens: int  # rows of x averaged over
    attention_inputs: list[torch.Tensor] = field(default_factory=list)  # per sequence [T, D] float32, on CPU
    attention_kwargs: list[dict[str, Any]] = field(default_factory=list)  # per sequence: attention(x, **kwargs)
    attention_outputs: list[torch.Tensor] = field(default_factory=list)  # per sequence [T, D] float32: its outputs


def available_memory() -> int:
    """Bytes of memory available to a new allocation (MemAvailable on Linux, else physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def activation_dtype(tokens: int, hidden: int, limit: int) -> torch.dtype:
    """float32 when tokens x hidden activations fit in `limit` bytes as float32, else bfloat16."""
    return torch.float32 if tokens * hidden * 4 <= limit else torch.bfloat16


class _Catcher(nn.Module):
    """Stands in for decoder layer `index`: records its inputs, passes the hidden states on; the last raises."""

    def __init__(self, layer: nn.Module, index: int, records: dict[int, tuple], last: bool):
        super().__init__()
        self.layer, self.index, self.records, self.last = layer, index, records, last

    def __getattr__(self, name: str) -> Any:  # the model's forward may read layer attributes (attention_type)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        self.records[self.index] = (hidden, {k: v for k, v in kwargs.items() if k != "hidden_states"})
        if self.last:
            raise _Caught
        return hidden


def _renames(model_type: str) -> list[tuple[str, str]]:
    """transformers' plain renamings of checkpoint keys on load for `model_type` (EXAONE's
    `transformer.h.N.attn.attention.` -> `model.layers.N.self_attn.`), as (regex, replacement)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return []
    rules = get_checkpoint_conversion_mapping(model_type) or []
    return [(a, b) for r in rules if type(r) is WeightRenaming for a, b in zip(r.source_patterns, r.target_patterns)]


def _checkpoint_names(model: nn.Module, source: SourceCheckpoint) -> dict[str, TensorInfo]:
    """model parameter name -> checkpoint tensor, for names stored as-is or without/with the base
    prefix, or renamed on load by transformers (`_renames`)."""
    import re

    by_name = {i.name: i for i in source.tensors}
    renames = _renames(getattr(model.config, "model_type", ""))
    for info in source.tensors:
        name = info.name
        for pattern, replacement in renames:
            name = re.sub(pattern, replacement, name)
        by_name.setdefault(name, info)
    prefix = getattr(model, "base_model_prefix", "model") + "."
    found = {}
    for name, _ in model.named_parameters():
        for candidate in (name, name.removeprefix(prefix), prefix + name):
            if candidate in by_name:
                found[name] = by_name[candidate]
                break
    return found


def _read_rows(source: SourceCheckpoint, info: TensorInfo, rows: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Rows `rows` (sorted, int64) of a 2-D checkpoint tensor as float32, without loading all of it."""
    if source.format != "safetensors":  # .bin tensors are memory-mapped: indexing touches only those pages
        return source.read(info)[rows].float()
    from safetensors import safe_open

    parts = []
    with safe_open(info.file, framework="pt") as f:
        piece = f.get_slice(info.name)
        for begin in range(0, info.shape[0], chunk):
            want = rows[(rows >= begin) & (rows < begin + chunk)]
            if len(want):
                parts.append(piece[begin:begin + chunk][want - begin].float())
    return torch.cat(parts)


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


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """Computed (non-meta) buffers onto `device`; meta parameters stay where they are."""
    for mod in module.modules():
        for key, buf in mod._buffers.items():
            if buf is not None and not buf.is_meta:
                mod._buffers[key] = buf.to(device)


class LayerStream:
    """The decoder layers of a checkpoint run in order over `sequences` of token ids.

    `advance()` runs the next layer and returns its `LayerState`; `prefixes[i]` is layer i's
    attention prefix. Raises `StreamUnsupported` (at construction) where the model cannot be
    split this way.
    """

    def __init__(self, source: SourceCheckpoint, config: Any, sequences: list[list[int]], device: str = "cpu",
                 activation_limit: int | None = None, keep_attention_inputs: bool = False,
                 keep_converted: bool = False):
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        self.source, self.device = source, torch.device(device)
        self.keep_attention_inputs = keep_attention_inputs
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.model = model.eval()
        layers = getattr(model.base_model, "layers", None)
        text_config = config.get_text_config()
        if not isinstance(layers, nn.ModuleList) or len(layers) != text_config.num_hidden_layers:
            raise StreamUnsupported(f"{type(model).__name__} keeps no list of its decoder layers at .layers")
        self.layers = layers
        names = {id(m): n for n, m in model.named_modules()}
        self.layer_names = [names[id(layer)] for layer in layers]
        self.prefixes, self.projections = [], []
        for i, layer in enumerate(layers):
            proj = next((n for n, _ in layer.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS), None)
            if proj is None:
                raise StreamUnsupported(f"decoder layer {i} has no q_proj/qkv_proj")
            self.projections.append(proj)
            self.prefixes.append(f"{self.layer_names[i]}.{proj.rsplit('.', 1)[0]}.")
        self.infos = _checkpoint_names(model, source)
        embedding = model.get_input_embeddings()
        embed_name = names[id(embedding)] + ".weight"
        wanted = [embed_name] + [n for n, _ in layers.named_parameters(prefix=names[id(layers)])]
        missing = [n for n in wanted if n not in self.infos]
        if missing:
            raise StreamUnsupported(f"the checkpoint has no tensor for {missing[0]}")
        _move_buffers(model, self.device)
        self.hidden = text_config.hidden_size
        tokens = sum(len(s) for s in sequences)
        limit = available_memory() // 2 if activation_limit is None else activation_limit
        self.activation_dtype = activation_dtype(tokens, self.hidden, limit)
        self.activations, self.kwargs = self._catch(sequences, embedding, self.infos[embed_name])
        # `--refine-inputs converted`: the converted model's own activations, advanced by the caller
        # (`refine_layer`) through each converted layer; None otherwise
        self.converted = [a.clone() for a in self.activations] if keep_converted else None
        self.position = 0  # the next layer to run
        self.current: LayerState | None = None

    @torch.no_grad()
    def _catch(self, sequences: list[list[int]], embedding: nn.Module, info: TensorInfo
               ) -> tuple[list[torch.Tensor], list[list[dict[str, Any]]]]:
        """Layer-0 inputs per sequence ([T, D], activation dtype, CPU) and every layer's kwargs per sequence."""
        used = torch.tensor(sorted({t for s in sequences for t in s}), dtype=torch.int64)
        weight, padding = embedding.weight, getattr(embedding, "padding_idx", None)
        # only the rows of tokens used, indexed by their rank; padding_idx only matters to gradients
        embedding.weight = nn.Parameter(_read_rows(self.source, info, used).to(self.device), requires_grad=False)
        embedding.padding_idx = None
        records: dict[int, tuple] = {}
        originals = list(self.layers)
        for i, layer in enumerate(originals):
            self.layers[i] = _Catcher(layer, i, records, last=i == len(originals) - 1)
        activations, kwargs = [], []
        try:
            for seq in sequences:
                ids = torch.searchsorted(used, torch.tensor(seq, dtype=torch.int64))[None].to(self.device)
                records.clear()
                try:
                    self.model(input_ids=ids, use_cache=False)
                except _Caught:
                    pass
                except Exception as err:  # the model's forward needs more than the skeleton gives it
                    raise StreamUnsupported(f"its forward failed on the skeleton: {type(err).__name__}: {err}") from err
                if len(records) != len(originals):
                    raise StreamUnsupported(f"its forward called {len(records)} of {len(originals)} decoder layers")
                activations.append(records[0][0][0].to("cpu", self.activation_dtype))
                kwargs.append([records[i][1] for i in range(len(originals))])
        finally:
            for i, layer in enumerate(originals):
                self.layers[i] = layer
            embedding.weight, embedding.padding_idx = weight, padding
        return activations, kwargs

    def _materialise(self, i: int) -> nn.Module:
        """Layer i with its parameters read from the checkpoint, float32, on the device."""
        layer = self.layers[i]
        for mod_name, mod in layer.named_modules(prefix=self.layer_names[i]):
            for key, param in list(mod._parameters.items()):
                if param is not None:
                    value = self.source.read(self.infos[f"{mod_name}.{key}"])
                    value = value.to(self.device, torch.float32 if value.is_floating_point() else value.dtype)
                    mod._parameters[key] = nn.Parameter(value, requires_grad=False)
        return layer

    def release(self) -> None:
        """Free the current layer (back to meta) and its recorded attention inputs."""
        if self.current is not None:
            self.current.layer.to("meta")
            self.current.attention_inputs.clear()
            self.current.attention_kwargs.clear()
            self.current.attention_outputs.clear()
            self.current = None
            trim_heap()

    @torch.no_grad()
    def advance(self) -> LayerState:
        """Run the next decoder layer over every sequence; its outputs replace the activations."""
        if self.position >= len(self.layers):
            raise IndexError("every decoder layer has run")
        self.release()
        i = self.position
        layer = self._materialise(i)
        state = LayerState(i, self.prefixes[i], layer, layer.get_submodule(self.projections[i].rsplit(".", 1)[0]),
                           torch.zeros(0), 0)
        total: list[torch.Tensor] = []

        def moments(_module, args):
            state.tokens += add_moments(total, args[0])

        def attention_inputs(_module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            state.attention_inputs.append(hidden[0].float().cpu())
            state.attention_kwargs.append({k: v for k, v in kwargs.items() if k != "hidden_states"})

        def attention_outputs(_module, _args, _kwargs, output):
            state.attention_outputs.append((output[0] if isinstance(output, tuple) else output)[0].float().cpu())

        handles = [layer.get_submodule(self.projections[i]).register_forward_pre_hook(moments)]
        if self.keep_attention_inputs:
            handles.append(state.attention.register_forward_pre_hook(attention_inputs, with_kwargs=True))
            if self.converted is None:  # the targets of refinement on the original inputs
                handles.append(state.attention.register_forward_hook(attention_outputs, with_kwargs=True))
        try:
            for s, x in enumerate(self.activations):
                out = layer(x.to(self.device, torch.float32)[None], **self.kwargs[s][i])
                out = out[0] if isinstance(out, tuple) else out
                self.activations[s] = out[0].to("cpu", self.activation_dtype)
        finally:
            for h in handles:
                h.remove()
        state.sigma = total[0].div_(state.tokens).cpu()
        self.position += 1
        self.current = state
        self._keep_only_what_is_used(state)
        return state

    def _keep_only_what_is_used(self, state: LayerState) -> None:
        """Free the parts of the layer just run that nothing uses while it is converted: the fit reads
        the checkpoint itself; refinement on the original inputs needs the attention's recorded inputs
        and outputs (its targets) and of the module only its norms (which a student may copy);
        only `--refine-inputs converted` runs the layer again. At 70B widths the MLP alone is 2.6 GiB in
        float32 and the attention's matrices 1 GiB, otherwise held through the layer's fit and refinement."""
        if self.converted is None:
            free_parameters(state.layer, keep=state.attention if self.keep_attention_inputs else None)
            free_parameters(state.attention, linear_only=True)
            trim_heap()


def add_moments(total: list[torch.Tensor], x: torch.Tensor) -> int:
    """Add x̃ᵀx̃ (float64, x̃ = [x; 1] per row) of attention inputs x [..., D] to total[0], in place
    (no [D+1, D+1] temporaries: 512 MiB each at width 8192), or start it; returns the rows added."""
    x = x.reshape(-1, x.shape[-1]).double()
    x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype, device=x.device)], dim=1)
    if total:
        total[0].addmm_(x.T, x)
    else:
        total.append(x.T @ x)
    return len(x)


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
