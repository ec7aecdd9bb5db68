"""`--refine`'s held-out split (by document), its use in `refine_attention`, the device check and the
plan's held-out and time lines."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from conftest import EXAMPLE_MHA8, TRAIN_TXT, real_config
from families import GQA_TYPES, tiny_config
from tiny import random_model, scaled_config
from uptrain.convert.__main__ import main
from uptrain.convert.layers.calibrate import calibration_sequences, read_calibration_texts
from uptrain.convert.math.refine import (MIN_HOLDOUT_TOKENS, STEPS, attention_modules, call_with, capture,
                                    refine_attention, relative_error, split_held_out)
from uptrain.convert.layers.refine_layer import probe_seconds_per_step


def _reachable(sizes: list[int], cap: int) -> int:
    """Bitset of the sums (<= cap) some subset of `sizes` makes."""
    reach, mask = 1, (1 << (cap + 1)) - 1
    for s in sizes:
        reach = (reach | reach << s) & mask
    return reach


def _check_split(lengths: list[int], documents: list[int], fraction: float, min_tokens: int, seed: int) -> None:
    held, train = split_held_out(lengths, documents, fraction, min_tokens, seed)
    case = (lengths, documents, fraction, min_tokens, seed)
    assert split_held_out(lengths, documents, fraction, min_tokens, seed) == (held, train), case  # deterministic
    assert held and train and sorted(held + train) == list(range(len(lengths))), case
    total, got = sum(lengths), sum(lengths[i] for i in held)
    target, cap = max(-(-fraction * total // 1), min_tokens), total // 2
    if len(set(documents)) == 1:  # a contiguous tail of the only document
        assert held == list(range(train[-1] + 1, len(lengths))), case
        assert got >= target or len(train) == 1 or got + lengths[train[-1]] > cap, case
        return
    assert not {documents[i] for i in held} & {documents[i] for i in train}, case  # no document on both sides
    assert got <= cap, case
    sizes = [sum(n for n, d in zip(lengths, documents) if d == doc) for doc in sorted(set(documents))]
    achievable = target <= cap and _reachable(sizes, cap) >> int(target) != 0
    assert got >= target or not achievable, case


def _random_case(rng: random.Random) -> tuple[list[int], list[int]]:
    lengths, documents = [], []
    for doc in range(rng.randint(1, 50)):
        windows = rng.randint(1, 20)
        cut = rng.choice([2048, 512, rng.randint(1, 2048)])  # full windows, then the document's remainder
        lengths += [cut] * (windows - 1) + [rng.randint(1, cut)]
        documents += [doc] * windows
    if len(lengths) < 2:
        lengths, documents = lengths * 2, documents * 2
    return lengths, documents


def test_split_holds_out_whole_documents_over_random_and_structured_inputs():
    """Property: no document on both sides, both sides non-empty, the held-out tokens reach
    max(fraction x total, min_tokens) whenever some set of documents does under the half cap,
    deterministic for a seed; a single document gives a contiguous tail."""
    rng = random.Random(0)
    for _ in range(400):
        lengths, documents = _random_case(rng)
        _check_split(lengths, documents, rng.choice([0.01, 0.125, 0.3, 0.5, 0.9]),
                     rng.choice([0, 1, 4096, 50_000]), rng.randint(0, 10**6))
    structured = [
        ([2048] * 19, [0] * 5 + [1] * 5 + [2] * 5 + [3] * 4),  # the 32,768 tokens: ~5k-token documents
        ([2048, 2048, 900] * 4, [d for d in range(4) for _ in range(3)]),
        ([5, 5], [0, 1]), ([1, 1], [0, 0]), ([2048, 1], [0, 0]), ([1, 2048], [0, 0]),
        ([10_000, 1, 1, 1], [0, 1, 2, 3]),  # one document over the cap: the small ones are held
        ([3000, 3000, 2000], [0, 1, 2]),  # the seeded order may start with a 3000 that overshoots nothing
        ([2047, 2049, 2048, 2048], [0, 1, 2, 3]),
        ([1] * 50, list(range(50))), ([2048] * 20, [0] * 20), ([7] * 30, [i // 3 for i in range(30)]),
    ]
    for lengths, documents in structured:
        for seed in range(20):
            for fraction, minimum in [(0.125, 4096), (0.125, 0), (0.49, 1), (0.9, 0)]:
                _check_split(lengths, documents, fraction, minimum, seed)


def test_split_reaches_the_target_where_the_seeded_order_overshoots():
    """Sizes 6, 5, 5 (cap 8): a greedy pass taking 5 first cannot add 5 or 6; the 6 alone reaches 6."""
    for seed in range(30):
        held, _ = split_held_out([6, 5, 5], [0, 1, 2], 0.1, 6, seed)
        assert held == [0]


def test_split_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="split_held_out needs"):
        split_held_out([5], [0], 0.1, 0, 0)
    with pytest.raises(ValueError, match="split_held_out needs"):
        split_held_out([5, 0], [0, 1], 0.1, 0, 0)


def test_calibration_sequences_name_each_window_s_document():
    """The windows of document d, in order, are its tokens (the last document cut to the tokens wanted)."""
    texts = read_calibration_texts(TRAIN_TXT)
    tokenizer = AutoTokenizer.from_pretrained(EXAMPLE_MHA8)
    sequences, documents, used, docs = calibration_sequences(texts, tokenizer, 5000, 128, "documents")
    assert len(documents) == len(sequences) and documents == sorted(documents) and len(set(documents)) == docs
    assert sum(map(len, sequences)) == used == 5000
    for d in set(documents):
        ids = [t for s, doc in zip(sequences, documents) if doc == d for t in s]
        whole = tokenizer(texts[d])["input_ids"]
        assert ids == whole[: len(ids)] and (len(ids) == len(whole) or d == documents[-1])


def _layer_problem(n: int = 12, length: int = 40, seed: int = 0):
    """A 4-K/V-head attention's inputs and outputs (the teacher) and a 2-K/V-head student."""
    kw = dict(hidden_size=32, head_dim=8, num_attention_heads=4, num_hidden_layers=1, intermediate_size=16,
              vocab_size=64)
    teacher = random_model(AutoConfig.for_model("llama", num_key_value_heads=4, **kw), seed=seed)
    student = attention_modules(random_model(AutoConfig.for_model("llama", num_key_value_heads=2, **kw), seed=1))[0]
    gen = torch.Generator().manual_seed(seed)
    rec = capture(teacher, [torch.randint(3, 64, (length + i,), generator=gen) for i in range(n)])[0]
    return student, call_with(rec.kwargs), rec.inputs, rec.outputs


