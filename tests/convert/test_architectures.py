"""Every registered family, proven against transformers: identity is exact, duplicated heads pool
back losslessly, and the converted checkpoint loads without a weight report and generates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from tiny import load, logits, random_model, read_config, save
from uptrain.convert.architectures import FAMILIES, UNSUPPORTED, family_for, supported_model_types
from uptrain.convert import convert
from uptrain.convert.heads import merge_qkv, repeat_heads, split_qkv

HEADS, KV, HD = 8, 2, 8
IDS = torch.tensor([[3, 17, 42, 5, 99, 23, 64, 7, 11]])
SMALL = dict(hidden_size=HEADS * HD, head_dim=HD, num_attention_heads=HEADS, num_key_value_heads=KV, num_hidden_layers=2,
             intermediate_size=32, vocab_size=128, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=16)

# model type -> extra config: each family's special features switched on
GQA_TYPES: dict[str, dict] = {
    "llama": dict(attention_bias=True, tie_word_embeddings=True),
    "mistral": dict(sliding_window=4), "mixtral": MOE, "qwen2": {}, "qwen2_moe": dict(MOE, qkv_bias=True),
    "qwen3": {}, "qwen3_moe": MOE, "gemma": dict(head_dim=16), "gemma2": dict(head_dim=16),
    "gemma3_text": dict(head_dim=16, sliding_window=4), "granite": {}, "granitemoe": MOE,
    "starcoder2": dict(use_bias=True), "olmo": dict(clip_qkv=8.0), "nemotron": dict(partial_rotary_factor=0.5),
    "helium": {}, "glm": {}, "glm4": {}, "smollm3": {}, "ernie4_5": dict(use_bias=True), "exaone4": {},
    "seed_oss": dict(attention_bias=True), "exaone": {}, "internlm3": dict(bias=True, qkv_bias=True), "ministral": {},
    "arcee": {}, "cohere2": {},
    "phi": dict(qk_layernorm=True, partial_rotary_factor=0.5), "phi3": {},
    "stablelm": dict(qk_layernorm=True, use_qkv_bias=True, partial_rotary_factor=0.25),
    "cohere": dict(use_qk_norm=True), "olmo2": {}, "olmo3": {},
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=KV, alibi=False, bias=True, head_dim=None),
}
MQA_TYPES: dict[str, dict] = {  # classes with only a multi_query switch: MHA -> MQA
    "falcon": dict(new_decoder_architecture=False, multi_query=True, alibi=False, bias=True, parallel_attn=True,
                   head_dim=None),
    "gpt_bigcode": dict(multi_query=True, n_positions=256, head_dim=None),
}


def build(model_type: str, extra: dict, tmp: Path, name: str, seed: int = 0) -> Path:
    kwargs = {k: v for k, v in {**SMALL, **extra}.items() if v is not None}  # None: the class derives it
    cfg = AutoConfig.for_model(model_type, **kwargs)
    return save(random_model(cfg, seed), tmp / name)


def test_registry_covers_every_tested_type():
    assert set(GQA_TYPES) | set(MQA_TYPES) <= set(supported_model_types())
    assert set(supported_model_types()) <= set(GQA_TYPES) | set(MQA_TYPES) | {"olmo3"}


@pytest.mark.parametrize("model_type", sorted(GQA_TYPES))
def test_gqa_family(model_type, tmp_path):
    gqa = build(model_type, GQA_TYPES[model_type], tmp_path, "gqa")
    reference = logits(load(gqa), IDS)
    # identity: kv-heads equal to the current count reproduces the checkpoint exactly
    convert(str(gqa), tmp_path / "same", KV)
    assert torch.equal(logits(load(tmp_path / "same"), IDS), reference)
    # duplicate each K/V head (and per-head norm) within its group: an MHA model, the same function
    convert(str(gqa), tmp_path / "mha", HEADS, allow_expand=True)
    mha = load(tmp_path / "mha")
    assert mha.config.to_dict().get(family_for(read_config(gqa)).kv_field) == HEADS
    torch.testing.assert_close(logits(mha, IDS), reference, rtol=0, atol=1e-5)
    # pool it back: lossless
    convert(str(tmp_path / "mha"), tmp_path / "back", KV)
    back = load(tmp_path / "back")
    diff = (logits(back, IDS) - reference).abs().max().item()
    print(f"{model_type}: max |logit diff| after MHA -> GQA-{KV} = {diff:.2e}")
    assert diff < 1e-5
    # and to MQA: loads without a weight report and generates
    convert(str(tmp_path / "mha"), tmp_path / "mqa", 1)
    out = load(tmp_path / "mqa").generate(IDS, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, IDS.shape[1] + 4)


def expand_mqa_to_mha(mqa: Path, out: Path, model_type: str) -> Path:
    """Test-side inverse for MHA/MQA-only classes: MQA [q | k | v] -> MHA per-head (q, k, v)."""
    model = load(mqa)
    cfg = model.config.to_dict()
    cfg["multi_query"] = False
    mha = random_model(AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"}))
    state = model.state_dict()
    for name, t in state.items():
        if any(r.match(name) for f in FAMILIES if model_type in f.model_types for r in f.tensors):
            q, k, v = split_qkv(t, "blocks", HEADS, 1, HD)
            state[name] = merge_qkv(q, repeat_heads(k, 1, HEADS), repeat_heads(v, 1, HEADS), "grouped", HD)
    mha.load_state_dict(state)
    return save(mha, out)


@pytest.mark.parametrize("model_type", sorted(MQA_TYPES))
def test_mqa_only_family(model_type, tmp_path):
    mqa = build(model_type, MQA_TYPES[model_type], tmp_path, "mqa")
    reference = logits(load(mqa), IDS)
    mha = expand_mqa_to_mha(mqa, tmp_path / "mha", model_type)
    torch.testing.assert_close(logits(load(mha), IDS), reference, rtol=0, atol=1e-5)
    convert(str(mha), tmp_path / "same", HEADS)
    assert torch.equal(logits(load(tmp_path / "same"), IDS), logits(load(mha), IDS))
    convert(str(mha), tmp_path / "back", 1)
    assert read_config(tmp_path / "back")["multi_query"] is True
    torch.testing.assert_close(logits(load(tmp_path / "back"), IDS), reference, rtol=0, atol=1e-5)
    with pytest.raises(Exception, match="can only be multi-query"):
        convert(str(mha), tmp_path / "gqa", 2)


def test_olmo2_k_norm_pooling_is_approximate_and_reported(tmp_path):
    """Joint RMS over the K projection: exact on duplicated heads, only approximate in general."""
    src = build("olmo2", dict(num_key_value_heads=HEADS), tmp_path, "mha")
    plan = convert(str(src), tmp_path / "gqa", KV)
    assert any("approximate conversion" in n for n in plan.notes)
    assert "approximate conversion" in (tmp_path / "gqa" / "README.md").read_text()
    load(tmp_path / "gqa")


@pytest.mark.parametrize("model_type", sorted(UNSUPPORTED))
def test_unsupported_types_say_why(model_type):
    with pytest.raises(Exception, match="cannot be converted to GQA"):
        family_for({"model_type": model_type})


def test_legacy_rope_fields_stay_as_the_source_wrote_them(tmp_path):
    src = build("llama", {}, tmp_path, "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(rope_theta=500000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    (src / "config.json").write_text(json.dumps(cfg))
    convert(str(src), tmp_path / "out", 1)
    out = read_config(tmp_path / "out")
    assert out["rope_theta"] == 500000.0 and out["rope_scaling"] == cfg["rope_scaling"]
    assert out.pop("num_key_value_heads") == 1 and {k: v for k, v in cfg.items() if k != "num_key_value_heads"} == out
    loaded = load(tmp_path / "out")
    assert loaded.config.rope_parameters["rope_theta"] == 500000.0


def test_readme_table_is_the_registry():
    from conftest import REPO
    from uptrain.convert.architectures import markdown_table
    assert markdown_table() in (REPO / "README.md").read_text(), "run: python -m uptrain.convert.architectures"
