"""Pure tensor math for changing the number of K/V heads. No paths, no configs: tensors and ints.

Head order follows transformers' `repeat_kv`: K/V head j serves query heads j*g ... (j+1)*g - 1,
so a GQA group is a run of g *contiguous* heads. Every function here keeps that order.

A "head-major" tensor has its first dimension made of `heads` equal blocks, one per head:
a k_proj weight [heads * head_dim, hidden], a bias [heads * head_dim], a per-head norm
weight [heads, head_dim] (block of 1 row) or an OLMo-2 k_norm weight [heads * head_dim].
"""

from __future__ import annotations

import torch

from uptrain.convert.registry.choices import METHODS, Method, QKVLayout  # noqa: F401 (re-exported)


def _group_view(t: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """[heads * u, *rest] -> [groups, heads // groups, u, *rest] (contiguous groups)."""
    if heads % groups or t.shape[0] % heads:
        raise ValueError(f"cannot split {t.shape[0]} rows into {heads} heads in {groups} groups")
    return t.reshape(groups, heads // groups, t.shape[0] // heads, *t.shape[1:])


def pool_heads(t: torch.Tensor, heads: int, groups: int, method: Method = "mean",
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Merge each run of heads // groups contiguous heads into one head.

    t: [heads * u, *rest] -> [groups * u, *rest] in `dtype` (default: t's dtype). "mean" (the
    paper's method) adds the g = heads // groups heads of every group into a float32 accumulator
    [groups, u, *rest] (the output's size, not a float32 copy of the whole input), one head
    position at a time (g whole-tensor operations, so few thread synchronisations), and casts
    the means once, straight to `dtype`: no intermediate rounding to t's dtype. "first" keeps
    the group's first head. ("random" is not a pooling: see `random_heads`.)
    """
    grouped = _group_view(t, heads, groups)
    out_dtype = dtype or t.dtype
    if method == "first":
        merged = grouped[:, 0].to(out_dtype)
    elif method == "mean":
        g = grouped.shape[1]
        acc = grouped[:, 0].to(torch.float32, copy=True)
        for j in range(1, g):
            acc.add_(grouped[:, j])
        merged = acc.div_(g).to(out_dtype)
    else:
        raise ValueError(f"pool_heads takes 'mean' or 'first', not {method!r}")
    return merged.reshape(groups * grouped.shape[2], *t.shape[1:]).contiguous()


def repeat_heads(t: torch.Tensor, heads: int, new_heads: int) -> torch.Tensor:
    """Inverse of mean pooling on duplicated heads: repeat each head in place, as repeat_kv does.

    t: [heads * u, *rest] -> [new_heads * u, *rest], new_heads a multiple of heads.
    Turning a GQA checkpoint into the MHA checkpoint with the same function.
    """
    if new_heads % heads:
        raise ValueError(f"{new_heads} heads is not a multiple of {heads}")
    blocks = t.reshape(heads, 1, t.shape[0] // heads, *t.shape[1:])
    repeated = blocks.expand(heads, new_heads // heads, *blocks.shape[2:])
    return repeated.reshape(new_heads * blocks.shape[2], *t.shape[1:]).contiguous()


def random_heads(shape: tuple[int, ...], dtype: torch.dtype, std: float, generator: torch.Generator,
                 is_bias: bool) -> torch.Tensor:
    """A fresh K/V projection tensor for the paper's random-init ablation: N(0, std) weights, zero biases."""
    if is_bias:
        return torch.zeros(shape, dtype=dtype)
    return (torch.randn(shape, generator=generator, dtype=torch.float32) * std).to(dtype)


def split_qkv(t: torch.Tensor, layout: QKVLayout, heads: int, kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused QKV weight or bias into q [heads*hd, *rest], k and v [kv_heads*hd, *rest].

    layout "blocks": rows are [q | k | v] (Phi-3 qkv_proj, GPTBigCode/Falcon multi-query).
    layout "grouped": rows are kv_heads groups of (g q heads, 1 k head, 1 v head), each head
    head_dim rows (Falcon new_decoder_architecture; with kv_heads == heads this is the per-head
    (q, k, v) interleave of legacy Falcon and GPTBigCode MHA).
    """
    rest = t.shape[1:]
    if t.shape[0] != (heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"fused QKV has {t.shape[0]} rows, expected ({heads} + 2 x {kv_heads}) x {head_dim}")
    if layout == "blocks":
        q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
        return q, k, v
    g = heads // kv_heads
    grouped = t.reshape(kv_heads, g + 2, head_dim, *rest)
    q = grouped[:, :g].reshape(heads * head_dim, *rest)
    k = grouped[:, g].reshape(kv_heads * head_dim, *rest)
    v = grouped[:, g + 1].reshape(kv_heads * head_dim, *rest)
    return q, k, v


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: QKVLayout, head_dim: int
              ) -> torch.Tensor:
    """Inverse of `split_qkv`: q [heads*hd, *rest], k and v [kv_heads*hd, *rest] -> fused rows."""
    if layout == "blocks":
        return torch.cat([q, k, v]).contiguous()
    rest = q.shape[1:]
    kv_heads = k.shape[0] // head_dim
    g = q.shape[0] // head_dim // kv_heads
    parts = [q.reshape(kv_heads, g, head_dim, *rest), k.reshape(kv_heads, 1, head_dim, *rest),
             v.reshape(kv_heads, 1, head_dim, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest).contiguous()


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending: the valid K/V head counts for n heads."""
    return [d for d in range(1, n + 1) if n % d == 0]
