"""End-to-end conversion, proven against transformers on real and real-config checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from conftest import real_config
from tiny import load, logits, random_model, read_config, save, scaled_config
from uptrain.convert import RECORD_FILE, convert
from uptrain.convert.__main__ import main

IDS = torch.tensor([[1, 403, 407, 261, 378, 13, 55, 9, 300, 22, 7, 190]])


def run(argv: list[str]) -> int:
    return main([str(a) for a in argv])


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_identity_conversion_reproduces_the_source_exactly(mha8, tmp_path, capsys):
    """The Python API converts to the source's own count (the CLI refuses it: nothing to convert)."""
    assert run([mha8, "--kv-heads", 8, "--out", tmp_path / "out"]) == 2
    assert "nothing to convert" in capsys.readouterr().err and not (tmp_path / "out").exists()
    convert(str(mha8), tmp_path / "out", 8)
    src, out = tensors(mha8), tensors(tmp_path / "out")
    assert src.keys() == out.keys() and all(torch.equal(src[k], out[k]) for k in src)
    assert torch.equal(logits(load(mha8), IDS), logits(load(tmp_path / "out"), IDS))


def test_duplicated_heads_convert_losslessly_to_the_real_gqa_model(mha8, original_gqa4, tmp_path):
    out = tmp_path / "gqa"
    assert run([mha8, "--kv-heads", 4, "--out", out]) == 0
    converted, original = load(out), load(original_gqa4)
    torch.testing.assert_close(logits(converted, IDS), logits(original, IDS), rtol=0, atol=1e-5)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    gen = [m.generate(ids, max_new_tokens=30, do_sample=False) for m in (converted, original)]
    assert torch.equal(gen[0], gen[1])
    assert tok.decode(gen[0][0], skip_special_tokens=True).startswith("Once upon a time, there was a little girl")