@pytest.mark.parametrize("documents", [None, [i // 3 for i in range(12)]])
def test_held_out_sequences_are_never_trained_on(documents, one_torch_thread):
    """Every call made while autograd records (a training step) is on a sequence outside the
    held-out documents; the held-out ones are only measured."""
    student, call, xs, ys = _layer_problem()
    trained, measured = set(), set()

    def spy(module, x, i):
        (trained if torch.is_grad_enabled() else measured).add(i)
        return call(module, x, i)
    result = refine_attention(student, spy, xs, ys, steps=20, eval_every=5, patience=100, batch=3, lr=1e-2,
                              documents=documents, min_holdout_tokens=100)
    docs = documents or list(range(12))
    assert result.held_out and trained, result
    assert not trained & set(result.held_out), (sorted(trained), result.held_out)
    assert not {docs[i] for i in trained} & {docs[i] for i in result.held_out}
    assert set(result.held_out) <= measured
    assert result.held_out_tokens == sum(len(xs[i]) for i in result.held_out) >= 100
    assert result.held_out_documents == len({docs[i] for i in result.held_out})


def test_the_best_held_out_state_is_the_one_returned(one_torch_thread):
    """A learning rate far too high makes the held-out error rise after its best point, and the run
    stops there (patience): the module is put back to the best measured state (then its output
    projection solved, kept only where that measures better), so its held-out error recomputed now
    is the reported error_after, the least of all measured."""
    student, call, xs, ys = _layer_problem()
    result = refine_attention(student, call, xs, ys, steps=60, eval_every=1, patience=3, batch=2, lr=0.3,
                              min_holdout_tokens=100)
    errors = [e for _, e in result.history]
    assert 0 < result.best_step < result.steps_run and result.stopped_early, result  # the test's precondition
    assert errors[-1] > result.error_after * 1.01, errors  # the last state measured is worse than the best
    solved = [result.solved_error] if result.output_solved else []
    assert result.error_after == min([result.error_before, *errors, *solved])
    now = relative_error(student, call, xs, ys, result.held_out)
    assert now == pytest.approx(result.error_after, rel=1e-6, abs=1e-12), (now, result.error_after)


def test_a_device_torch_cannot_use_is_refused_before_any_output(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this torch can use cuda; the refusal needs a device it cannot use")
    assert main([str(EXAMPLE_MHA8), "--kv-heads", "2", "--method", "fit", "--calib", str(TRAIN_TXT), "--refine",
                 "--device", "cuda", "--out", str(tmp_path / "out")]) == 2
    out = capsys.readouterr()
    assert out.out == "", out.out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device 'cuda' is not usable here"), out.err
    assert not (tmp_path / "out").exists()


def _plan(capsys, *argv: str) -> str:
    assert main([str(EXAMPLE_MHA8), "--kv-heads", "2", "--method", "fit", "--calib", str(TRAIN_TXT), "--refine",
                 "--dry-run", *argv]) == 0
    return capsys.readouterr().out


def test_the_plan_measures_the_refinement_time_and_says_what_is_held_out(capsys, one_torch_thread):
    import re

    text = _plan(capsys)
    line = next(x for x in text.splitlines() if x.startswith("refine time"))
    m = re.search(rf"at most {STEPS} steps x 5 layers at ([0-9.e+-]+) s/step measured on cpu = up to ([0-9.,]+) "
                  r"(s|min|h) \(early stopping usually ends sooner\); on a GPU: --device cuda", line)
    assert m and float(m[1]) > 0, line
    held = next(x for x in text.splitlines() if x.startswith("held out"))
    assert "of 32,768 calibration tokens" in held and "split by document" in held, held
    assert "too small" not in text
    small = _plan(capsys, "--calib-tokens", "1200")
    note = next(x for x in small.splitlines() if "too small" in x)
    assert f"under the {MIN_HOLDOUT_TOKENS:,}" in note and "--calib-tokens" in note and "more documents" in note


def test_the_probe_measures_a_7b_shaped_attention(one_torch_thread):
    """Llama-7B widths (4096 hidden, 32 heads, K/V heads 32 -> 8), a short sequence to keep it cheap."""
    cfg = scaled_config(json.loads(real_config("open_llama_7b").read_text()), layers=2, head_dim=128,
                        num_key_value_heads=8)
    assert cfg.hidden_size == 4096
    seconds = probe_seconds_per_step(cfg, 32, 4, "cpu", steps=1)
    assert 0 < seconds < 600


@pytest.mark.parametrize("model_type", sorted(t for t in GQA_TYPES if t != "falcon"))  # falcon: refused
def test_the_probe_builds_every_refinable_family(model_type, one_torch_thread):
    """Each registry family's attention (rotary per layer type, partial rotary, key norms, fused qkv)
    runs the probe's steps: a positive time, no 'not measured' in the plan for them."""
    assert probe_seconds_per_step(tiny_config(model_type, GQA_TYPES[model_type]), 16, 4, "cpu", steps=1) > 0
