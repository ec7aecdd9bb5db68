"""`trainable`: train all parameters, the attention modules, or the q/k/v/o projections (real stories260K, CPU)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import DEMO, GQA4, need_models, tiny_overrides
from uptrain.train import train
from uptrain.train.__main__ import main
from uptrain.train.config import load_config
from uptrain.train.trainable import is_trainable

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _weights(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_kv_trains_only_the_projections_and_prints_the_count(tmp_path, capsys):
    need_models()
    run_dir = tmp_path / "run"
    train(load_config(DEMO, tiny_overrides(run_dir, steps=3, trainable="kv", threads=1)))
    start, end = _weights(GQA4), _weights(run_dir / "model")
    assert set(start) == set(end)
    proj = {n for n in start if any(f".self_attn.{p}_proj." in n for p in "qkvo")}
    assert len(proj) == 4 * 5  # q, k, v, o of 5 layers (no biases in stories260K)
    for name in start:
        if name in proj:
            assert not torch.equal(start[name], end[name]), f"{name} should have trained"
        else:
            assert torch.equal(start[name], end[name]), f"{name} should be frozen (bit-identical)"
    n_proj = sum(start[n].numel() for n in proj)
    n_all = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(GQA4).parameters())
    assert f"trainable: kv ({n_proj:,} of {n_all:,} parameters)" in capsys.readouterr().out
    # 5 layers x (q 64x64 + k 32x64 + v 32x64 + o 64x64)
    assert n_proj == 5 * (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64)


def test_unknown_trainable_is_refused_before_any_work(tmp_path, capsys):
    need_models()
    run_dir = tmp_path / "run"
    assert main([str(DEMO), *tiny_overrides(run_dir, trainable="mlp")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "error: unknown trainable 'mlp'; use one of all, attention, kv", last
    assert not run_dir.exists()


@pytest.mark.parametrize("name, attention, kv", [
    ("model.layers.0.self_attn.q_proj.weight", True, True),
    ("model.layers.0.self_attn.k_proj.bias", True, True),
    ("model.layers.0.self_attn.o_proj.weight", True, True),
    ("model.layers.0.self_attn.k_norm.weight", True, False),  # Qwen3 / OLMo2: attention, not kv
    ("model.layers.0.self_attn.qkv_proj.weight", True, True),  # Phi-3 fused
    ("model.layers.0.self_attn.dense.weight", True, True),  # Phi output
    ("transformer.h.0.self_attention.query_key_value.weight", True, True),  # Falcon
    ("transformer.h.0.attn.c_attn.weight", True, True),  # GPTBigCode
    ("transformer.h.0.attn.c_proj.bias", True, True),
    ("transformer.h.0.mlp.c_proj.weight", False, False),  # GPTBigCode MLP output: not attention
    ("model.layers.0.mlp.down_proj.weight", False, False),
    ("model.layers.0.input_layernorm.weight", False, False),
    ("model.embed_tokens.weight", False, False),
])
def test_registry_names_are_matched(name, attention, kv):
    assert is_trainable(name, "all")
    assert is_trainable(name, "attention") == attention
    assert is_trainable(name, "kv") == kv
