"""Training attention by hand in bfloat16, for small heads on a CPU (config `bf16_attention`).

At head_dim 8 torch's CPU flash-attention kernel runs its tiny products far below the machine's rate:
attention is 37% of a 128-token distillation step on the bundled model and most of a 512-token one.
The same causal attention written as two grouped products (each K/V head's query group in one
matrix) in bfloat16, softmax between, the queries in chunks that never compute the future, is 2.2x
(128 tokens) and 3x (512) faster than float32 SDPA on a CPU with AVX-512 BF16, and in the trainer
22-27% more tokens/s at 128 tokens, 2x at 512 (results/quality-curve.md, round two, eighth part), for
errors of bfloat16's size (a few 1e-4 nats of held-out loss there). The demo turns it on where
`suits_this_machine`.

Only the training shape goes this way: causal, no mask (packed blocks, no padding), queries as long
as keys, no dropout. Anything else (a padding mask, one-query decoding, dropout) is SDPA's, as before.
The model's saved config does not name it: a model trained with it loads as any other.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "uptrain_bf16"
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 instructions that multiply bfloat16 in hardware


_BLOCK_MASKS: dict = {}


def _diagonal_mask(chunk: int, group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive causal mask of one query chunk against its own keys, [chunk * group, chunk]: row r is
    time step r // group (rows ordered time-major, each step's `group` query heads together), -inf on its
    future. Made once per shape and kept."""
    key = (chunk, group, dtype, device)
    if key not in _BLOCK_MASKS:
        future = torch.full((chunk, chunk), float("-inf"), dtype=dtype, device=device).triu(1)
        _BLOCK_MASKS[key] = future.repeat_interleave(group, dim=0)
    return _BLOCK_MASKS[key]


def query_chunk(t: int) -> int:
    """Time steps per query chunk: 64 for short blocks, 128 from 256 on (fastest measured on the bundled model's
    128- and 512-token blocks; results/quality-curve.md, round two, eighth part)."""
    return 64 if t < 256 else 128


def grouped_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                             dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Causal softmax(q k^T * scale) v with the products in `dtype`: query [B, H, T, D], key and value
    [B, KV, T, D] (H a multiple of KV; query head h reads K/V head h // (H / KV), as transformers'
    repeat_kv) -> [B, H, T, D] in query's dtype (a transposed view of a [B, T, H, D] tensor).

    Each K/V head's queries are one matrix, rows time-major; the queries go in chunks of `query_chunk(T)` time
    steps, each against the keys up to its own end: the future beyond a chunk is never computed (about half of
    the T x T work), the mask touches only the chunk's diagonal block, and a chunk's scores stay in cache."""
    b, h, t, d = query.shape
    kv = key.size(1)
    group = h // kv
    q = query.transpose(1, 2).reshape(b, t, kv, group, d).permute(0, 2, 1, 3, 4).to(dtype)
    q = q.reshape(b, kv, t * group, d)  # row s * group + j: time s, query head kv_index * group + j
    k, v = (key * scale).to(dtype), value.to(dtype)
    step = query_chunk(t)
    outs = []
    for start in range(0, t, step):
        end = min(start + step, t)
        scores = torch.matmul(q[:, :, start * group:end * group], k[:, :, :end].transpose(-1, -2))
        scores[..., start:end] += _diagonal_mask(end - start, group, dtype, query.device)
        outs.append(torch.matmul(torch.softmax(scores, dim=-1), v[:, :, :end]))
    out = torch.cat(outs, dim=2).view(b, kv, t, group, d).permute(0, 2, 1, 3, 4).reshape(b, t, h, d)
    return out.to(query.dtype).transpose(1, 2)


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


def cpu_multiplies_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU multiplies bfloat16 in hardware: one of `BF16_CPU_FLAGS` among the `flags` of `cpuinfo`
    (the text of /proc/cpuinfo; None: read it, False where there is none, as on macOS or Windows)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.partition(":")[2].split()}
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def cpu_run() -> bool:
    """Whether a run here trains on the CPU: no CUDA device (the trainer's rule, `setup.make_accelerator`; the
    demo's CPU-only choices, `suits_this_machine` and `demo.steps.one_micro_batch`, ask the same)."""
    return not torch.cuda.is_available()


def suits_this_machine() -> bool:
    """`bf16_attention`'s automatic choice (the demo's): a run on the CPU (`cpu_run`) of a CPU that multiplies
    bfloat16 in hardware. Elsewhere unmeasured (without those instructions bfloat16 is emulated)."""
    return cpu_run() and cpu_multiplies_bf16()
