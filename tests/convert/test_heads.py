"""The pure head math, against the definition of GQA groups in transformers' repeat_kv."""

import pytest
import torch
from transformers.models.llama.modeling_llama import repeat_kv

from uptrain.units import kv_cache_bytes_per_token
from uptrain.convert.math.heads import divisors, merge_qkv, pool_heads, repeat_heads, split_qkv

KV, G, HD, HIDDEN = 4, 3, 5, 7


def strided_mean(w: torch.Tensor, kv: int, g: int) -> torch.Tensor:
    """The classic mistake: head i goes to group i mod kv."""
    return w.view(g, kv, HD, -1).mean(0).reshape(kv * HD, -1)


def test_mean_pool_is_the_mean_over_contiguous_groups():
    w = torch.randn(KV * G * HD, HIDDEN)
    expected = w.view(KV, G, HD, HIDDEN).mean(1).reshape(KV * HD, HIDDEN)
    got = pool_heads(w, KV * G, KV, "mean")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)
    assert not torch.allclose(got, strided_mean(w, KV, G)), "a strided grouping must not pass"


def test_bias_and_per_head_norm_pool_the_same_way():
    b = torch.randn(KV * G * HD)
    torch.testing.assert_close(pool_heads(b, KV * G, KV), b.view(KV, G, HD).mean(1).reshape(-1))
    norm = torch.randn(KV * G, HD)  # Cohere-style [heads, head_dim]
    torch.testing.assert_close(pool_heads(norm, KV * G, KV), norm.view(KV, G, HD).mean(1))


def test_first_keeps_the_first_head_of_each_group():
    w = torch.randn(KV * G * HD, HIDDEN)
    torch.testing.assert_close(pool_heads(w, KV * G, KV, "first"), w.view(KV, G, HD, HIDDEN)[:, 0].reshape(-1, HIDDEN))


def test_pooling_keeps_dtype_and_computes_in_float32():
    w = torch.randn(KV * G * HD, HIDDEN).to(torch.bfloat16)
    got = pool_heads(w, KV * G, KV)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, w.float().view(KV, G, HD, HIDDEN).mean(1).reshape(-1, HIDDEN).bfloat16())


def test_pooling_leaves_its_input_untouched():
    w = torch.randn(KV * G * HD, HIDDEN)
    before = w.clone()
    pool_heads(w, KV * G, KV)
    assert torch.equal(w, before)


def test_pooling_casts_once_to_the_requested_dtype():
    w = torch.randn(KV * G * HD, HIDDEN).to(torch.bfloat16)
    exact = w.float().view(KV, G, HD, HIDDEN).mean(1).reshape(-1, HIDDEN)
    assert not torch.equal(exact, exact.bfloat16().float())
    torch.testing.assert_close(pool_heads(w, KV * G, KV, dtype=torch.float32), exact, rtol=0, atol=0)
    torch.testing.assert_close(pool_heads(w, KV * G, KV, dtype=torch.float16), exact.half(), rtol=0, atol=0)


def test_repeat_heads_matches_transformers_repeat_kv_and_pools_back():
    k = torch.randn(KV * HD, HIDDEN)
    x = torch.randn(HIDDEN)
    # repeat_kv works on activations [batch, kv, seq, hd]: project with the repeated weight instead
    expanded = repeat_heads(k, KV, KV * G)
    acts = (k @ x).view(1, KV, 1, HD)
    torch.testing.assert_close((expanded @ x).view(1, KV * G, 1, HD), repeat_kv(acts, G))
    torch.testing.assert_close(pool_heads(expanded, KV * G, KV), k)


@pytest.mark.parametrize("layout", ["blocks", "grouped"])
def test_split_merge_qkv_round_trip(layout):
    heads, kv = KV * G, KV
    t = torch.randn((heads + 2 * kv) * HD, HIDDEN)
    q, k, v = split_qkv(t, layout, heads, kv, HD)
    assert q.shape == (heads * HD, HIDDEN) and k.shape == v.shape == (kv * HD, HIDDEN)
    torch.testing.assert_close(merge_qkv(q, k, v, layout, HD), t)


def test_grouped_layout_is_falcons():
    heads, kv = 6, 2
    t = torch.arange((heads + 2 * kv) * HD).float()
    q, k, v = split_qkv(t, "grouped", heads, kv, HD)
    # Falcon: view(kv, g + 2, hd): group j holds q heads j*g.., then its k, then its v
    view = t.view(kv, heads // kv + 2, HD)
    torch.testing.assert_close(k.view(kv, HD), view[:, -2])
    torch.testing.assert_close(q.view(kv, heads // kv, HD), view[:, :-2])


def test_sizes():
    assert divisors(20) == [1, 2, 4, 5, 10, 20]
    # Llama-2-7B fp16: 2 x 32 layers x 32 heads x 128 x 2 bytes = 512 KiB per token
    assert kv_cache_bytes_per_token(32, 32, 128, 2) == 512 * 1024
