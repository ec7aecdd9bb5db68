"""Calibration for `--method fit` / `--grouping similar` (`--calib FILE --calib-tokens N`).

Runs the ORIGINAL model over N tokens of real text and records, for every layer, the second moment
E[x̃ x̃ᵀ] of the attention input x (what q/k/v projections see, after the input norm), augmented
with a constant 1 so that biases are fitted too: x̃ = [x; 1].

The model runs one decoder layer at a time (`layer_stream.LayerStream`, on `--device`), as far as
the conversion has asked: memory is one layer in float32 plus the activations. A model that cannot
be split so (the record says why) is loaded whole instead. Each layer is a `layer.Layer`, which owns
what it recorded until it is freed; several conversions (a sweep's K/V counts, `several.py`) can
read one stream as its users, each through its own handle (`Calibration.user(i)`), each layer run
once for all (who may read which layer when, when a layer is freed, what a user that falls behind
gets, the one-user restart rule: `schedule.py`). Text is read by the trainer's and eval's reader
(`uptrain.data.read_documents`), so a file means the same documents everywhere: a .txt file is cut
by `text_unit` (default `paragraph`: documents separated by a blank line; `line`; `file`),
.jsonl/.json/.parquet give each record's "text" field.
"""

from __future__ import annotations

import bisect
import math
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from uptrain.stopping import at_once
from uptrain.convert.layers.layer import KEEP, Layer, LayerGone
from uptrain.convert.layers.layer_stream import (LayerStream, StreamUnsupported, activation_dtype, available_memory,
                                                 torch_threads, whole_model_moments)
from uptrain.convert.layers.schedule import StreamSchedule, StreamUser, stream_keep
from uptrain.convert.io.source import open_checkpoint, read_config
from uptrain.convert.registry.choices import CALIB_WINDOWS
from uptrain.data import DataSource, read_documents
from uptrain.data.overlap import digests
from uptrain.errors import UsageError
from uptrain.units import NEAR_CHANCE

WINDOW = 2048  # longest forward pass (tokens); documents longer than the model's context are cut in pieces
MIN_WINDOWS = 8  # `repeat_windows` cuts a budget into at least about this many windows (shorter ones if need be)


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
        return read_documents(DataSource(files=[str(path)], text_unit=text_unit), field_option=None)
    except UsageError as err:
        raise UsageError(f"--calib: {err}") from None


ONE_DOCUMENT_LINES = 20  # a .txt read as one document with at least this many lines is worth a warning


def one_document_warning(path: Path, text_unit: str, texts: list[str]) -> str | None:
    """A warning when a .txt file read by paragraphs is one document of many lines: a file with one
    document per line and no blank lines between them, which calibration would read as one long
    text running across documents."""
    if text_unit != "paragraph" or path.suffix.lower() != ".txt" or len(texts) != 1:
        return None
    lines = texts[0].count("\n") + 1
    if lines < ONE_DOCUMENT_LINES:
        return None
    return (f"{path} was read as ONE document of {lines:,} lines (no blank line separates documents); if it holds "
            f"one document per line, pass --calib-text-unit line")


def shortfall_warning(record: dict) -> str | None:
    """The warning where a calibration used fewer tokens than asked (`record`: a Calibration's, after its
    pass): said by convert, the sweep and the demo, since a fit and a refinement on a few hundred tokens
    fit those tokens rather than the model (issue 60 reports the demo on 256 sample tokens: KL 1.11 against 0.24)."""
    used, asked = record.get("tokens_used"), record.get("tokens_requested")
    if used is None or asked is None or used >= asked:
        return None
    return (f"warning: calibrated on {used:,} tokens, not the {asked:,} asked: the calibration text holds no more; "
            f"a start fitted and refined on so few tokens fits them rather than the model: give more text")