def test_output_folder_is_complete(mha8, tmp_path):
    out = tmp_path / "out"
    run([mha8, "--kv-heads", 2, "--out", out])
    src_cfg, out_cfg = read_config(mha8), read_config(out)
    assert out_cfg.pop("num_key_value_heads") == 2 and src_cfg.pop("num_key_value_heads") == 8
    assert out_cfg == src_cfg
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors(out))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors(out).values())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md", RECORD_FILE):
        assert (out / name).is_file(), name
    # the SentencePiece model llama.cpp's GGUF converter reads, copied byte for byte
    assert (out / "tokenizer.model").read_bytes() == (Path(mha8) / "tokenizer.model").read_bytes()
    record = json.loads((out / RECORD_FILE).read_text())
    assert record["new_kv_heads"] == 2 and record["dims"]["kv_heads"] == 8 and record["kv_reduction"] == 4.0
    assert "8 query heads share 2 K/V heads" in (out / "README.md").read_text()
    assert tensors(out)["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 64)
    load(out)  # no missing / unexpected / mismatched weights
    AutoTokenizer.from_pretrained(out)


def test_pooled_tensors_are_contiguous_group_means(mha8, tmp_path):
    run([mha8, "--kv-heads", 2, "--out", tmp_path / "out"])
    src, out = tensors(mha8), tensors(tmp_path / "out")
    for proj in ("k_proj", "v_proj"):
        w = src[f"model.layers.3.self_attn.{proj}.weight"]
        torch.testing.assert_close(out[f"model.layers.3.self_attn.{proj}.weight"],
                                   w.view(2, 4, 8, 64).mean(1).reshape(16, 64))
    assert torch.equal(out["model.layers.3.self_attn.q_proj.weight"], src["model.layers.3.self_attn.q_proj.weight"])


@pytest.mark.parametrize("method", ["first", "random"])
def test_ablation_methods(mha8, tmp_path, method):
    run([mha8, "--kv-heads", 2, "--method", method, "--seed", 3, "--out", tmp_path / "a"])
    src, out = tensors(mha8), tensors(tmp_path / "a")
    k = out["model.layers.0.self_attn.k_proj.weight"]
    if method == "first":
        assert torch.equal(k, src["model.layers.0.self_attn.k_proj.weight"].view(2, 4, 8, 64)[:, 0].reshape(16, 64))
    else:
        run([mha8, "--kv-heads", 2, "--method", method, "--seed", 3, "--out", tmp_path / "b"])
        assert torch.equal(k, tensors(tmp_path / "b")["model.layers.0.self_attn.k_proj.weight"])  # seeded
        assert abs(k.std().item() - 0.02) < 0.005  # N(0, initializer_range)
    load(tmp_path / "a")


MHA_CONFIGS = [  # real config file, target kv heads, head_dim for the scaled-down model
    ("llama-2-7b-hf", 8, 8), ("llama-2-13b-hf", 5, 8), ("open_llama_7b", 4, 8), ("vicuna-7b-v1.5", 1, 8),
    ("qwen1.5-0.5b", 4, 8), ("qwen1.5-7b", 8, 8), ("phi-2", 8, 10), ("olmo-1b-hf", 4, 8),
    ("olmo-7b-hf", 8, 8), ("olmo-2-0425-1b", 4, 8), ("mistral-7b-v0.1", 2, 8), ("meta-llama-3-8b", 1, 8),
    ("qwen2.5-7b", 2, 8), ("gemma-2b", 1, 16),
]


@pytest.mark.parametrize("name,kv,head_dim", MHA_CONFIGS)
def test_scaled_real_configs_convert_and_load(tmp_path, name, kv, head_dim):
    raw = json.loads(real_config(name).read_text())
    cfg = scaled_config(raw, head_dim=head_dim)
    src = save(random_model(cfg), tmp_path / "src")
    before = (src / "config.json").read_bytes()
    convert(str(src), tmp_path / "out", kv)  # the API: the source's own count included (gemma-2b's 1)
    model = load(tmp_path / "out")
    assert model.config.num_key_value_heads == kv and model.config.num_attention_heads == cfg.num_attention_heads
    k = next(v for n, v in tensors(tmp_path / "out").items() if n.endswith("k_proj.weight"))
    assert k.shape[0] == kv * head_dim
    assert torch.isfinite(logits(model, IDS % cfg.vocab_size)).all()
    assert (src / "config.json").read_bytes() == before


def test_bf16_in_bf16_out_and_dtype_option(tmp_path):
    raw = json.loads(real_config("qwen1.5-0.5b").read_text())
    src = save(random_model(scaled_config(raw), dtype=torch.bfloat16), tmp_path / "src")
    run([src, "--kv-heads", 4, "--out", tmp_path / "bf16"])
    assert {t.dtype for t in tensors(tmp_path / "bf16").values()} == {torch.bfloat16}
    assert load(tmp_path / "bf16").dtype == torch.bfloat16
    run([src, "--kv-heads", 4, "--dtype", "float32", "--out", tmp_path / "f32"])
    assert {t.dtype for t in tensors(tmp_path / "f32").values()} == {torch.float32}
    assert read_config(tmp_path / "f32")["dtype"] == "float32"
    # pooling happens in float32 and is cast once, to the output dtype: a float32 output of a bf16
    # source holds the exact float32 group mean, not a bf16-rounded one
    for name in ("model.layers.0.self_attn.k_proj.bias", "model.layers.1.self_attn.v_proj.weight"):
        k_src = tensors(src)[name]
        expected = k_src.float().view(4, 4, 8, *k_src.shape[1:]).mean(1).reshape(-1, *k_src.shape[1:])
        got = tensors(tmp_path / "f32")[name]
        assert not torch.equal(expected, expected.bfloat16().float())  # the test can tell the two apart
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        torch.testing.assert_close(tensors(tmp_path / "bf16")[name], expected.bfloat16(), rtol=0, atol=0)


def test_multi_shard_source_gives_correct_multi_shard_output(mha8, tmp_path):
    src = save(load(mha8), tmp_path / "src", max_shard_size="200KB")
    assert len(list(src.glob("*.safetensors"))) > 1
    run([src, "--kv-heads", 4, "--out", tmp_path / "sharded", "--max-shard-size", "200KB"])
    run([mha8, "--kv-heads", 4, "--out", tmp_path / "single"])
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1 and all(s.stat().st_size < 200_000 + 16_384 for s in shards)
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    a, b = tensors(tmp_path / "sharded"), tensors(tmp_path / "single")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    torch.testing.assert_close(logits(load(tmp_path / "sharded"), IDS), logits(load(tmp_path / "single"), IDS))


def test_dry_run_prints_the_plan_and_writes_nothing(mha8, tmp_path, capsys):
    assert run([mha8, "--kv-heads", 2, "--dry-run", "--out", tmp_path / "out"]) == 0
    text = capsys.readouterr().out
    assert "K/V heads 8 -> 2 (groups of 4)" in text and "280,512 -> 249,792" in text
    assert "2.5 KiB -> 640 B" in text and "4.0x smaller" in text and "@ 512 tok" in text
    assert list(tmp_path.iterdir()) == []


def test_force_replaces_an_existing_output(mha8, tmp_path):
    out = tmp_path / "out"
    run([mha8, "--kv-heads", 4, "--out", out])
    (out / "stale.txt").write_text("old")
    assert run([mha8, "--kv-heads", 2, "--out", out, "--force"]) == 0
    assert not (out / "stale.txt").exists() and read_config(out)["num_key_value_heads"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_python_api_and_module_entry_point(mha8, tmp_path):
    plan = convert(str(mha8), tmp_path / "api", 4)
    assert plan.kv_reduction == 2.0
    proc = subprocess.run([sys.executable, "-m", "uptrain.convert", str(mha8), "--kv-heads", "4", "--dry-run"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "2.0x smaller" in proc.stdout


def test_unchanged_tensors_are_copied_as_bytes_and_phases_are_timed(mha8, tmp_path, capsys):
    """Identity conversion: every tensor moves as a byte range (no tensor is read); --verbose
    prints the time of each phase, and the record keeps it."""
    convert(str(mha8), tmp_path / "same", 8)  # the API (the CLI refuses the source's own count)
    timing = json.loads((tmp_path / "same" / RECORD_FILE).read_text())["timing_s"]
    assert {"plan", "copy", "write", "fsync"} <= set(timing) and "read" not in timing and "pool" not in timing
    assert run([mha8, "--kv-heads", 2, "--out", tmp_path / "gqa", "--verbose"]) == 0
    assert "time: plan" in capsys.readouterr().out
    timing = json.loads((tmp_path / "gqa" / RECORD_FILE).read_text())["timing_s"]
    assert {"plan", "copy", "read", "pool", "write", "fsync"} <= set(timing)
