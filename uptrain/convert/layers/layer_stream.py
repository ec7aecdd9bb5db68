"""Running a checkpoint one decoder layer at a time over calibration sequences (GPTQ-style).

The model is built as a skeleton whose parameters are on the meta device (buffers such as the
rotary frequencies are computed for real). The input embedding gets only the rows of the tokens
used, read from the checkpoint; one forward pass per sequence through the skeleton, with every
decoder layer replaced by a catcher, records what the model's own forward hands each layer:
the hidden states entering layer 0 (embedding scales, e.g. Gemma's, included) and each layer's
keyword arguments (rotary position embeddings, masks per layer type, position ids). Then each
layer in turn is materialised from the checkpoint (float32, on the device), every sequence is run
through it, its attention-input second moment is recorded, its outputs become the next layer's
inputs, and the layer goes back to meta when the next one runs (`layer.Layer` owns each layer's
life: what it keeps, what it answers, when it is freed).

Memory: one decoder layer in float32, the activations (tokens x hidden, float32, or bfloat16 when
float32 would exceed `activation_limit`), the embedding rows of the distinct tokens, and the
moments kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from uptrain.stopping import at_once
from uptrain.convert.io.source import SourceCheckpoint, TensorInfo
from uptrain.convert.layers.layer import Layer, LayerGone
from uptrain.convert.math.capture import Moments, summing_moments
from uptrain.errors import UsageError
from uptrain.threads import available_memory

PROJECTIONS = ("q_proj", "qkv_proj")  # the attention's input projection: what it sees is the attention input


class StreamUnsupported(Exception):
    """This checkpoint cannot be run layer by layer (the message says why); run it whole instead."""


class _Caught(Exception):
    pass


SCORED_TOKENS = 4096  # calibration tokens the source's own head scores (`LayerStream.source_loss`)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside the block (process-wide), restored after; nothing
    set where it is `n` already (a call costs a thread-pool resize)."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)


def activation_dtype(tokens: int, hidden: int, limit: int) -> torch.dtype:
    """float32 when tokens x hidden activations fit in `limit` bytes as float32, else bfloat16."""
    return torch.float32 if tokens * hidden * 4 <= limit else torch.bfloat16


class _StandIn(nn.Module):
    """A stand-in for a decoder layer in the model's forward; attributes it lacks are the layer's."""

    def __getattr__(self, name: str) -> Any:  # the model's forward may read layer attributes (attention_type)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)


class _Catcher(_StandIn):
    """Stands in for decoder layer `index`: records its inputs, passes the hidden states on; the last raises."""

    def __init__(self, layer: nn.Module, index: int, records: dict[int, tuple], last: bool):
        super().__init__()
        self.layer, self.index, self.records, self.last = layer, index, records, last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        self.records[self.index] = (hidden, {k: v for k, v in kwargs.items() if k != "hidden_states"})
        if self.last:
            raise _Caught
        return hidden


class _Replay(_StandIn):
    """Stands in for a decoder layer once the stream has run them all (`LayerStream.source_loss`):
    passes the hidden states on, or (the last layer) returns its recorded outputs [T, D]."""

    def __init__(self, layer: nn.Module, outputs: torch.Tensor | None):
        super().__init__()
        self.layer, self.outputs = layer, outputs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]
        return hidden if self.outputs is None else self.outputs.to(hidden.device, hidden.dtype)[None]


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


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """Computed (non-meta) buffers onto `device`; meta parameters stay where they are."""
    for mod in module.modules():
        for key, buf in mod._buffers.items():
            if buf is not None and not buf.is_meta:
                mod._buffers[key] = buf.to(device)


class LayerStream:
    """The decoder layers of a checkpoint run in order over `sequences` of token ids.

    `advance()` runs the next layer and returns its `Layer` (which owns what was recorded, see
    `layer.py`: keep and users are its); `prefixes[i]` is layer i's attention prefix. Raises
    `StreamUnsupported` (at construction) where the model cannot be split this way.
    """

    def __init__(self, source: SourceCheckpoint, config: Any, sequences: list[list[int]], device: str = "cpu",
                 activation_limit: int | None = None, keep: str = "moments", users: int = 1,
                 progress: Callable[[str, int], Callable[[int], None]] | None = None):
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        self.source, self.device = source, torch.device(device)
        self.keep, self.users = keep, users
        # (what, sequences) -> a tick per sequence of a pass (`progress.sequence_progress`); None: silent
        self.progress = progress
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
        # `--refine-inputs converted`: layer 0's inputs, where each conversion starts its own
        # model's activations (`first_inputs`); None otherwise
        self._first = [a.clone() for a in self.activations] if keep in ("layer", "all") else None
        self.position = 0  # the next layer to run
        self.current: Layer | None = None
        # the head pass swaps the model's layers for replays: one at a time (a sweep's users end in threads)
        self._head_turn = threading.Lock()

    def first_inputs(self, count: int | None = None) -> list[torch.Tensor]:
        """A copy of the hidden states entering layer 0 (per sequence [T, D]; the first `count` sequences,
        None: all), kept with keep='layer' or 'all'."""
        if self._first is None:
            raise LayerGone("the stream keeps layer 0's inputs only with keep='layer' (--refine-inputs converted)")
        return [a.clone() for a in self._first[:count]]

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
        tick = self._ticker("calibrate embedding", len(sequences))
        try:
            for seq in sequences:
                at_once.check()
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
                if tick is not None:
                    tick(len(activations))
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
        """Free the layer run last (`Layer.free`): its module back to meta, its recordings dropped."""
        if self.current is not None:
            self.current.free(f"the stream moved on to layer {self.position}" if self.position < len(self.layers)
                              else "the stream was released")
            self.current = None

    def advance(self) -> Layer:
        """Free the layer run last, then run the next one over every sequence: its outputs replace
        the activations, and the `Layer` returned holds what `keep` names."""
        if self.position >= len(self.layers):
            raise IndexError("every decoder layer has run")
        self.release()
        i = self.position
        self.position += 1
        layer = Layer(i, self.prefixes[i], self._materialise(i), self.projections[i], [k[i] for k in self.kwargs],
                      self.keep, self.users, self.device)
        layer.run(self.activations, self.activation_dtype,
                  self._ticker(f"calibrate layer {i}", len(self.activations)))
        self.current = layer
        return layer

    @torch.no_grad()
    def source_loss(self, sequences: list[list[int]], max_tokens: int = SCORED_TOKENS) -> tuple[float, int]:
        """The source's mean next-token loss (nats/token) on the calibration text and the tokens scored:
        once every layer ran, the model's own head (`_head`) over the last layer's outputs of the first
        sequences, up to `max_tokens` tokens (at 7B width a 4,096-token head pass is ~10 s on a CPU)."""
        total = count = 0.0
        with self._head(max(len(s) for s in sequences)) as logits_of:
            for s, seq in enumerate(sequences):
                if count >= max_tokens or len(seq) < 2:
                    continue
                logits = logits_of(self.activations[s])
                ids = torch.tensor(seq[1:], device=logits.device)
                total += torch.nn.functional.cross_entropy(logits[:-1], ids, reduction="sum").item()
                count += len(seq) - 1
        return total / max(count, 1), int(count)

    @torch.no_grad()
    def kl_to_source(self, tracks: dict[str, list[torch.Tensor]]) -> tuple[dict[str, float], int]:
        """KL(source || model) in nats/token of each model in `tracks` (name -> the last layer's outputs
        [T, D] of the first len(...) calibration sequences, as that model computes them), against the
        source's own outputs of the same sequences, both through the source's head (`_head`; a
        conversion does not change it); and the tokens compared."""
        count = len(next(iter(tracks.values())))
        totals = dict.fromkeys(tracks, 0.0)
        tokens = 0
        with self._head(max(int(self.activations[s].shape[0]) for s in range(count))) as logits_of:
            for s in range(count):
                at_once.check()
                source = torch.log_softmax(logits_of(self.activations[s]), -1)
                for name, outputs in tracks.items():
                    model = torch.log_softmax(logits_of(outputs[s]), -1)
                    totals[name] += (source.exp() * (source - model)).sum().item()
                tokens += int(source.shape[0])
        return {name: total / max(tokens, 1) for name, total in totals.items()}, tokens

    @contextmanager
    def _head(self, longest: int) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """Once every layer ran: hidden states [T, D] after the last layer -> the model's logits [T, V]
        (float32), by the model's own head (final norm, output projection, any logit scaling) read from
        the checkpoint for the block. The decoder layers stand in as replays (the last returns the
        hidden states given), so no layer runs again. StreamUnsupported where the head and the logits
        of a `longest`-token sequence would exceed a quarter of the memory available."""
        with self._head_turn:  # one caller at a time (the replays are the model's own layers)
            if self.position != len(self.layers):
                raise RuntimeError("the head needs every layer run first")
            head_shape = self.model.get_output_embeddings().weight.shape  # [vocab, hidden]
            need = 4 * head_shape[0] * (head_shape[1] + 2 * longest)  # head + logits, float32
            if need > available_memory() // 4:  # (Llama-3-70B: 4.2 GiB of head) the stream's own bound comes first
                raise StreamUnsupported(f"the output head and its logits ({need / 2**30:.1f} GiB in float32) exceed a "
                                        f"quarter of the memory available")
            names = {id(m): n for n, m in self.model.named_modules()}
            in_layers = {id(p) for p in self.layers.parameters()}
            head, embedding = self.model.get_output_embeddings(), self.model.get_input_embeddings()
            tied = self.infos.get(f"{names[id(embedding)]}.weight")  # a head tied to the embedding reads its rows
            restore = []
            originals = list(self.layers)
            last = _Replay(originals[-1], None)

            def logits_of(hidden: torch.Tensor) -> torch.Tensor:
                last.outputs = hidden
                zeros = torch.zeros((1, *hidden.shape), device=self.device, dtype=torch.float32)
                return self.model(inputs_embeds=zeros, use_cache=False).logits[0].float()

            try:
                for mod_name, mod in self.model.named_modules():
                    for key, param in list(mod._parameters.items()):
                        if param is None or id(param) in in_layers or (param is embedding.weight and mod is not head):
                            continue  # the layers are replayed, the embedding is not used (inputs_embeds)
                        own = self.infos.get(f"{mod_name}.{key}")
                        info = own or (tied if mod is head and key == "weight" else None)
                        if info is None:
                            raise StreamUnsupported(f"the checkpoint has no tensor for {mod_name}.{key}")
                        restore.append((mod, key, param))
                        mod._parameters[key] = nn.Parameter(self.source.read(info).to(self.device, torch.float32),
                                                            requires_grad=False)
                for i, layer in enumerate(originals):
                    self.layers[i] = last if i == len(originals) - 1 else _Replay(layer, None)
                yield logits_of
            finally:
                for i, layer in enumerate(originals):
                    self.layers[i] = layer
                for mod, key, param in restore:
                    mod._parameters[key] = param

    def _ticker(self, what: str, total: int) -> Callable[[int], None] | None:
        """A tick per sequence of a pass (`calibrate layer 3: sequence 40/128, ~12 s left in this layer`
        at most every ~10 s: a 7B layer's pass takes minutes); None where `progress` is."""
        return None if self.progress is None else self.progress(what, total)


@torch.no_grad()
def whole_model_moments(model: Any, sequences: list[list[int]], device: str) -> dict[str, torch.Tensor]:
    """E[x̃ x̃ᵀ] per attention prefix from hooks on q_proj/qkv_proj of a whole loaded model.

    The fallback where a model cannot be streamed layer by layer. Returns {prefix: [D+1, D+1] float64}.
    """
    sums = {name[: -len(leaf)]: (module, Moments()) for name, module in model.named_modules()
            for leaf in PROJECTIONS if name.endswith("." + leaf)}
    if not sums:
        raise UsageError("calibration found no q_proj/qkv_proj modules in the model")
    with ExitStack() as hooks:
        for module, moments in sums.values():
            hooks.enter_context(summing_moments(module, moments))
        for seq in sequences:
            at_once.check()
            model(input_ids=torch.tensor([seq], device=device), use_cache=False)
    return {prefix: moments.mean() for prefix, (_, moments) in sums.items()}
