"""The K/V cache formats (uptrain.measure.kv_cache) against their definitions, written here again.

- bytes per token against each format's definition (ggml: q8_0 34 bytes per 32 values, q4_0 18;
  vLLM fp8: one byte; 16-bit: two), over real head counts;
- each round trip against an independent implementation of the format's rule (ggml's reference C
  loops for q8_0 / q4_0, a table of every float8 value for fp8), over random and structured inputs;
- `uptrain.eval --kv-cache q8_0 --json` against a scoring written here: the model run with a cache
  whose update rounds the keys after RoPE with this file's q8_0, the loss summed here;
- the refusal of a block format whose block does not divide head_dim, as llama.cpp refuses it.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from uptrain.measure import kv_cache
from uptrain.measure.eval import main as eval_main
from uptrain.measure.kv_cache import FORMATS, bytes_per_token, kv_format

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "results" / "paper" / "reference-mha8"  # Llama, 4 layers, 8 heads of 32: head_dim fits a block
STORIES = REPO / "examples" / "stories260K-mha8"  # head_dim 8


# ---------------------------------------------------------------- the formats' definitions, independently


def ggml_q8_0(row: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_0_ref then dequantize_row_q8_0, loop for loop, on a float32 row (len % 32 == 0)."""
    out = np.empty_like(row)
    for i in range(0, row.size, 32):
        x = row[i:i + 32]
        amax = np.float32(np.max(np.abs(x)))
        d = np.float32(amax / np.float32(127))
        inv = np.float32(1) / d if d else np.float32(0)
        dh = np.float32(np.float16(d))
        for j in range(32):
            v = np.float32(x[j] * inv)
            q = math.copysign(math.floor(abs(float(v)) + 0.5), float(v))  # C roundf
            out[i + j] = np.float32(q) * dh
    return out


