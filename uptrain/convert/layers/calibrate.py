"""Calibration for `--method fit` / `--grouping similar` (`--calib FILE --calib-tokens N`).

Runs the ORIGINAL model over N tokens of real text and records, for every layer, the second moment
E[x̃ x̃ᵀ] of the attention input x (what q/k/v projections see, after the input norm), augmented
with a constant 1 so that biases are fitted too: x̃ = [x; 1].

The model runs one decoder layer at a time (`layer_stream.LayerStream`, on `--device`), as far as
the conversion has asked: memory is one layer in float32 plus the activations. A model that cannot
be split so (the record says why) is loaded whole instead. Each layer is a `layer.Layer`, which owns
what it recorded until it is freed; several conversions (a sweep's K/V counts, `several.py`) can
read one stream as its users, each layer run once for all. Text is read by the trainer's and eval's
reader (`uptrain.data.read_documents`), so a file means the same documents everywhere: a .txt file
is cut by `text_unit` (default `paragraph`: documents separated by a blank line; `line`; `file`),
.jsonl/.json/.parquet give each record's "text" field.
"""

from __future__ import annotations

import re
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from uptrain import interrupt
from uptrain.convert.layers.layer import KEEP, Layer, LayerGone
from uptrain.convert.layers.layer_stream import (PROJECTIONS, LayerStream, StreamUnsupported, activation_dtype,
                                                 available_memory)
from uptrain.convert.math.capture import Moments, summing_moments
from uptrain.convert.io.source import open_checkpoint, read_config
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
    sums = {name[: -len(leaf)]: (module, Moments()) for name, module in model.named_modules()
            for leaf in PROJECTIONS if name.endswith("." + leaf)}
    if not sums:
        raise UsageError("calibration found no q_proj/qkv_proj modules in the model")
    with ExitStack() as hooks:
        for module, moments in sums.values():
            hooks.enter_context(summing_moments(module, moments))
        for seq in sequences:
            interrupt.check()
            model(input_ids=torch.tensor([seq], device=device), use_cache=False)
    return {prefix: moments.mean() for prefix, (_, moments) in sums.items()}


