"""uptrain.train.model.decode_cache: repeated K/V heads found exactly (a property over planted runs
at real head counts) and stored once, and a teacher expanded from GQA decoding as transformers does."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, StaticCache

from tests.families import GQA_TYPES, HEADS, KV, tiny_config
from tests.tiny import random_model, save
from uptrain.convert.pipeline import convert
from uptrain.train.model.decode_cache import DecodeLayer, decode_cache, repeated_kv_groups, run_group
from uptrain.train.model import sampling
from uptrain.train.model.sampling import sample_continuations


@pytest.mark.parametrize("heads", [8, 32, 40, 64])
def test_run_group_is_the_longest_run_of_identical_heads(heads):
    gen = torch.Generator().manual_seed(heads)
    divisors = [g for g in range(1, heads + 1) if heads % g == 0]
    for trial in range(40):
        g = divisors[trial % len(divisors)]
        k, v = (torch.randn(2, heads // g, 5, 8, generator=gen).repeat_interleave(g, dim=1) for _ in range(2))
        assert run_group(k, v) == g
        if g > 1:  # one element of one head off, in the keys or in the values alone: not that run
            which = [k, v][trial % 2].clone()
            which[1, g - 1, trial % 5, trial % 8] += 1e-6
            broken = run_group(which, v) if trial % 2 == 0 else run_group(k, which)
            assert broken == 1  # head g - 1 now differs from every head it could share a run with
            spread = k.view(2, heads // g, g, 5, 8).transpose(1, 2).reshape(2, heads, 5, 8)  # runs not adjacent
            assert run_group(spread, spread) == (1 if g < heads else g)


def test_decode_layer_hands_out_what_a_static_layer_holds():
    # Prefill of 3 positions then 4 single steps: the same keys and values as StaticLayer's, heads of a
    # run stored once (the view repeated back), the storage transposed.
    from transformers.cache_utils import StaticLayer

    gen = torch.Generator().manual_seed(0)
    plain, ours = StaticLayer(max_cache_len=10), DecodeLayer(max_cache_len=10, group=2)
    for new in (3, 1, 1, 1, 1):
        k, v = (torch.randn(2, 3, new, 8, generator=gen).repeat_interleave(2, dim=1) for _ in range(2))
        want_k, want_v = plain.update(k, v)
        got_k, got_v = ours.update(k, v)
        torch.testing.assert_close(got_k.repeat_interleave(2, dim=1), want_k, rtol=0, atol=0)
        torch.testing.assert_close(got_v.repeat_interleave(2, dim=1), want_v, rtol=0, atol=0)
    assert ours.keys_t.shape == (2, 3, 8, 10) and got_k.shape == (2, 3, 10, 8)
    assert int(ours.get_seq_length()) == 7 == ours.written


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "olmo2", "cohere", "phi3", "gemma3_text", "falcon"])
def test_a_teacher_expanded_from_gqa_stores_each_head_once_and_decodes_as_transformers(model_type, tmp_path):
    # The converter repeats each K/V head of a GQA model in place (as stories260K-mha8 was made): an MHA
    # teacher whose runs of HEADS / KV heads are identical. Key norms (shared, whole, per head), a fused
    # projection, sliding-window layers (kept in their own cache) and a parallel-attention family.
    gqa = save(random_model(tiny_config(model_type, GQA_TYPES[model_type]), seed=2), tmp_path / "gqa")
    convert(str(gqa), tmp_path / "mha", HEADS, allow_expand=True)
    results = {}
    for name in ("gqa", "mha"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).eval()
        with torch.no_grad():
            head = model.get_output_embeddings().weight
            head.mul_(20.0 / head.norm(dim=-1, keepdim=True).mean())
        full = [type(layer).__name__ == "StaticLayer"
                for layer in StaticCache(config=model.config, max_cache_len=4).layers]
        groups = repeated_kv_groups(model)
        assert groups == [(HEADS // KV if name == "mha" else 1) if f else 1 for f in full], groups
        assert [isinstance(layer, DecodeLayer) for layer in decode_cache(model, 8).layers] == full
        rows = [[1, 5, 9, 33], [1, 17], [1]]
        results[name] = sample_continuations(model, rows, 12, None, 0, 0.0, 1.0, seed=0)
        assert sampling._FILLED.work == {}  # the attention's buffers are not held after the call
        if name == "mha":
            want = [model.generate(input_ids=torch.tensor([r]), attention_mask=torch.ones(1, len(r), dtype=torch.long),
                                   do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0,
                                   eos_token_id=None)[0, len(r):].tolist() for r in rows]
            assert results[name] == want
    assert results["mha"] == results["gqa"]  # the same function, decoded the same


def _paired_heads(model, which: tuple[str, ...]) -> None:
    """Make each odd K/V head a copy of the even one before it, in the projections named in `which` (k_proj,
    v_proj), weights and biases, in every layer: in place, as a conversion or a training step writes weights."""
    with torch.no_grad():
        for layer in model.model.layers:
            for name in which:
                proj = getattr(layer.self_attn, name)
                for t in (proj.weight, proj.bias):
                    if t is not None:
                        heads = t.view(model.config.num_key_value_heads, -1, *t.shape[1:])
                        heads[1::2] = heads[0::2]


def _mha_teacher():
    """A tiny 8-head MHA llama (random weights, biases), its logits scaled far from ties."""
    model = random_model(tiny_config("llama", {**GQA_TYPES["llama"], "num_key_value_heads": HEADS}), seed=4)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(20.0 / head.norm(dim=-1, keepdim=True).mean())
    return model


def _sampled_logits_against_transformers(model, monkeypatch) -> float:
    """The largest gap between the logits the sampler drew from (greedy, 10 new tokens after prompts of three
    lengths, left-padded) and transformers' own forward over each prompt + what was drawn."""
    seen = []
    draw = sampling.sample_next
    monkeypatch.setattr(sampling, "sample_next", lambda logits, *a: (seen.append(logits.clone()), draw(logits, *a))[1])
    rows = [[1, 5, 9, 33, 7], [1, 17], [1, 40, 3]]
    made = sample_continuations(model, rows, 10, None, 0, 0.0, 1.0, seed=0)
    monkeypatch.setattr(sampling, "sample_next", draw)
    gap = 0.0
    with torch.no_grad():
        for r, (prompt, new) in enumerate(zip(rows, made)):
            want = model(torch.tensor([prompt + new])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(new)]
            got = torch.stack([step[r] for step in seen[:len(new)]])
            gap = max(gap, float((got - want).abs().max()))
    return gap