def ggml_q4_0(row: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q4_0_ref then dequantize_row_q4_0, loop for loop."""
    out = np.empty_like(row)
    for i in range(0, row.size, 32):
        x = row[i:i + 32]
        amax, mx = np.float32(0), np.float32(0)
        for v in x:
            if amax < abs(v):
                amax, mx = np.float32(abs(v)), v
        d = np.float32(mx / np.float32(-8))
        inv = np.float32(1) / d if d else np.float32(0)
        dh = np.float32(np.float16(d))
        for j in range(32):
            q = min(15, int(np.float32(np.float32(x[j] * inv) + np.float32(8.5))))  # (int8_t) truncates
            out[i + j] = np.float32(q - 8) * dh
    return out


def float8_values(exp_bits: int, man_bits: int, bias: int, fn: bool) -> np.ndarray:
    """Every finite non-negative value of a float8 format, ascending (fn: no infinities, only the all-ones
    code is NaN, as e4m3fn; else the top exponent is inf/NaN, as e5m2)."""
    values = []
    for e in range(2 ** exp_bits):
        for m in range(2 ** man_bits):
            if (fn and e == 2 ** exp_bits - 1 and m == 2 ** man_bits - 1) or (not fn and e == 2 ** exp_bits - 1):
                continue
            values.append(m / 2 ** man_bits * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2 ** man_bits) * 2.0 ** (e - bias))
    return np.array(values)


def float8_round(x: np.ndarray, values: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """vLLM's write and read: x / scale saturated to the largest value, rounded to the nearest value
    (ties to the even code: the even index in `values`), times scale."""
    y = np.clip(x.astype(np.float32) / np.float32(scale), -values[-1], values[-1])  # float32, as the runtime
    a = np.abs(y).astype(np.float64)
    hi = np.clip(np.searchsorted(values, a), 1, len(values) - 1)
    lo = hi - 1
    dlo, dhi = a - values[lo], values[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (np.sign(y) * values[pick]).astype(np.float32) * np.float32(scale)


E4M3 = float8_values(4, 3, 7, fn=True)
E5M2 = float8_values(5, 2, 15, fn=False)


def structured_rows(head_dim: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Rows that probe the rules' edges: zeros, one spike, the largest magnitude twice with both signs
    (q4_0 keeps the first), a negative maximum, values on rounding ties, huge and tiny scales."""
    base = rng.standard_normal(head_dim).astype(np.float32)
    tie = np.zeros(head_dim, np.float32)
    tie[3], tie[7] = -2.0, 2.0
    halves = (np.arange(head_dim, dtype=np.float32) % 7 - 3) * np.float32(127 / 254)  # on q8_0's .5 ties
    halves[0] = 127 / 254 * 3 * 2  # amax so that d = 3/127... ties at x / d = k + .5
    spike = np.zeros(head_dim, np.float32)
    spike[-1] = 5.0
    return [np.zeros(head_dim, np.float32), spike, tie, -np.abs(base), base * 1e4, base * 1e-6, halves,
            np.full(head_dim, 0.3, np.float32), base]


# ---------------------------------------------------------------- bytes


@pytest.mark.parametrize("heads,kv_heads,head_dim,layers", [(32, 8, 128, 32), (40, 40, 128, 40), (64, 8, 128, 80),
                                                            (32, 4, 64, 16), (8, 8, 32, 4)])
def test_bytes_per_token_follow_each_format_definition(heads, kv_heads, head_dim, layers):
    values = 2 * layers * kv_heads * head_dim  # K and V, every layer and K/V head
    assert bytes_per_token(FORMATS["q8_0"], layers, kv_heads, head_dim, torch.bfloat16) == values // 32 * 34
    assert bytes_per_token(FORMATS["q4_0"], layers, kv_heads, head_dim, torch.bfloat16) == values // 32 * 18
    assert bytes_per_token(FORMATS["fp8"], layers, kv_heads, head_dim, torch.bfloat16) == values
    assert bytes_per_token(FORMATS["fp16"], layers, kv_heads, head_dim, torch.float32) == 2 * values
    assert bytes_per_token(FORMATS["model"], layers, kv_heads, head_dim, torch.float32) == 4 * values
    assert bytes_per_token(FORMATS["model"], layers, kv_heads, head_dim, torch.bfloat16) == 2 * values


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("name,reference", [("q8_0", ggml_q8_0), ("q4_0", ggml_q4_0)])
@pytest.mark.parametrize("kv_heads,head_dim", [(32, 32), (40, 64), (64, 128), (8, 96)])
def test_block_round_trips_equal_ggml_reference_loops(name, reference, kv_heads, head_dim):
    rng = np.random.default_rng(kv_heads * 1000 + head_dim)
    fmt = kv_format(name)
    # a cache tensor [batch, kv_heads, seq, head_dim]: random rows at several scales, then the structured ones
    x = (rng.standard_normal((1, kv_heads, 3, head_dim)) * rng.choice([1e-3, 1.0, 50.0], (1, kv_heads, 3, 1)))
    x = x.astype(np.float32)
    rows = list(x.reshape(-1, head_dim)[:12]) + structured_rows(head_dim, rng)
    ours = fmt.round_trip(torch.from_numpy(x)).numpy()
    for k in range(12):  # a sample of the random rows (the C loops are slow in Python)
        assert np.array_equal(ours.reshape(-1, head_dim)[k], reference(x.reshape(-1, head_dim)[k])), (name, k)
    for row in rows[12:]:
        got = fmt.round_trip(torch.from_numpy(row)[None]).numpy()[0]
        assert np.array_equal(got, reference(row)), (name, row[:8])


def test_q4_0_keeps_the_sign_of_the_first_largest_value():
    row = np.zeros(32, np.float32)
    row[2], row[9] = 3.0, -3.0  # same magnitude: ggml's d comes from the first (+3), so +3 reads back exactly
    got = kv_format("q4_0").round_trip(torch.from_numpy(row)[None])[0]
    assert got[2].item() == 3.0 and got[9].item() == pytest.approx(-3.0 * 7 / 8)


@pytest.mark.parametrize("name,values", [("fp8", E4M3), ("fp8_e5m2", E5M2)])
def test_fp8_round_trip_equals_the_value_table(name, values):
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(4000) * s for s in (1e-4, 1e-2, 1.0, 30.0, 1e3, 1e5)]).astype(np.float32)
    x = np.concatenate([x, values.astype(np.float32), ((values[1:] + values[:-1]) / 2).astype(np.float32)])  # ties
    got = kv_format(name).round_trip(torch.from_numpy(x)).numpy()
    assert np.array_equal(got, float8_round(x, values))


def test_sixteen_bit_formats_are_the_casts():
    x = torch.randn(2, 4, 5, 32) * 100
    assert torch.equal(kv_format("fp16").round_trip(x), x.half().float())
    assert torch.equal(kv_format("bf16").round_trip(x), x.bfloat16().float())


# ---------------------------------------------------------------- the scored loss


def _documents(n: int) -> list[str]:
    with gzip.open(REPO / "examples" / "data" / "paper" / "shakespeare-complete.txt.gz", "rt") as f:
        text = f.read(200_000)
    docs = [d.strip() for d in text.split("\n\n") if 300 < len(d.strip()) < 700]
    return docs[:n]


