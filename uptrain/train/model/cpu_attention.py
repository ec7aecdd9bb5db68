"""Training attention by hand in bfloat16, for small heads on a CPU (config `bf16_attention`).

At head_dim 8 torch's CPU flash-attention kernel runs its tiny products far below the machine's rate:
attention is 37% of a 128-token distillation step on the bundled model and most of a 512-token one.
The same causal attention written as two grouped products (each K/V head's query group in one
matrix) in bfloat16, softmax between, is 2.6-2.8x faster on a CPU with AVX-512 BF16, and in the
trainer 20-24% more tokens/s at 128 tokens, 36% less CPU at 512 (results/quality-curve.md, round two,
seventh part), for errors of bfloat16's size (a few 1e-4 nats of held-out loss there).

Only the training shape goes this way: causal, no mask (packed blocks, no padding), queries as long
as keys, no dropout. Anything else (a padding mask, one-query decoding, dropout) is SDPA's, as before.
The model's saved config does not name it: a model trained with it loads as any other.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "uptrain_bf16"


def grouped_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                             dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Causal softmax(q k^T * scale) v with the products in `dtype`: query [B, H, T, D], key and value
    [B, KV, T, D] (H a multiple of KV; query head h reads K/V head h // (H / KV), as transformers'
    repeat_kv) -> [B, H, T, D] in query's dtype."""
    b, h, t, d = query.shape
    kv = key.size(1)
    group = h // kv
    q = (query * scale).to(dtype).reshape(b, kv, group * t, d)  # each K/V head's queries as one matrix
    scores = torch.matmul(q, key.to(dtype).transpose(-1, -2)).view(b, kv, group, t, t)
    future = torch.ones(t, t, dtype=torch.bool, device=query.device).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1).view(b, kv, group * t, t)
    return torch.matmul(probs, value.to(dtype)).view(b, h, t, d).to(query.dtype)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ([B, T, H, D], None). The training shape by hand in bfloat16
    (`grouped_causal_attention`), any other call SDPA's."""
    t = query.size(2)
    if attention_mask is not None or key.size(2) != t or dropout or t == 1 or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = query.size(-1) ** -0.5 if scaling is None else scaling
    out = grouped_causal_attention(query, key, value, scale)
    return out.transpose(1, 2).contiguous(), None


def use_bf16_attention(model: torch.nn.Module) -> None:
    """Route `model`'s attention through `attention_forward` (its masks made as for SDPA, so packed
    causal blocks get none)."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