def near_chance_warning(loss: float, vocab: int, text_unit: str) -> str | None:
    """The warning where the source's loss on the calibration text is near chance (>= NEAR_CHANCE x
    ln vocab, the eval's rule for scoring text): the fit and refinement then imitate the source where
    it barely models its input. None otherwise."""
    chance = math.log(vocab)
    if loss < NEAR_CHANCE * chance:
        return None
    return (f"the source's loss on the calibration text is {loss:.3f} nats/token, {loss / chance:.0%} of chance "
            f"(ln {vocab} = {chance:.3f}; warned from {NEAR_CHANCE:.0%}): it barely models this text, so a start "
            f"fitted on it imitates the source where the source is least itself; calibrate on text like the "
            f"source's own (and check --calib-text-unit, now {text_unit!r}: a file read in the wrong units "
            f"joins or splits documents)")


def calibration_sequences(texts: list[str], tokenizer: Any, tokens: int, window: int, layout: str = "repeats"
                          ) -> tuple[list[list[int]], list[int], int, int]:
    """The forward passes of a calibration: (token-id sequences, the document each came from
    (an index into `texts`; for `repeats`, the document it starts in), tokens used, documents used:
    always `texts[:documents used]`, in order).

    layout `documents`: each document is tokenized alone and cut to the tokens still wanted, then
    into windows of at most `window` tokens; documents are taken in order until `tokens` are used.
    layout `repeats` (the default): `repeat_windows`.
    """
    if layout == "repeats":
        return repeat_windows(texts, tokenizer, tokens, window)
    if layout != "documents":
        raise ValueError(f"layout must be one of {CALIB_WINDOWS}, not {layout!r}")
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


