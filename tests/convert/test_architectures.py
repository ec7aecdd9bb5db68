"""Every registered family, proven against transformers: identity is exact, duplicated heads pool
back losslessly, and the converted checkpoint loads without a weight report and generates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from families import GQA_TYPES, HD, HEADS, KV, MQA_TYPES, tiny_config
from tiny import load, logits, random_model, read_config, save
from uptrain.convert.registry.architectures import FAMILIES, UNSUPPORTED, family_for, supported_model_types
from uptrain.convert import convert
from uptrain.convert.math.heads import merge_qkv, repeat_heads, split_qkv
from uptrain.convert.io.hfconfig import attention_dims

IDS = torch.tensor([[3, 17, 42, 5, 99, 23, 64, 7, 11]])


def build(model_type: str, extra: dict, tmp: Path, name: str, seed: int = 0) -> Path:
    return save(random_model(tiny_config(model_type, extra), seed), tmp / name)


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
    from uptrain.convert.registry.architectures import markdown_table
    assert markdown_table() in (REPO / "docs" / "convert.md").read_text(), "run: python -m uptrain.convert.registry.architectures"


# ------------------------------------------------------------------ the registry's facts, checked against transformers

# MQA-only classes as the converter sees them: multi-head (multi_query false)
ALL_TYPES = [*GQA_TYPES.items(), *((t, dict(e, multi_query=False)) for t, e in MQA_TYPES.items())]
ALL_IDS = [f"{t}-{'gqa' if i < len(GQA_TYPES) else 'mqa'}" for i, (t, _) in enumerate(ALL_TYPES)]


def test_every_registry_type_resolves_every_fact():
    """No family falls back on a default it does not state: every model type of every entry has one
    set of attention names, a K/V tensor rule, and a key norm named where it has one."""
    from uptrain.convert.registry.architectures import attention_for

    for family in FAMILIES:
        a = family.attention
        assert a.module and a.o and (a.qkv or (a.q and a.k and a.v)), family.model_types
        assert bool(a.qkv) == (family.qkv_layout is not None) or family.refuse, family.model_types
        assert bool(family.key_norm) == bool(family.key_norm_module), family.model_types
        assert family.tensors and family.tensors[0].kind == ("qkv" if a.qkv else "heads")
        for model_type in family.model_types:
            assert attention_for(model_type) == family.modules, f"{model_type}: entries disagree on its names"
    for model_type, extra in ALL_TYPES:
        family = family_for(tiny_config(model_type, extra).to_dict())
        assert model_type in family.model_types


def _attention_modules(model, names) -> dict[str, torch.nn.Module]:
    """Each decoder layer's attention module, found by the registry's name."""
    return {n: m for n, m in model.named_modules()
            if n.rsplit(".", 1)[-1] == names.module and n.split(".")[-2].isdigit()}


@pytest.mark.parametrize("model_type, extra", ALL_TYPES, ids=ALL_IDS)
def test_registry_names_are_the_modules_transformers_builds(model_type, extra, tmp_path):
    """The attention module and its q/k/v/o (or fused) projections exist under the registry's
    names in every layer and are all its linear maps; key norms exist exactly where the registry
    says (flags on and off); the K/V tensor rules match real parameters; calibration finds one
    input module per layer."""
    from transformers import AutoModelForCausalLM

    # the families' optional q/k norms on (as in GQA_TYPES), then every such switch off
    for cfg_extra in (extra, dict(extra, qk_layernorm=False, use_qk_norm=False)):
        cfg = tiny_config(model_type, cfg_extra)
        family = family_for(cfg.to_dict())
        model = AutoModelForCausalLM.from_config(cfg)
        names = family.modules
        attn = _attention_modules(model, names)
        assert len(attn) == cfg.num_hidden_layers, f"no {names.module!r} module in each layer"
        for prefix, module in attn.items():
            linear = {n for n, m in module.named_children()
                      if isinstance(m, torch.nn.Linear) or "Conv1D" in type(m).__name__}
            assert linear == set(names.roles()), (prefix, linear)
            has_norm = bool(family.key_norm_module) and hasattr(module, family.key_norm_module)
            said = family.key_norm_in(cfg.to_dict())
            assert has_norm == (said is not None), (prefix, said)
        # the K/V tensor rules name tensors as checkpoints store them (EXAONE's differ from its modules)
        params = [n for f in save(model, tmp_path / f"{model_type}-{len(cfg_extra)}").glob("*.safetensors")
                  for n in safe_open(f, "pt").keys()]
        for rule in family.tensors:
            hits = [n for n in params if rule.match(n)]
            if rule.is_norm and family.key_norm_in(cfg.to_dict()) is None:
                assert not hits, rule.pattern
            else:
                assert len(hits) >= cfg.num_hidden_layers, rule.pattern
        inputs = names.input_modules(n for n, _ in model.named_modules())
        assert sorted(inputs.values()) == sorted(f"{p}." for p in attn)


def _rotate_planes(rows: torch.Tensor, heads: int, hd: int, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate each head's rows [heads*hd, *rest] in each RoPE plane by angles [heads, hd/2]:
    planes (2i, 2i+1) when interleaved, else (i, i + hd/2); built here, independently of fit.py."""
    first, second = ((torch.arange(0, hd, 2), torch.arange(1, hd, 2)) if interleaved
                     else (torch.arange(hd // 2), torch.arange(hd // 2, hd)))
    r = rows.reshape(heads, hd, *rows.shape[1:]).clone()
    c = angles.cos().reshape(heads, hd // 2, *([1] * (rows.dim() - 1)))
    s = angles.sin().reshape(heads, hd // 2, *([1] * (rows.dim() - 1)))
    a, b = r[:, first], r[:, second]
    r[:, first], r[:, second] = c * a - s * b, s * a + c * b
    return r.reshape(rows.shape)


# GPTBigCode: learned positions, no RoPE
ROPE_TYPES = [(t, e) for t, e in ALL_TYPES if t != "gpt_bigcode"]
ROPE_IDS = [i for i, (t, _) in zip(ALL_IDS, ALL_TYPES) if t != "gpt_bigcode"]


@pytest.mark.parametrize("model_type, extra", ROPE_TYPES, ids=ROPE_IDS)
def test_rope_pairing_is_the_one_transformers_applies(model_type, extra, one_torch_thread):
    """Rotating q and k of each head by the same angle in each RoPE plane keeps every score, at every
    position, only if the planes are the ones the modeling file rotates: the registry's
    `interleaved_rope` keeps the logits; the other pairing changes them."""
    family = family_for(tiny_config(model_type, extra).to_dict())
    # full rotary, no LayerNorm on q/k (mean subtraction is not rotation-invariant)
    extra = {**extra, "partial_rotary_factor": 1.0, "qk_layernorm": False, "use_qk_norm": False}
    cfg = tiny_config(model_type, extra)
    model = random_model(cfg)
    dims = attention_dims(cfg, family)
    heads, kv, hd = dims.heads, dims.kv_heads, dims.head_dim
    state = model.state_dict()
    names, layout = family.modules, family.qkv_layout[0] if family.qkv_layout else None
    for name in list(state):
        p = names.match(name)
        if name.split(".")[-2].endswith("norm") and f".{names.module}." in name:  # RMS q/k norms: uniform scale
            state[name] = torch.full_like(state[name], state[name].flatten()[0].item())
        elif p is not None and p.role in ("q", "k", "qkv"):
            state[name] = state[name] * 4  # sharper attention: a wrong rotation shows in the logits
    model.load_state_dict(state)
    reference = logits(model, IDS)
    gen = torch.Generator().manual_seed(0)
    angles = {prefix: torch.rand(kv, hd // 2, generator=gen) * 6.28 for prefix in
              {names.match(n).layer for n in state if names.match(n)}}

    def rotated(interleaved: bool) -> torch.Tensor:
        new = dict(state)
        for name, t in state.items():
            p = names.match(name)
            if p is None or p.role not in ("q", "k", "qkv"):
                continue
            k_angles = angles[p.layer]
            q_angles = k_angles.repeat_interleave(heads // kv, dim=0)  # query head h uses K/V head h // g
            if p.role == "qkv":
                q, k, v = split_qkv(t, layout, heads, kv, hd)
                new[name] = merge_qkv(_rotate_planes(q, heads, hd, q_angles, interleaved),
                                      _rotate_planes(k, kv, hd, k_angles, interleaved), v, layout, hd)
            else:
                n, a = (heads, q_angles) if p.role == "q" else (kv, k_angles)
                new[name] = _rotate_planes(t, n, hd, a, interleaved)
        model.load_state_dict(new)
        return logits(model, IDS)

    right = (rotated(family.interleaved_rope) - reference).abs().max().item()
    wrong = (rotated(not family.interleaved_rope) - reference).abs().max().item()
    print(f"{model_type}: |logit diff| registry pairing {right:.1e}, other pairing {wrong:.1e}")
    assert right < 1e-4
    assert wrong > 1e-2
