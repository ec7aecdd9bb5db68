"""`trainable`: train all parameters, the attention modules, or the q/k/v/o projections (real stories260K, CPU)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import DEMO, GQA4, need_models, tiny_overrides, train_losses
from uptrain.train import train
from uptrain.train.__main__ import main
from uptrain.train.config import load_config
from uptrain.train.state.run_state import complete_checkpoints
from uptrain.convert.registry.architectures import attention_for
from uptrain.train.model.trainable import apply_trainable, is_trainable

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


@pytest.mark.parametrize("model_type, name, attention, kv", [
    ("llama", "model.layers.0.self_attn.q_proj.weight", True, True),
    ("qwen2", "model.layers.0.self_attn.k_proj.bias", True, True),
    ("llama", "model.layers.0.self_attn.o_proj.weight", True, True),
    ("qwen3", "model.layers.0.self_attn.k_norm.weight", True, False),  # Qwen3 / OLMo2: attention, not kv
    ("phi3", "model.layers.0.self_attn.qkv_proj.weight", True, True),  # Phi-3 fused
    ("phi", "model.layers.0.self_attn.dense.weight", True, True),  # Phi output
    ("llama", "model.layers.0.self_attn.dense.weight", True, False),  # not a Llama projection name
    ("falcon", "transformer.h.0.self_attention.query_key_value.weight", True, True),  # Falcon
    ("falcon", "transformer.h.0.self_attention.dense.weight", True, True),
    ("gpt_bigcode", "transformer.h.0.attn.c_attn.weight", True, True),  # GPTBigCode
    ("gpt_bigcode", "transformer.h.0.attn.c_proj.bias", True, True),
    ("gpt_bigcode", "transformer.h.0.mlp.c_proj.weight", False, False),  # GPTBigCode MLP output: not attention
    ("llama", "model.layers.0.mlp.down_proj.weight", False, False),
    ("llama", "model.layers.0.input_layernorm.weight", False, False),
    ("llama", "model.embed_tokens.weight", False, False),
])
def test_registry_names_are_matched(model_type, name, attention, kv):
    names = attention_for(model_type)
    assert is_trainable(name, "all", names)
    assert is_trainable(name, "attention", names) == attention
    assert is_trainable(name, "kv", names) == kv


def test_kv_and_attention_select_the_registry_modules_of_every_family():
    """On real (tiny) models of every registry family: `kv` trains exactly the parameters of the
    modules the registry names as q/k/v/o (or fused), `attention` everything under the attention module."""
    from transformers import AutoModelForCausalLM
    from families import GQA_TYPES, MQA_TYPES, tiny_config

    for model_type, extra in [*GQA_TYPES.items(), *MQA_TYPES.items()]:
        cfg = tiny_config(model_type, extra)
        model = AutoModelForCausalLM.from_config(cfg)
        names = attention_for(model_type)
        modules = dict(model.named_modules())
        attn = {n for n in modules if n.rsplit(".", 1)[-1] == names.module and n.split(".")[-2].isdigit()}
        assert len(attn) == cfg.num_hidden_layers, (model_type, names.module)
        projections = {f"{a}.{p}.{param}" for a in attn for p in names.roles()
                       for param in ("weight", "bias") if getattr(modules[f"{a}.{p}"], param, None) is not None}
        inside = {n for n, _ in model.named_parameters() if any(n.startswith(a + ".") for a in attn)}
        apply_trainable(model, "kv")
        assert {n for n, p in model.named_parameters() if p.requires_grad} == projections, model_type
        apply_trainable(model, "attention")
        assert {n for n, p in model.named_parameters() if p.requires_grad} == inside, model_type


def test_stages_train_kv_first_then_all_and_resume_inside_the_schedule(tmp_path, capsys):
    need_models()
    run_dir = tmp_path / "run"
    # 6 steps of 512 tokens: kv for steps 1-4 (2,048 tokens), then all for steps 5-6.
    args = tiny_overrides(run_dir, steps=6, threads=1, trainable="all", **{
        "trainable_stages": "[{trainable: kv, tokens: 2048}]", "checkpoint.every": 2, "checkpoint.keep": 3})
    train(load_config(DEMO, args))
    assert "trainable stages: kv for steps 1-4, then all for steps 5-6" in capsys.readouterr().out
    start = _weights(GQA4)
    after_kv = _weights(run_dir / "checkpoints" / "checkpoint-00000002")
    end = _weights(run_dir / "model")
    for name in start:
        kv = any(f".self_attn.{p}_proj." in name for p in "qkvo")
        assert torch.equal(start[name], after_kv[name]) != kv, name  # kv stage: only q/k/v/o moved
        assert not torch.equal(start[name], end[name]), name  # stage 2: everything trained
    reference = train_losses(run_dir)

    # Resumed from the checkpoint of step 2, inside the kv stage: still kv only, then all; same losses.
    shutil.rmtree(run_dir / "model")
    (run_dir / "finished.json").unlink()
    for checkpoint in complete_checkpoints(run_dir)[1:]:
        shutil.rmtree(checkpoint)
    train(load_config(DEMO, args + ["resume=latest"]))
    resumed = train_losses(run_dir)
    assert sorted(resumed) == list(range(1, 7))
    for step in range(1, 7):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), step


@pytest.mark.parametrize("extra, message", [
    ({"trainable_stages": "[{trainable: kv, tokens: 4096}]"}, "trainable_stages take 4,096 tokens, more than the budget of 2,048"),
    ({"trainable_stages": "[{trainable: mlp, tokens: 512}]"}, "unknown trainable 'mlp'"),
    ({"trainable_stages": "[{trainable: kv, tokens: 100}]"}, "less than one optimizer step of 512 tokens"),
])
def test_bad_stages_refused_before_any_work(tmp_path, capsys, extra, message):
    need_models()
    run_dir = tmp_path / "run"
    assert main([str(DEMO), *tiny_overrides(run_dir, **extra)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, last
    assert not run_dir.exists()