def repeat_windows(texts: list[str], tokenizer: Any, tokens: int, window: int, seed: int = 0
                   ) -> tuple[list[list[int]], list[int], int, int]:
    """Windows that read a passage again (`calibration_sequences`' answer), so the fit and the
    refinement see the heads that copy at work at every distance up to the window
    (results/copy-conversions.md: one story per window never shows a key further back than the
    story; on examples/copy-mha8 at 2 K/V heads the copy gain kept rose from 85% to 91% and the KL on
    plain held-out text fell).

    The documents are joined into one stream as the trainer packs them (each tokenized alone with
    its special tokens, EOS after it). Each window is P = window // 8 tokens of the stream, the next
    `gap` tokens (uniform in 0..window - 2P, seeded), then the same P tokens again; the next window
    starts after the gap. Every token of the stream is read once, plus the repeats; windows are
    taken until `tokens` are used (the last one cut to fit) or the stream ends. A document can run
    across two windows, as it runs across the trainer's blocks. A small budget takes shorter windows
    (at most tokens / MIN_WINDOWS), so that the refinement still has sequences to hold out.
    """
    window = max(2, min(window, tokens // MIN_WINDOWS))
    eos, rng, passage = tokenizer.eos_token_id, random.Random(seed), max(1, window // 8)
    stream: list[int] = []
    starts: list[int] = []  # the stream position where each document begins
    for text in texts:
        if len(stream) >= tokens:  # never more stream than tokens: each window reads at least as much of it
            break
        starts.append(len(stream))
        stream += tokenizer(text)["input_ids"] + ([eos] if eos is not None else [])
    sequences: list[list[int]] = []
    document_of: list[int] = []
    at = used = 0
    while at < len(stream) and used < tokens:
        gap = rng.randint(0, max(0, window - 2 * passage))
        left = tokens - used
        if left <= 2 * passage or at + passage >= len(stream):  # no room to read it again: the rest, plain
            piece = stream[at:at + min(left, window)]
            sequences.append(piece)
            read = len(piece)
        else:
            gap = min(gap, left - 2 * passage, len(stream) - at - passage)
            piece = stream[at:at + passage + gap]
            sequences.append(piece + piece[:passage])
            read = len(piece)
        document_of.append(_document_at(starts, at))
        used += len(sequences[-1])
        at += read
    docs = _document_at(starts, at - 1) + 1 if sequences else 0
    return sequences, document_of, used, docs


def _document_at(starts: list[int], position: int) -> int:
    """The index of the document holding stream `position` (`starts`: each document's first position)."""
    return bisect.bisect_right(starts, position) - 1


def check_device(device: str) -> None:
    """UsageError (one line) where torch cannot place a tensor on `device` ('cuda' on a CPU-only torch, 'cdua')."""
    import torch

    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise UsageError(f"--device {device!r} is not usable here: {first}; pass --device cpu or a device "
                         f"this torch has") from None


@dataclass
class Calibration:
    """Attention-input moments (and, for refinement, recordings) of a model, run layer by layer as asked.

    activation_limit: bytes the float32 activations (tokens x hidden x 4) may take before they are
    kept in bfloat16; None: half the memory available when the calibration starts.
    keep: what each layer keeps after its run (`layer.KEEP`): 'moments' for the fit, 'attention'
    for refinement on the original inputs, 'layer' for refinement on the converted ones; the
    default of the users' handles, which may each set their own (`schedule.StreamUser`).
    users: how many conversions read this one stream at once (a sweep's K/V counts, each in its own
    thread, user 0..users-1; `share`): `schedule.py` is the contract (who reads which layer when,
    when a layer is freed, the one-user restart rule).
    """

    path: Path
    tokens: int
    device: str = "cpu"
    text_unit: str = DataSource.text_unit  # what one document of a .txt file is (as the trainer's data.*.text_unit)
    layout: str = CALIB_WINDOWS[0]  # how the text is cut into forward passes (`calibration_sequences`)
    record: dict[str, Any] = field(default_factory=dict)  # what the conversion record says about it
    activation_limit: int | None = None
    keep: str = "moments"
    users: int = 1
    _stream: LayerStream | None = field(default=None, repr=False)
    _started: bool = field(default=False, repr=False)
    _threads: int = field(default=0, repr=False)  # torch's threads when the pass started: the runs' default
    _model_dir: Path | None = field(default=None, repr=False)
    _windows: tuple | None = field(default=None, repr=False)  # calibration_sequences' answer, once
    _turn: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _handles: dict[int, StreamUser] = field(default_factory=dict, repr=False)
    _schedule: StreamSchedule | None = field(default=None, repr=False)
    # (what, sequences) -> a tick per sequence of a pass (`progress.sequence_progress`: `calibrate layer 3:
    # sequence 40/128, ...` every ~10 s, a 7B layer's pass takes minutes), set by `pipeline.prepare`; None: silent
    progress: Callable[[str, int], Callable[[int], None]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.tokens <= 0:
            raise UsageError(f"--calib-tokens must be positive, got {self.tokens}")
        if self.keep not in KEEP:
            raise ValueError(f"keep must be one of {KEEP}, not {self.keep!r}")
        if self.layout not in CALIB_WINDOWS:
            raise UsageError(f"--calib-windows must be one of {', '.join(CALIB_WINDOWS)}, got {self.layout!r}")
        self.path = Path(self.path)
        texts = read_calibration_texts(self.path, self.text_unit)  # fail now, before any work
        check_device(self.device)
        self.record.update(file=str(self.path), text_unit=self.text_unit, windows=self.layout,
                           tokens_requested=self.tokens, device=self.device, passes=0)
        warning = one_document_warning(self.path, self.text_unit, texts)
        if warning:
            self.record["warning"] = warning

    # ------------------------------------------------------------------ its users

    @property
    def schedule(self) -> StreamSchedule:
        """The stream's schedule (`schedule.StreamSchedule`) for `users` users, fixed once one asked or left."""
        with self._turn:
            if self._schedule is None or (self._schedule.users != self.users and not self._schedule.touched):
                self._schedule = StreamSchedule(self.users, self._turn)
            elif self._schedule.users != self.users:
                raise ValueError(f"the calibration stream has {self._schedule.users} users already; "
                                 f"set its users (share) before any of them reads it")
            return self._schedule

    def share(self, users: int) -> list[StreamUser]:
        """The handles of `users` conversions reading this one stream (before it starts; ValueError after)."""
        with self._turn:
            if self._started or self.record.get("passes") or (self._schedule is not None and self._schedule.touched):
                raise ValueError("a calibration stream is shared before it starts")
            self.users = users
            return [self.user(u) for u in range(users)]

    def user(self, user: int) -> StreamUser:
        """User `user`'s handle (`schedule.StreamUser`: its own keep and threads), the same one each time."""
        if not 0 <= user < self.users:
            raise ValueError(f"user {user} is not one of the stream's {self.users} users")
        with self._turn:
            return self._handles.setdefault(user, StreamUser(self, user))

    def sigma(self, layer: str, user: int = 0) -> torch.Tensor:
        """E[x̃ x̃ᵀ] of the attention input of `layer` (a tensor-name prefix like 'model.layers.0.self_attn.'),
        taken by `user` once (at width 8192 it is 512 MiB; `user(user).sigma`, rules in `schedule.py`)."""
        return self.user(user).sigma(layer)

    def layer(self, layer: str, user: int = 0) -> Layer:
        """The `Layer` of attention prefix `layer` (either prefix, see `_index`), run by the stream up to
        it; `user` is then done with every layer before it (`user(user).layer`, rules in `schedule.py`)."""
        return self.user(user).layer(layer)

    def leave(self, user: int, failed: str = "") -> None:
        """`user` is done with every layer (its conversion ended); `failed`: it ended with this error,
        and the users still waiting for the stream stop with it."""
        self.schedule.depart(user, failed)

    def request(self, user: int, layer: str, moments: bool) -> Any:
        """What a `StreamUser` asks: the `Layer` of `layer`, or (`moments`) its moments taken by `user`."""
        return self.schedule.request(user, layer, self, Layer.moments if moments else None)

    # ------------------------------------------------------------------ the runner the schedule drives

    def locate(self, layer: str) -> int:
        if not self._started:
            self._start()
        return self._index(layer)

    def run_next(self, user: int, index: int) -> Layer:
        """Run the next layer for a request of `user`, with that user's torch threads (restored after)."""
        start = time.perf_counter()
        with torch_threads(self.user(user).threads or self._threads):
            layer = self._stream.advance()
        if layer.index != index:
            raise RuntimeError(f"the stream ran layer {layer.index}, not the next, {index}")
        self.record["seconds"] = round(self.record["seconds"] + time.perf_counter() - start, 2)
        self.record["layers_run"] = self._stream.position
        if self._stream.position == len(self._stream.layers):
            self._score_source(self.user(user).threads or self._threads)
        return layer

    def _score_source(self, threads: int | None) -> None:
        """Once the last layer ran: the source's loss on the calibration text (`LayerStream.source_loss`)
        in the record, and `near_chance_warning` where the source barely models the text."""
        start = time.perf_counter()
        try:
            with torch_threads(threads):
                loss, tokens = self._stream.source_loss(self.windows()[0])
        except (RuntimeError, ValueError, TypeError, AttributeError, KeyError, StreamUnsupported) as err:
            self.record["source_loss_not_measured"] = " ".join(str(err).split())[:200] or type(err).__name__
            return
        vocab = int(self._stream.model.get_output_embeddings().weight.shape[0])
        self.record.update(source_loss=round(loss, 4), source_loss_tokens=tokens, vocab_size=vocab)
        warning = near_chance_warning(loss, vocab, self.text_unit)
        if warning:
            self.record["near_chance"] = warning
        self.record["seconds"] = round(self.record["seconds"] + time.perf_counter() - start, 2)

    def restart(self) -> None:
        """Forget the run so far: the next request opens the stream again from the first layer."""
        if self._stream is not None:
            self._stream.release()
        self._stream, self._started = None, False

    # ------------------------------------------------------------------ what every user shares

    def bind(self, model_dir: Path) -> "Calibration":
        model_dir = Path(model_dir)
        if self._model_dir is not None and self._model_dir != model_dir:
            raise ValueError("a Calibration belongs to one model")
        self._model_dir = model_dir
        return self

    def _limit(self) -> int:
        with self._turn:  # the users of a sweep describe it at once: measured once
            if self.activation_limit is None:
                self.activation_limit = available_memory() // 2
            return self.activation_limit

    def describe(self, source_params: int, attention_kept: bool = False) -> tuple[str, int]:
        """The plan's note on this calibration and the bytes it holds at most (estimated from config.json);
        attention_kept: the layer being made keeps its attention's inputs and outputs (float32) to measure
        starts on (`--grouping similar`'s candidates)."""
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
        kept = 2 * self.tokens * hidden * 4 if attention_kept else 0
        if kept:
            note += (f" + the attention's inputs and outputs of the layer being made ({kept / mib:.1f} MiB), to "
                     f"measure its candidate head groupings")
        return note, layer_bytes + act_bytes + layers * sigma_bytes + kept

    def _index(self, layer: str) -> int:
        """The decoder-layer index of an attention prefix: a loaded-module prefix of the stream
        ('model.layers.3.self_attn.') or a checkpoint prefix that names it differently (EXAONE's
        'transformer.h.3.attn.attention.'): both carry the layer's number."""
        if self._stream is not None and layer in self._stream.prefixes:
            return self._stream.prefixes.index(layer)
        return layer_index(layer)

    def first_inputs(self, count: int | None = None) -> list[torch.Tensor]:
        """A copy of layer 0's inputs (the first `count` sequences, None: all), where a conversion
        refining on its own inputs, or checking its whole model, starts them."""
        with self._turn:
            if not self._started:
                self._start()
            return self._streaming().first_inputs(count)

    def kl_to_source(self, tracks: dict[str, list[torch.Tensor]], user: int = 0) -> tuple[dict[str, float], int]:
        """Once the stream ran every layer: each converted model's KL to the source on the first
        calibration sequences (`LayerStream.kl_to_source`), with `user`'s torch threads."""
        with torch_threads(self.user(user).threads or self._threads):
            return self._streaming().kl_to_source(tracks)

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
            texts = read_calibration_texts(self.path, self.text_unit)
            self._windows = calibration_sequences(texts, tokenizer, self.tokens, window, self.layout)
            # which documents it read (the first ones, in order), by content: eval and the trainer warn when
            # held-out text was among them
            self.record["document_sha256"] = digests(texts[:self._windows[3]])
        return self._windows

    @property
    def documents(self) -> list[int]:
        """The document of each calibration sequence (in the stream's order)."""
        return self.windows()[1]

    @torch.no_grad()
    def _start(self) -> None:
        """Tokenize, then open the layer stream (or, where it cannot stream, run the whole model),
        keeping of each layer what the users need between them (`schedule.stream_keep`)."""
        from transformers import AutoConfig

        at_once.pause("calibrate")
        start = time.perf_counter()
        schedule = self.schedule
        keep = stream_keep([self.user(u).keep for u in range(self.users)])
        self._started, self._threads = True, torch.get_num_threads()
        self.record["passes"] += 1
        sequences, _, used, docs = self.windows()
        config = AutoConfig.from_pretrained(self._model_dir)
        self.record.update(tokens_used=used, documents=docs)
        try:
            self._stream = LayerStream(open_checkpoint(self._model_dir), config, sequences, self.device,
                                       activation_limit=self._limit(), keep=keep, users=self.users,
                                       progress=self.progress)
            schedule.opened(len(self._stream.layers))
            self.record.update(mode="layer by layer",
                               activations=str(self._stream.activation_dtype).removeprefix("torch."))
        except StreamUnsupported as why:
            from transformers import AutoModelForCausalLM

            self.record.update(mode="whole model", why_not_streamed=str(why))
            model = AutoModelForCausalLM.from_pretrained(self._model_dir, dtype=torch.float32).to(self.device).eval()
            moments = whole_model_moments(model, sequences, self.device)
            del model
            reason = f"the model was run whole: {why}"
            schedule.hand_out({layer_index(k): Layer.moments_only(layer_index(k), k, v, self.users, reason)
                               for k, v in moments.items()})
        self.record["seconds"] = round(self.record.get("seconds", 0) + time.perf_counter() - start, 2)
