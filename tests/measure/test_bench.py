"""KV-cache bytes measured from real caches, decode timing, memory budget, compare."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, MistralConfig, MistralForCausalLM

from uptrain.measure import bench, compare
from uptrain.measure.bench import (bench_model, decode_throughput, kv_bytes_per_token_formula, max_batch_in_budget,
                           measure_kv_bytes)
from uptrain.units import parse_size
from uptrain.measure.eval import load_model

from conftest import EXAMPLE_MHA8, VALID_TXT as VALID, built_gqa4, real_config

CONTEXT = 48


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(scope="module")
def kv_bytes() -> Callable[[Path], tuple[int, int]]:
    """Helper: model dir -> (measured KV bytes after a CONTEXT-token forward, formula bytes)."""

    def measure(model_dir: Path) -> tuple[int, int]:
        model, _ = load_model(str(model_dir))
        return measure_kv_bytes(model, CONTEXT), kv_bytes_per_token_formula(model.config, model.dtype) * CONTEXT

    return measure


def test_mha8_holds_twice_the_kv_cache_of_gqa4(kv_bytes) -> None:
    mha, mha_formula = kv_bytes(EXAMPLE_MHA8)
    gqa, gqa_formula = kv_bytes(built_gqa4())
    assert (mha, gqa) == (mha_formula, gqa_formula)
    assert mha == 2 * gqa
    assert mha == 2 * 5 * 8 * 8 * 4 * CONTEXT  # K and V x layers x kv heads x head_dim x fp32


def test_mha8_holds_four_times_the_kv_cache_of_its_2_kv_head_conversion(kv_bytes, tmp_path) -> None:
    from uptrain.convert import convert
    convert(str(EXAMPLE_MHA8), tmp_path / "gqa2", 2)
    mha, mha_formula = kv_bytes(EXAMPLE_MHA8)
    gqa, gqa_formula = kv_bytes(tmp_path / "gqa2")
    assert (mha, gqa) == (mha_formula, gqa_formula)
    assert mha == 4 * gqa


@pytest.mark.parametrize("name, dtype, per_token", [
    ("llama-2-7b-hf", torch.float16, 512 * 1024),  # 32 layers x 32 kv heads x 128
    ("mistral-7b-v0.1", torch.bfloat16, 128 * 1024),  # 32 layers x 8 kv heads x 128
    ("gemma-2b", torch.bfloat16, 18 * 1024),  # 18 layers x 1 kv head x 256 (head_dim given)
])
def test_formula_on_real_configs(name: str, dtype: torch.dtype, per_token: int) -> None:
    raw = json.loads(real_config(name).read_text())
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    assert kv_bytes_per_token_formula(config, dtype) == per_token


def test_sliding_window_cache_is_capped_and_warned(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=16, max_position_embeddings=128)
    MistralForCausalLM(cfg).save_pretrained(tmp_path)  # no tokenizer: bench does not need one
    with pytest.warns(UserWarning, match="formula"):
        result = bench_model(str(tmp_path), contexts=[40], batches=[], new_tokens=4)
    assert result.kv_bytes[40] < result.kv_bytes_per_token_formula * 40


def test_decode_throughput_generates_exactly_new_tokens() -> None:
    model, _ = load_model(str(built_gqa4()))
    result = decode_throughput(model, batch=2, context=16, new_tokens=5, warmup=0, repeats=2)
    assert len(result.times_s) == 2
    assert result.decode_tokens_per_s > 0 and result.generate_tokens_per_s > 0


def test_memory_budget_arithmetic() -> None:
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("1.5 GiB") == 3 * 2**29
    assert max_batch_in_budget(weight_bytes=100, kv_bytes_at_context=30, budget=200) == 3
    assert max_batch_in_budget(weight_bytes=300, kv_bytes_at_context=30, budget=200) == 0


def test_bench_and_compare_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mha, gqa = str(EXAMPLE_MHA8), str(built_gqa4())
    fast = ["--context", "16", "32", "--batch", "1", "--new-tokens", "3", "--warmup", "0", "--repeats", "1"]
    assert bench.main([gqa, *fast, "--memory-budget", "2MB", "--json", str(tmp_path / "b.json"),
                       "--plot", str(tmp_path / "plots")]) == 0
    (row,) = json.loads((tmp_path / "b.json").read_text())
    assert row["kv_bytes"] == {"16": 1280 * 16, "32": 1280 * 32}
    assert row["max_batch"]["32"] > 0
    assert row["max_batch"]["32"] == (2 * 10**6 - row["weight_bytes"]) // (1280 * 32)
    assert len(row["decode"]) == 2
    assert (tmp_path / "plots" / "kv-bytes.png").is_file() and (tmp_path / "plots" / "decode-speed.png").is_file()

    assert compare.main([mha, gqa, "--data", str(VALID), "--max-documents", "2", "--max-length", "128",
                         *fast, "--json", str(tmp_path / "c.json")]) == 0
    src, conv = json.loads((tmp_path / "c.json").read_text())
    assert src["kv_reduction"] == 1.0 and conv["kv_reduction"] == 2.0
    assert abs(conv["perplexity_change_pct"]) < 1e-3
    assert set(conv["decode_speedup"]) == {"1x16", "1x32"}
    # the source is the reference: exactly itself; gqa4 rebuilt losslessly from it: all but identical
    assert (src["kl_to_source"], src["top1_agreement"], src["greedy_agreement"]) == (0.0, 1.0, 1.0)
    assert conv["kl_to_source"] < 1e-6 and conv["eval"]["greedy_prompts"] == 2 and conv["warnings"] == []
    assert "KV reduction" in (out := capsys.readouterr().out) and "KL to source" in out

    assert bench.main([str(tmp_path / "missing")]) == 2
    assert bench.main([gqa, "--context", "600"]) == 2  # beyond max_position_embeddings 512
    assert bench.main([gqa, "--memory-budget", "lots"]) == 2


def _decode(times: list[float], batch: int = 1, new_tokens: int = 11) -> bench.DecodeResult:
    rate = batch * (new_tokens - 1) / sorted(times)[len(times) // 2]
    return bench.DecodeResult(batch=batch, context=16, new_tokens=new_tokens, decode_tokens_per_s=rate,
                              generate_tokens_per_s=rate, times_s=times, decode_times_s=times)


def test_unmeasurable_timings_are_reported_as_such_not_as_speedups() -> None:
    steady, short, noisy = _decode([0.20, 0.21, 0.22]), _decode([0.001, 0.001, 0.002]), _decode([0.1, 0.2, 0.4])
    assert steady.unreliable is None and steady.decode_range == pytest.approx((10 / 0.22, 10 / 0.20))
    assert "too short" in short.unreliable and "noisy" in noisy.unreliable
    assert "10.0-10.0" not in bench.format_decode(steady) and ": " not in bench.format_decode(steady)

    def result(d: bench.DecodeResult, kv: int) -> bench.BenchResult:
        return bench.BenchResult(model=f"m{kv}", dtype="float32", device="cpu", threads=1, layers=1, kv_heads=kv,
                                 head_dim=8, weight_bytes=1, kv_bytes_per_token_formula=16 * kv,
                                 kv_bytes_per_token=16 * kv, kv_bytes={16: 256 * kv}, max_batch=None, decode=[d])

    rows = compare.compare([_eval("m8"), _eval("m2")], [result(steady, 8), result(short, 2)])
    table = compare.comparison_table(rows)
    assert "too short" in table and "not measurable" in table
    assert rows[1].decode_unreliable == {"1x16": short.unreliable}
    rows = compare.compare([_eval("m8"), _eval("m2")], [result(steady, 8), result(_decode([0.1, 0.1, 0.1]), 2)])
    assert "2.10x" in compare.comparison_table(rows) and not rows[1].decode_unreliable  # 0.21 s / 0.1 s


def _eval(name: str) -> compare.EvalResult:
    return compare.EvalResult(model=name, loss=1.0, perplexity=2.718, tokens=10, documents=1)


REFERENCE = Path(__file__).resolve().parents[2] / "results" / "paper" / "reference-mha8"  # head_dim 32: takes q8_0


def test_kv_cache_q8_0_gives_the_formats_bytes_and_says_they_are_not_measured(tmp_path: Path) -> None:
    fast = ["--context", "16", "--batch", "1", "--new-tokens", "2", "--warmup", "0", "--repeats", "1"]
    assert bench.main([str(REFERENCE), *fast, "--kv-cache", "q8_0", "--memory-budget", "20MB",
                       "--json", str(tmp_path / "b.json")]) == 0
    (row,) = json.loads((tmp_path / "b.json").read_text())
    per_token = 2 * 4 * 8 * 32 * 34 / 32  # K and V x layers x kv heads x head_dim x 34 bytes per 32 values
    assert row["kv_cache"] == "q8_0" and row["kv_bytes_per_token"] == per_token == 2176
    assert row["kv_bytes_per_token_formula"] == 2176 and row["kv_bytes"] == {"16": 2176 * 16}
    assert row["kv_bytes_measured_in"].startswith("formula") and "not measured" in row["kv_bytes_measured_in"]
    assert row["kv_bytes_per_token_stored"] == 2 * 4 * 8 * 32 * 4  # what transformers held: float32
    assert row["max_batch"]["16"] == (20 * 10**6 - row["weight_bytes"]) // (2176 * 16)
    assert len(row["decode"]) == 1  # timed as saved


def test_kv_cache_model_is_measured_as_before(tmp_path: Path) -> None:
    fast = ["--context", "16", "--batch", "1", "--new-tokens", "2", "--warmup", "0", "--repeats", "1"]
    assert bench.main([str(EXAMPLE_MHA8), *fast, "--json", str(tmp_path / "b.json")]) == 0
    (row,) = json.loads((tmp_path / "b.json").read_text())
    assert row["kv_cache"] == "model" and row["kv_bytes_measured_in"].startswith("measured")
    assert row["kv_bytes_per_token"] == row["kv_bytes_per_token_stored"] == 2 * 5 * 8 * 8 * 4


def test_a_block_format_the_head_dim_cannot_take_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([str(EXAMPLE_MHA8), "--context", "16", "--kv-cache", "q8_0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "head_dim 8" in err and "q8_0" in err
    assert bench.main([str(EXAMPLE_MHA8), "--kv-cache", "int3"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
