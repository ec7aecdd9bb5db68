"""`--calib-windows`: the forward passes calibration cuts from its text (`calibrate.calibration_sequences`).

The default, `repeats`, reads the documents as the trainer packs them and reads a passage again at a
seeded distance in each window, so that the fit and the refinement see the heads that copy at work.
Its property test checks, over many random and real texts and windows, what the docstring promises:
every token of the stream is read once and in order, each window ends with its own first P tokens,
the distances cover the window, the documents are named, the budget is kept."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from conftest import EXAMPLE_MHA8, TRAIN_TXT
from uptrain.convert.__main__ import main
from uptrain.convert.layers.calibrate import MIN_WINDOWS, calibration_sequences, read_calibration_texts, repeat_windows


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EXAMPLE_MHA8)


def _stream(texts: list[str], tokenizer) -> tuple[list[int], list[int]]:
    """The documents as the trainer packs them (each with its special tokens, EOS after it), computed
    here on its own; and the document of each position."""
    stream, owner = [], []
    for d, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        stream += ids
        owner += [d] * len(ids)
    return stream, owner


def _check(texts: list[str], tokenizer, tokens: int, window: int) -> list[int]:
    """The promises of `repeat_windows` for one case; returns the distances it read passages again at."""
    sequences, documents, used, docs = calibration_sequences(texts, tokenizer, tokens, window)
    assert (sequences, documents, used, docs) == repeat_windows(texts, tokenizer, tokens, window)  # the default
    stream, owner = _stream(texts, tokenizer)
    window = max(2, min(window, tokens // MIN_WINDOWS))  # a small budget: shorter windows, enough of them
    passage, case = max(1, window // 8), (len(texts), tokens, window)
    assert used == sum(map(len, sequences)) == min(tokens, used) and all(0 < len(s) <= window for s in sequences)
    assert used == tokens or used >= len(stream), case  # the budget, unless the text ran out first
    assert used < tokens or len(sequences) >= min(MIN_WINDOWS, tokens // 2), case  # enough for the refinement's split
    read, distances = [], []
    for s in sequences:
        if len(s) >= 2 * passage and s[-passage:] == s[:passage]:  # a passage read again after len - 2P tokens
            distances.append(len(s) - 2 * passage)
            read += s[:-passage]
        else:  # the plain tail (no room for a repeat)
            assert s is sequences[-1] or len(stream) - len(read) - len(s) < passage + 1, case
            read += s
    assert read == stream[:len(read)], case  # every token of the stream once, in order
    at = 0
    for s, d in zip(sequences, documents):
        assert d == owner[at], case  # the document the window starts in
        at += len(s) - (passage if len(s) >= 2 * passage and s[-passage:] == s[:passage] else 0)
    assert docs == owner[len(read) - 1] + 1, case  # texts[:docs] are the documents read
    assert max(distances, default=0) <= window - 2 * passage, case
    return distances


def test_repeat_windows_keep_their_promises_over_many_texts_and_windows(tokenizer):
    """Real stories and random character soup, windows of 9 to 2,048 tokens, budgets of 1 to 20,000 tokens
    (below and above the text): 200 cases, and the distances of long runs spread over the whole window."""
    stories = read_calibration_texts(TRAIN_TXT)
    rng = random.Random(0)
    alphabet = "abcdefghij klmnop.,!?\n"
    for case in range(200):
        if case % 2:
            texts = stories[rng.randrange(len(stories) - 40):][:rng.randint(1, 40)]
        else:
            texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 900))) for _ in range(rng.randint(1, 12))]
        window = rng.choice([16, 64, 128, 256, 512, 2048, rng.randint(9, 700)])
        _check(texts, tokenizer, rng.choice([rng.randint(1, 40), rng.randint(1, 20_000)]), window)
    distances = _check(stories, tokenizer, 200_000, 512)
    assert len(distances) > 300 and min(distances) < 20 and max(distances) > 364  # 0..384 covered
    low = sum(d < 192 for d in distances) / len(distances)
    assert 0.4 < low < 0.6  # uniform: about half below the middle


def test_repeat_windows_are_seeded(tokenizer):
    texts = read_calibration_texts(TRAIN_TXT)[:60]
    assert repeat_windows(texts, tokenizer, 9000, 512) == repeat_windows(texts, tokenizer, 9000, 512)
    assert repeat_windows(texts, tokenizer, 9000, 512) != repeat_windows(texts, tokenizer, 9000, 512, seed=1)


def test_the_conversion_records_its_windows_and_each_layout_makes_its_own(tmp_path, one_torch_thread):
    """`uptrain.convert --calib-windows`: the record names the layout, the default is `repeats`, and the two
    layouts make different conversions (kept layers are keyed by every field of the calibration)."""
    outs = {}
    for layout in ("repeats", "documents"):
        out = tmp_path / layout
        extra = [] if layout == "repeats" else ["--calib-windows", "documents"]
        assert main([str(EXAMPLE_MHA8), "--kv-heads", "2", "--method", "fit", "--calib", str(TRAIN_TXT),
                     "--calib-tokens", "2048", "--out", str(out), *extra]) == 0
        record = json.loads((out / "uptrain_conversion.json").read_text())
        assert record["calibration"]["windows"] == layout
        outs[layout] = [f.read_bytes() for f in sorted(out.glob("*.safetensors"))]
    assert outs["repeats"] != outs["documents"]