@dataclass
class Calibration:
    """Attention-input moments (and, for refinement, recordings) of a model, run layer by layer as asked.

    activation_limit: bytes the float32 activations (tokens x hidden x 4) may take before they are
    kept in bfloat16; None: half the memory available when the calibration starts.
    keep: what each layer keeps after its run (`layer.KEEP`): 'moments' for the fit, 'attention'
    for refinement on the original inputs, 'layer' for refinement on the converted ones.
    users: how many conversions read this one stream at once (a sweep's K/V counts, each in its own
    thread, user 0..users-1): a layer is freed only once every user has moved past it.
    """

    path: Path
    tokens: int
    device: str = "cpu"
    text_unit: str = DataSource.text_unit  # what one document of a .txt file is (as the trainer's data.*.text_unit)
    record: dict[str, Any] = field(default_factory=dict)  # what the conversion record says about it
    activation_limit: int | None = None
    keep: str = "moments"
    users: int = 1
    _layers: dict[int, Layer] = field(default_factory=dict, repr=False)  # run, moments not yet taken by all
    _at: dict[int, float] = field(default_factory=dict, repr=False)  # user -> the layer it asked for last
    _passed: set[int] = field(default_factory=set, repr=False)  # layers every user has taken
    _stream: LayerStream | None = field(default=None, repr=False)
    _started: bool = field(default=False, repr=False)
    _failed: str = field(default="", repr=False)  # a user failed: the others stop waiting
    _model_dir: Path | None = field(default=None, repr=False)
    _windows: tuple | None = field(default=None, repr=False)  # calibration_sequences' answer, once
    _turn: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def __post_init__(self):
        if self.tokens <= 0:
            raise UsageError(f"--calib-tokens must be positive, got {self.tokens}")
        if self.keep not in KEEP:
            raise ValueError(f"keep must be one of {KEEP}, not {self.keep!r}")
        self.path = Path(self.path)
        read_calibration_texts(self.path, self.text_unit)  # fail now, before any work
        check_device(self.device)
        self.record.update(file=str(self.path), text_unit=self.text_unit, tokens_requested=self.tokens,
                           device=self.device, passes=0)

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

    def sigma(self, layer: str, user: int = 0) -> torch.Tensor:
        """E[x̃ x̃ᵀ] of the attention input of `layer` (a tensor-name prefix like 'model.layers.0.self_attn.'),
        taken by `user` (once: at width 8192 it is 512 MiB). With one user, a layer whose moments it
        took already (a second conversion, as the method bake-off does) runs the stream again."""
        with self._turn:
            index = self._started_index(layer)
            found = self._layers.get(index)
            if self.users == 1 and (index in self._passed or (found is not None and found.moments_left == 0)):
                self._restart()
                index = self._index(layer)
            return self._layer(index, user, layer).moments()

    def layer(self, layer: str, user: int = 0) -> Layer:
        """The `Layer` of attention prefix `layer` (either prefix, see `_index`), run by the stream.

        Runs the stream up to it; layers passed over keep their moments until each user took them.
        Asking for a layer means `user` is done with every layer before it: the stream frees the layer
        run last once every user has asked for a later one (or has `leave`n). Blocks while other
        users still hold the layer run last.
        """
        with self._turn:
            return self._layer(self._started_index(layer), user, layer)

    def _started_index(self, layer: str) -> int:
        if not self._started:
            self._start()
        return self._index(layer)

    def _layer(self, index: int, user: int, layer: str) -> Layer:
        self._at[user] = index
        self._turn.notify_all()
        while True:
            if self._failed:
                raise RuntimeError(f"the calibration stream stopped: {self._failed}")
            if index in self._layers:
                return self._layers[index]
            stream = self._stream
            if stream is not None and index < stream.position:  # run, then freed: not a missing module
                raise LayerGone(f"layer {index} ({layer.rstrip('.')}) is gone: the calibration stream had moved on "
                                f"to layer {stream.position} when user {user} asked for it (a shared stream frees "
                                f"a layer once every user has asked for a later one or left)")
            if stream is None or stream.position >= len(stream.layers):
                raise UsageError(f"calibration found no attention module {layer.rstrip('.')} in the loaded model")
            if self._can_advance():
                self._advance()
            else:
                self._turn.wait()

    def _can_advance(self) -> bool:
        current = self._stream.current
        return current is None or all(self._at.get(u, -1) > current.index for u in range(self.users))

    def _advance(self) -> None:
        """Run the next layer; forget the layers that are freed and whose moments every user has."""
        start = time.perf_counter()
        layer = self._stream.advance()
        for index in [i for i, done in self._layers.items() if done.state == "freed" and done.moments_left == 0]:
            del self._layers[index]
            self._passed.add(index)
        self._layers[layer.index] = layer
        self.record["seconds"] = round(self.record["seconds"] + time.perf_counter() - start, 2)
        self.record["layers_run"] = self._stream.position

    def leave(self, user: int, failed: str = "") -> None:
        """`user` is done with every layer (its conversion ended); `failed`: it ended with this error,
        and the users still waiting for the stream stop with it."""
        with self._turn:
            self._at[user] = float("inf")
            if failed and self.users > 1:
                self._failed = failed
            self._turn.notify_all()

    def _restart(self) -> None:
        """Forget the run so far: the stream runs again from the first layer."""
        if self._stream is not None:
            self._stream.release()
        self._stream, self._started = None, False
        self._layers.clear()
        self._passed.clear()
        self._at.clear()
        self._start()

    def first_inputs(self) -> list[torch.Tensor]:
        """A copy of layer 0's inputs, where a conversion refining on its own inputs starts them."""
        with self._turn:
            if not self._started:
                self._start()
            return self._streaming().first_inputs()

    def _streaming(self) -> LayerStream:
        if self._stream is None:
            why = self.record.get("why_not_streamed", "the calibration has not started")
            raise LayerGone(f"the calibration was not run layer by layer ({why})")
        return self._stream

    @property
    def streamed(self) -> bool:
        """Whether the model runs layer by layer (False where it was run whole: record['why_not_streamed'])."""
        return self.record.get("mode") != "whole model"

    def windows(self) -> tuple[list[list[int]], list[int], int, int]:
        """`calibration_sequences` of the bound model's tokenizer and window (computed once): the
        token ids of each forward pass, its document, tokens used, documents used."""
        with self._turn:
            return self._tokenized()

    def _tokenized(self) -> tuple[list[list[int]], list[int], int, int]:
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

        interrupt.pause("calibrate")
        start = time.perf_counter()
        self._started = True
        self.record["passes"] += 1
        sequences, _, used, docs = self.windows()
        config = AutoConfig.from_pretrained(self._model_dir)
        self.record.update(tokens_used=used, documents=docs)
        try:
            self._stream = LayerStream(open_checkpoint(self._model_dir), config, sequences, self.device,
                                       activation_limit=self._limit(), keep=self.keep, users=self.users)
            self.record.update(mode="layer by layer",
                               activations=str(self._stream.activation_dtype).removeprefix("torch."))
        except StreamUnsupported as why:
            from transformers import AutoModelForCausalLM

            self.record.update(mode="whole model", why_not_streamed=str(why))
            model = AutoModelForCausalLM.from_pretrained(self._model_dir, dtype=torch.float32).to(self.device).eval()
            moments = whole_model_moments(model, sequences, self.device)
            del model
            reason = f"the model was run whole: {why}"
            self._layers = {layer_index(k): Layer.moments_only(layer_index(k), k, v, self.users, reason)
                            for k, v in moments.items()}
        self.record["seconds"] = round(self.record.get("seconds", 0) + time.perf_counter() - start, 2)
