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