def _independent_loss(model, tokenizer, docs: list[str], round_row) -> float:
    """Mean NLL of documents scored here in one window each, the cache rounding each key (after RoPE) and
    value row [head_dim] with `round_row` (numpy) as it is written."""
    from transformers import DynamicCache

    class RoundingCache(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            def rnd(t):  # [1, kv_heads, seq, head_dim]
                rows = t.detach().numpy().reshape(-1, t.shape[-1])
                return torch.from_numpy(np.stack([round_row(r) for r in rows]).reshape(t.shape))
            return super().update(rnd(k), rnd(v), layer_idx, *args, **kwargs)

    total, count = 0.0, 0
    for doc in docs:
        ids = torch.tensor(tokenizer(doc)["input_ids"])[None]
        assert ids.shape[1] <= 256  # one window: the model's context
        with torch.no_grad():
            logits = model(input_ids=ids, cache=RoundingCache(), use_cache=True).logits[0]
        total += torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return total / count


@pytest.mark.parametrize("name,round_row,per_32", [("q8_0", ggml_q8_0, 34), ("q4_0", ggml_q4_0, 18)])
def test_eval_kv_cache_equals_a_scoring_written_here(tmp_path, name, round_row, per_32):
    """The same numbers to the last bit: rounding the keys before RoPE instead (at k_proj) moved the q8_0
    loss by 4e-5 here (tried once on purpose), a wrong block or scale by far more."""
    from uptrain.measure.models import load_model

    docs = _documents(6)
    data = tmp_path / "held-out.txt"
    data.write_text("\n\n".join(docs) + "\n")
    out = tmp_path / "eval.json"
    assert eval_main([str(REFERENCE), "--data", str(data), "--kv-cache", name, "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    model, tokenizer = load_model(str(REFERENCE))
    expected = _independent_loss(model, tokenizer, docs, round_row)
    plain = _independent_loss(model, tokenizer, docs, lambda r: r)
    assert record["kv_cache"] == name
    assert record["kv_bytes_per_token"] == 2 * 4 * 8 * 32 * per_32 / 32  # layers 4, K/V heads 8, head_dim 32
    assert record["loss"] == pytest.approx(expected, abs=1e-9)
    assert abs(record["loss"] - plain) > 1e-5  # the cache's rounding shows in the loss at all


def test_eval_refuses_a_block_format_the_head_dim_cannot_take(tmp_path, capsys):
    data = tmp_path / "t.txt"
    data.write_text("Once upon a time there was a cat.\n")
    assert eval_main([str(STORIES), "--data", str(data), "--kv-cache", "q4_0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "head_dim 8" in err and "32-value block" in err


def test_unknown_format_is_refused_in_one_line(tmp_path, capsys):
    data = tmp_path / "t.txt"
    data.write_text("Once upon a time there was a cat.\n")
    assert eval_main([str(STORIES), "--data", str(data), "--kv-cache", "int3"]) == 2
    assert "fp8" in capsys.readouterr().err


def test_model_format_scores_bitwise_as_before(tmp_path):
    """`--kv-cache model` runs the model with no cache, as the scoring always did: the same number."""
    from uptrain.measure.eval import evaluate, tokenize_texts
    from uptrain.measure.models import load_model

    model, tokenizer = load_model(str(STORIES))
    docs = ["Once upon a time, there was a little girl named Lily. She loved to play outside."]
    plain = evaluate(model, tokenize_texts(tokenizer, docs), 512, 256)
    again = evaluate(model, tokenize_texts(tokenizer, docs), 512, 256, kv=kv_cache.active(FORMATS["model"]))
    fp16 = evaluate(model, tokenize_texts(tokenizer, docs), 512, 256, kv=FORMATS["fp16"])
    assert plain.loss == again.loss and plain.kv_bytes_per_token == 2 * 5 * 8 * 8 * 4
    assert fp16.kv_cache == "fp16" and fp16.kv_bytes_per_token == 2 * 5 * 8 * 8 * 2


def test_compare_scores_and_sizes_every_model_in_the_format(tmp_path):
    from uptrain.convert import convert
    from uptrain.measure.compare import main as compare_main

    kv2 = tmp_path / "kv2"
    convert(str(STORIES), kv2, 2, "mean")
    data = tmp_path / "t.txt"
    data.write_text("Once upon a time, there was a little girl named Lily. She loved to play outside.\n")
    out = tmp_path / "c.json"
    assert compare_main([str(STORIES), str(kv2), "--data", str(data), "--kv-cache", "fp8", "--context", "16",
                         "--new-tokens", "4", "--repeats", "1", "--json", str(out)]) == 0
    source, gqa = json.loads(out.read_text())
    # bytes per token in fp8: 2 x 5 layers x K/V heads x 8 x 1; the reduction against the source as saved (float32)
    assert (source["kv_cache"], source["kv_bytes_per_token"], source["kv_reduction"]) == ("fp8", 640, 4.0)
    assert (gqa["kv_bytes_per_token"], gqa["kv_reduction"]) == (160, 16.0)
    assert source["kl_to_source"] > 0  # the source with an fp8 cache against itself as saved


def test_the_demo_refuses_a_format_before_writing_and_scores_every_model_in_it(tmp_path, capsys):
    from uptrain.demo import main as demo_main

    out = tmp_path / "demo"
    assert demo_main(["--kv-cache", "q8_0", "--skip-uptrain", "--out", str(out)]) == 2
    assert "head_dim 8" in capsys.readouterr().err and not out.exists()
    assert demo_main(["--kv-cache", "fp8", "--skip-uptrain", "--tasks", "none", "--stories", "3", "--method", "mean",
                      "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "fp8 cache" in line]
    assert len(rows) == 2 and all("640 B" in r or "160 B" in r for r in rows)


@pytest.mark.parametrize("scale", [1.0, 0.05, 3.7])
def test_fp8_with_a_checkpoint_scale_divides_saturates_rounds_and_multiplies(scale):
    """vLLM's rule with a k_scale / v_scale (BaseKVCacheMethod; the cache write x / scale, saturated; the
    read times scale): the same value table, at any scale (the `fp8` format itself uses vLLM's default 1.0)."""
    from uptrain.measure.kv_cache import fp8_round_trip

    rng = np.random.default_rng(int(scale * 100))
    x = (rng.standard_normal(20000) * rng.choice([1e-3, 1.0, 100.0, 1e4], 20000)).astype(np.float32)
    got = fp8_round_trip(torch.from_numpy(x), torch.float8_e4m3fn, scale).numpy()
    assert np.array_equal(got, float8_round(x, E4M3, scale))


def test_compare_and_sweep_refuse_before_any_work(tmp_path, capsys):
    from uptrain.measure.compare import main as compare_main
    from uptrain.sweep.run import main as sweep_main

    data = tmp_path / "t.txt"
    data.write_text("Once upon a time there was a cat.\n")
    assert compare_main([str(STORIES), str(STORIES), "--data", str(data), "--kv-cache", "q8_0"]) == 2
    assert "head_dim 8" in capsys.readouterr().err
    out = tmp_path / "sweep"
    assert sweep_main([str(STORIES), "--data", str(data), "--kv-cache", "fp8,int3", "--out", str(out)]) == 2
    assert "'int3' is not a cache format" in capsys.readouterr().err and not out.exists()


def test_fp8_round_trip_is_transformers_own_fp8_cache_quantizer():
    """transformers' QuantizedCache(backend="fp8") (Fp8QuantizedLayer): the scale is fixed at the first write
    (max |x| / 448) and that first chunk is returned unrounded; every later write is stored in float8 e4m3 at
    that scale. Decoding one token through it reads back what `fp8_round_trip` at that scale gives."""
    from transformers.cache_utils import Fp8QuantizedLayer

    from uptrain.measure.kv_cache import fp8_round_trip

    torch.manual_seed(0)
    layer = Fp8QuantizedLayer()
    prompt_k, prompt_v = torch.randn(1, 4, 12, 32) * 3, torch.randn(1, 4, 12, 32)
    first_k, _ = layer.update(prompt_k, prompt_v)
    assert torch.equal(first_k, prompt_k)  # the prompt's own attention sees it unrounded
    new_k, new_v = torch.randn(1, 4, 1, 32) * 3, torch.randn(1, 4, 1, 32)
    keys, values = layer.update(new_k, new_v)
    k_scale = float(prompt_k.abs().amax() / torch.finfo(torch.float8_e4m3fn).max)
    v_scale = float(prompt_v.abs().amax() / torch.finfo(torch.float8_e4m3fn).max)
    assert torch.allclose(keys[:, :, -1:], fp8_round_trip(new_k, torch.float8_e4m3fn, k_scale), rtol=0, atol=1e-6)
    assert torch.allclose(values[:, :, -1:], fp8_round_trip(new_v, torch.float8_e4m3fn, v_scale), rtol=0, atol=1e-6)
    assert torch.allclose(keys[:, :, :12], fp8_round_trip(prompt_k, torch.float8_e4m3fn, k_scale), rtol=0, atol=1e-6)