def test_keys_that_repeat_over_values_that_do_not_are_no_group(monkeypatch):
    # K heads in identical pairs, V heads all distinct: a probe of the keys alone would keep one V head of
    # each pair and drop the other (logits off by ~0.4). Both must repeat: no grouping, transformers' logits.
    model = _mha_teacher()
    _paired_heads(model, ("k_proj",))
    assert repeated_kv_groups(model) == [1, 1]
    assert _sampled_logits_against_transformers(model, monkeypatch) < 1e-4
    _paired_heads(model, ("v_proj",))  # now both: pairs stored once, the same logits
    assert repeated_kv_groups(model) == [2, 2]
    assert [layer.group for layer in decode_cache(model, 8).layers] == [2, 2]
    assert _sampled_logits_against_transformers(model, monkeypatch) < 1e-4


def test_a_grouping_follows_the_weights_changed_between_two_calls(monkeypatch):
    # A sampler whose model is trained between calls (a student): the first call's pairs of identical heads
    # are gone after an in-place step, and again after a write through .data (which no version counter sees).
    model = _mha_teacher()
    _paired_heads(model, ("k_proj", "v_proj"))
    assert _sampled_logits_against_transformers(model, monkeypatch) < 1e-4
    assert repeated_kv_groups(model) == [2, 2]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # as an optimizer step: in place, under no_grad
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.add_(torch.randn(layer.self_attn.v_proj.weight.shape, generator=gen) * 0.1)
    assert _sampled_logits_against_transformers(model, monkeypatch) < 1e-4
    assert repeated_kv_groups(model) == [1, 1]
    _paired_heads(model, ("v_proj",))
    assert repeated_kv_groups(model) == [2, 2]
    for layer in model.model.layers:  # through .data: the parameter's version counter does not move
        layer.self_attn.k_proj.weight.data.add_(torch.randn(layer.self_attn.k_proj.weight.shape, generator=gen) * 0.1)
    assert _sampled_logits_against_transformers(model, monkeypatch) < 1e-4
