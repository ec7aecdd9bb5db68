"""Calibration for `--method fit` / `--grouping similar` (`--calib FILE --calib-tokens N`).

Runs the ORIGINAL model over N tokens of real text and records, for every layer, the second moment
E[x̃ x̃ᵀ] of the attention input x (what q/k/v projections see, after the input norm), augmented
with a constant 1 so that biases are fitted too: x̃ = [x; 1].

The model runs one decoder layer at a time (`layer_stream.LayerStream`, on `--device`), as far as
the conversion has asked: memory is one layer in float32 plus the activations. A model that cannot
be split so (the record says why) is loaded whole instead. Text is read by the trainer's and eval's
reader (`uptrain.data.read_documents`), so a file means the same documents everywhere: a .txt file
is cut by `text_unit` (default `paragraph`: documents separated by a blank line; `line`; `file`),
.jsonl/.json/.parquet give each record's "text" field.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from uptrain.convert.layer_stream import (PROJECTIONS, LayerState, LayerStream, StreamUnsupported, activation_dtype,
                                          add_moments, available_memory)
from uptrain.convert.source import open_checkpoint, read_config
from uptrain.data import DataSource, read_documents
from uptrain.errors import UsageError

WINDOW = 2048  # longest forward pass (tokens); documents longer than the model's context are cut in pieces


def layer_index(prefix: str) -> int:
    """The decoder-layer number in an attention prefix: the last dotted integer ('….layers.3.self_attn.' -> 3)."""
    numbers = re.findall(r"(?:^|\.)(\d+)(?=\.)", prefix)
    if not numbers:
        raise UsageError(f"calibration cannot tell the layer number of {prefix.rstrip('.')}")
    return int(numbers[-1])


def read_calibration_texts(path: Path, text_unit: str = DataSource.text_unit) -> list[str]:
    """The documents of a calibration file, read as the trainer and eval read it (`text_unit` for .txt).

    UsageError (naming --calib) if it is missing, unreadable or holds no text.
    """
    if not path.exists():
        raise UsageError(f"--calib file {path} does not exist; pass a text file (.txt, .jsonl, .json or .parquet)")
    try:
        return read_documents(DataSource(files=[str(path)], text_unit=text_unit))
    except UsageError as err:
        raise UsageError(f"--calib: {err}") from None


def calibration_sequences(texts: list[str], tokenizer: Any, tokens: int, window: int
                          ) -> tuple[list[list[int]], list[int], int, int]:
    """The forward passes of a calibration: (token-id sequences, the document each came from
    (an index into `texts`), tokens used, documents used).

    Each document is tokenized alone and cut to the tokens still wanted, then into windows of at
    most `window` tokens; documents are taken in order until `tokens` are used.
    """
    sequences: list[list[int]] = []
    document_of: list[int] = []
    used = docs = 0
    for d, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"][: tokens - used]
        windows = [ids[begin:begin + window] for begin in range(0, len(ids), window)]
        sequences += windows
        document_of += [d] * len(windows)
        used += len(ids)
        docs += 1
        if used >= tokens:
            break
    return sequences, document_of, used, docs


def check_device(device: str) -> None:
    """UsageError (one line) where torch cannot place a tensor on `device` ('cuda' on a CPU-only torch, 'cdua')."""
    import torch

    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise UsageError(f"--device {device!r} is not usable here: {first}; pass --device cpu or a device "
                         f"this torch has") from None


@torch.no_grad()
def whole_model_moments(model: Any, sequences: list[list[int]], device: str) -> dict[str, torch.Tensor]:
    """E[x̃ x̃ᵀ] per attention prefix from hooks on q_proj/qkv_proj of a whole loaded model.

    The fallback where a model cannot be streamed layer by layer. Returns {prefix: [D+1, D+1] float64}.
    """
    sums: dict[str, list[torch.Tensor]] = {}
    counts: dict[str, int] = {}

    def hook(prefix: str):
        def pre(_module, args):
            counts[prefix] = counts.get(prefix, 0) + add_moments(sums.setdefault(prefix, []), args[0])
        return pre
    handles = [module.register_forward_pre_hook(hook(name[: -len(leaf)]))
               for name, module in model.named_modules()
               for leaf in PROJECTIONS if name.endswith("." + leaf)]
    if not handles:
        raise UsageError("calibration found no q_proj/qkv_proj modules in the model")
    try:
        for seq in sequences:
            model(input_ids=torch.tensor([seq], device=device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {k: (s[0] / counts[k]).cpu() for k, s in sums.items()}


@dataclass
class Calibration:
    """Attention-input moments of a model, computed layer by layer as they are asked for.

    activation_limit: bytes the float32 activations (tokens x hidden x 4) may take before they are
    kept in bfloat16; None: half the memory available when the calibration starts.
    keep_attention_inputs: record each layer's attention inputs and kwargs (`state`).
    """

    path: Path
    tokens: int
    device: str = "cpu"
    text_unit: str = DataSource.text_unit  # what one document of a .txt file is (as the trainer's data.*.text_unit)
    record: dict[str, Any] = field(default_factory=dict)  # what the conversion record says about it
    activation_limit: int | None = None
    keep_attention_inputs: bool = False
    keep_converted: bool = False  # also keep the converted model's activations (`--refine-inputs converted`)
    _moments: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # by decoder-layer index
    _handed_out: set[int] = field(default_factory=set, repr=False)
    _stream: LayerStream | None = field(default=None, repr=False)
    _started: bool = field(default=False, repr=False)
    _model_dir: Path | None = field(default=None, repr=False)
    _windows: tuple | None = field(default=None, repr=False)  # calibration_sequences' answer, once

    def __post_init__(self):
        if self.tokens <= 0:
            raise UsageError(f"--calib-tokens must be positive, got {self.tokens}")
        self.path = Path(self.path)
        read_calibration_texts(self.path, self.text_unit)  # fail now, before any work
        check_device(self.device)
        self.record.update(file=str(self.path), text_unit=self.text_unit, tokens_requested=self.tokens,
                           device=self.device)

    def bind(self, model_dir: Path) -> "Calibration":
        model_dir = Path(model_dir)
        if self._model_dir is not None and self._model_dir != model_dir:
            raise ValueError("a Calibration belongs to one model")
        self._model_dir = model_dir
        return self

    def _limit(self) -> int:
        if self.activation_limit is None:
            self.activation_limit = available_memory() // 2
        return self.activation_limit

    def describe(self, source_params: int) -> tuple[str, int]:
        """The plan's note on this calibration and the bytes it holds at most (estimated from config.json)."""
        raw = read_config(self._model_dir)
        text = raw.get("text_config") or raw
        hidden, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
        embeddings = int(text.get("vocab_size", 0)) * hidden * (1 if raw.get("tie_word_embeddings", True) else 2)
        layer_bytes = max(source_params - embeddings, 0) // max(layers, 1) * 4
        dtype = activation_dtype(self.tokens, hidden, self._limit())
        act_bytes = self.tokens * hidden * dtype.itemsize
        sigma_bytes = (hidden + 1) ** 2 * 8
        mib = 2 ** 20
        note = (f"calibration streams the model one decoder layer at a time on {self.device} over "
                f"{self.tokens:,} tokens of {self.path}: memory about one layer ({layer_bytes / mib:.1f} MiB "
                f"float32) + activations ({act_bytes / mib:.1f} MiB {str(dtype).removeprefix('torch.')}"
                f"{', float32 would exceed the limit' if dtype != torch.float32 else ''}) + "
                f"{sigma_bytes / mib:.1f} MiB of moments per layer run but not yet converted")
        return note, layer_bytes + act_bytes + layers * sigma_bytes

    def _index(self, layer: str) -> int:
        """The decoder-layer index of an attention prefix: a loaded-module prefix of the stream
        ('model.layers.3.self_attn.') or a checkpoint prefix that names it differently (EXAONE's
        'transformer.h.3.attn.attention.'): both carry the layer's number."""
        if self._stream is not None and layer in self._stream.prefixes:
            return self._stream.prefixes.index(layer)
        return layer_index(layer)

    def sigma(self, layer: str) -> torch.Tensor:
        """E[x̃ x̃ᵀ] of the attention input of `layer` (a tensor-name prefix like 'model.layers.0.self_attn.').

        Runs the stream up to that layer; the moments of layers passed over are kept until asked
        for, and each layer's are handed out once (then forgotten: at width 8192 one is 512 MiB).
        """
        if self._index(layer) in self._handed_out:  # a second conversion with this calibration: run again
            self._restart()
        if not self._started:
            self._start()
        index = self._index(layer)
        while index not in self._moments and self._stream is not None and self._stream.position < len(
                self._stream.layers):
            start = time.perf_counter()
            state = self._stream.advance()
            self._moments[state.index] = state.sigma
            self.record["seconds"] = round(self.record["seconds"] + time.perf_counter() - start, 2)
            self.record["layers_run"] = self._stream.position
        try:
            sigma = self._moments.pop(index)  # the conversion asks once per layer: held no longer
        except KeyError:
            raise UsageError(f"calibration found no attention module {layer.rstrip('.')} in the loaded model") from None
        self._handed_out.add(index)
        return sigma

    def _restart(self) -> None:
        """Forget the run so far: the next `sigma` runs the stream again from the first layer."""
        if self._stream is not None:
            self._stream.release()
        self._stream, self._started = None, False
        self._moments.clear()
        self._handed_out.clear()

    @property
    def stream(self) -> LayerStream | None:
        """The layer stream (None before the first `sigma`, or where the model was run whole)."""
        return self._stream

    def state(self, layer: str) -> LayerState | None:
        """The stream's state of `layer` (either prefix, see `sigma`) if it is the layer run last
        (after `sigma(layer)`), else None (also where the model was not streamed)."""
        current = self._stream.current if self._stream is not None else None
        return current if current is not None and current.index == self._index(layer) else None

    def windows(self) -> tuple[list[list[int]], list[int], int, int]:
        """`calibration_sequences` of the bound model's tokenizer and window (computed once): the
        token ids of each forward pass, its document, tokens used, documents used."""
        if self._windows is None:
            from transformers import AutoConfig, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self._model_dir)
            config = AutoConfig.from_pretrained(self._model_dir)
            window = min(WINDOW, getattr(config.get_text_config(), "max_position_embeddings", None) or WINDOW)
            self._windows = calibration_sequences(read_calibration_texts(self.path, self.text_unit), tokenizer,
                                                  self.tokens, window)
        return self._windows

    @property
    def documents(self) -> list[int]:
        """The document of each calibration sequence (in the stream's order)."""
        return self.windows()[1]

    @torch.no_grad()
    def _start(self) -> None:
        """Tokenize, then open the layer stream (or, where it cannot stream, run the whole model)."""
        from transformers import AutoConfig

        start = time.perf_counter()
        self._started = True
        sequences, _, used, docs = self.windows()
        config = AutoConfig.from_pretrained(self._model_dir)
        self.record.update(tokens_used=used, documents=docs)
        try:
            self._stream = LayerStream(open_checkpoint(self._model_dir), config, sequences, self.device,
                                       activation_limit=self._limit(),
                                       keep_attention_inputs=self.keep_attention_inputs,
                                       keep_converted=self.keep_converted)
            self.record.update(mode="layer by layer",
                               activations=str(self._stream.activation_dtype).removeprefix("torch."))
        except StreamUnsupported as why:
            from transformers import AutoModelForCausalLM

            self.record.update(mode="whole model", why_not_streamed=str(why))
            model = AutoModelForCausalLM.from_pretrained(self._model_dir, dtype=torch.float32).to(self.device).eval()
            self._moments = {layer_index(k): v for k, v in whole_model_moments(model, sequences, self.device).items()}
            del model
        self.record["seconds"] = round(time.perf_counter() - start, 2)
