"""Sampling continuations from a causal LM at the speed of the hardware (the teacher's own text).

`transformers`' `generate` spends most of a small model's decoding step on bookkeeping: a dynamic
KV cache that is copied whole at every step, a full sort of the vocabulary for top-p, and a
per-step logits-processor chain. Here instead:

- a static KV cache allocated once for prompt + new tokens (`decode_cache`: keys stored transposed
  for a one-query product, each run of identical K/V heads stored once), read only up to the
  positions written so far (`decode_attention`: one query token against the cache's filled part,
  two matmuls where CPU SDPA kernels are slow for a single query);
- top-p over the `TOP_K` most likely tokens (`top_p_candidates`): a partial sort, with the full sort
  only for rows whose top-`TOP_K` mass falls short of `top_p`; the sampled distribution is the same;
- one generator seeded per call: the same seed gives the same tokens.

A model whose attention is not SDPA (eager for soft-capping, say) keeps its own attention function.

Rows may have prompts of different lengths (left-padded); a row stops at its first EOS and the
call ends when every row has stopped or `max_new_tokens` are made (with no EOS, as for a tokenizer
with a BOS only: `max_new_tokens` in every row). Prompt + new tokens must fit the model's
max_position_embeddings (refused otherwise: the caller caps, `teacher_samples.new_tokens_cap`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import torch
from transformers import AttentionInterface, StaticCache
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from uptrain.errors import UsageError
from uptrain.train.model.decode_cache import decode_cache

TOP_K = 64  # candidates kept for top-p before falling back to a full sort (most rows need far fewer)
ATTENTION = "uptrain_decode"  # the attention implementation name decode_attention is registered under


class _Filled(threading.local):
    """Positions of the static cache written so far (None outside `sample_continuations`), and
    whether any row is left-padded (if none, every filled position is attended: no mask needed)."""
    length: int | None = None
    padded: bool = True  # (also True where a layer has a sliding window: its masks are always built)

    def __init__(self):
        self.work: dict[str, torch.Tensor] = {}  # the attention's scratch buffers (`_work`), per call


_FILLED = _Filled()


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs):
    """Attention of one new token against the filled part of a static cache; else transformers' SDPA.

    query (B, H, 1, D); key, value (B, Hkv, T, D) with H a multiple of Hkv; attention_mask None, bool
    (B, 1, 1, T) (True: attend) or additive float. Returns (output (B, 1, H, D), None), as SDPA does.
    Layers with a sliding window, soft-capping or attention sinks go to SDPA unchanged."""
    n = _FILLED.length
    special = getattr(module, "sliding_window", None) or kwargs.get("sliding_window") or kwargs.get("softcap") \
        or kwargs.get("s_aux") is not None
    if n is None or query.shape[2] != 1 or special or kwargs.get("dropout", 0.0):
        key, value = _all_kv_heads(module, query, key), _all_kv_heads(module, query, value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim) * (scaling if scaling is not None else dim ** -0.5)
    shape = (batch, kv_heads, heads // kv_heads, n)
    room = math.prod(shape[:3]) * key.shape[2]  # the buffers' size at the cache's last position
    # keys: a DecodeLayer's transposed storage, so this is (g x D) @ (D x n) over contiguous rows
    scores = torch.matmul(q, key[:, :, :n].transpose(-1, -2), out=_work("scores", shape, q, room))
    if attention_mask is not None and _FILLED.padded:
        mask = attention_mask[..., :n].reshape(batch, 1, 1, n)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.ops.aten._softmax.out(scores, -1, False, out=_work("probs", shape, q, room))
    out = torch.matmul(probs, value[:, :, :n])
    return out.reshape(batch, 1, heads, dim), None


def _work(name: str, shape: tuple[int, ...], like: torch.Tensor, room: int) -> torch.Tensor:
    """A tensor of `shape` over a buffer kept for the whole `sample_continuations` call (`room`
    elements, more if short): the attention's (B, Hkv, g, n) scores and probabilities, n growing by one
    a step. Fresh tensors of that size at every step cost a CPU a fifth of its time in page faults
    (the allocator hands such blocks back to the system and faults them in again: 2.4 M faults for
    262,144 tokens of stories260K, 0.25 M with these buffers)."""
    work, numel = _FILLED.work, math.prod(shape)
    buffer = work.get(name)
    if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype:
        buffer = work[name] = like.new_empty(max(numel, room))
    return buffer[:numel].view(shape)


def _all_kv_heads(module: torch.nn.Module, query: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """`states` (B, h, T, D) with the K/V heads the module's config names: a DecodeLayer keeps one of
    each run of identical heads, SDPA (which repeats by the module's group count) wants them all."""
    want = query.shape[1] // getattr(module, "num_key_value_groups", 1)
    return repeat_kv(states, want // states.shape[1])  # (the same repeat SDPA applies per group)


AttentionInterface.register(ATTENTION, decode_attention)


def decode_mask(*args, **kwargs) -> torch.Tensor | None:
    """SDPA's mask, or None where no row is padded and no layer has a sliding window: the prefill is then
    plainly causal from position 0 (SDPA's is_causal) and a decoding step attends every filled position."""
    return sdpa_mask(*args, **kwargs) if _FILLED.padded else None


ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, decode_mask)


def top_p_candidates(probs: torch.Tensor, top_p: float, k: int = TOP_K) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p ("nucleus") distribution of each row of `probs` (B, V): (weights (B, C), token ids
    (B, C)), C = min(k, V) unless a row needs more. Weights are the kept tokens' probabilities (not
    renormalised), zero where a token is cut: a token is kept when the mass of the tokens more likely
    than it is below `top_p` (the smallest set reaching `top_p`, as transformers' TopPLogitsWarper)."""
    vocab = probs.shape[-1]
    weights, ids = probs.topk(min(k, vocab), dim=-1)
    if k < vocab:
        short = weights.sum(-1) < top_p
        if bool(short.any()):  # those rows need more than k candidates: sort all of the vocabulary
            weights, ids = probs.sort(-1, descending=True)
    before = weights.cumsum(-1) - weights
    return weights.masked_fill(before >= top_p, 0.0), ids


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `logits` (B, V), sampled at `temperature` from the top-p nucleus: (B,) ids.
    Temperature 0: the most likely token (greedy).

    By the inverse of each row's cumulative distribution at one uniform draw per row: a row's token
    depends on its own logits and its draw alone (not on the other rows, nor on whether its nucleus
    came from the top-k or the full sort: both list candidates most likely first)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    weights, ids = top_p_candidates(probs, top_p) if top_p < 1.0 else (probs, None)
    cumulative = weights.cumsum(-1)
    draw = torch.rand(weights.shape[0], 1, generator=generator, device=weights.device) * cumulative[:, -1:]
    pick = (cumulative <= draw).sum(-1, keepdim=True).clamp(max=weights.shape[-1] - 1)
    return (pick if ids is None else ids.gather(-1, pick)).squeeze(-1)


@torch.no_grad()
def sample_continuations(model: torch.nn.Module, rows: list[list[int]], max_new_tokens: int, eos: int | None,
                         pad: int | None, temperature: float, top_p: float, seed: int,
                         on_step: Callable[[int], None] | None = None) -> list[list[int]]:
    """Sample up to `max_new_tokens` tokens after each prompt in `rows` (token ids, at least one each).

    Returns each row's new tokens, up to and with its first `eos`; with `eos` None (a tokenizer without
    EOS) nothing ends a row but `max_new_tokens`. `pad` fills the left of shorter prompts (masked out;
    None: id 0). `on_step(new tokens made so far in all rows)` is called after each step (for progress
    lines). Seeded by `seed` alone: the same call gives the same tokens. Refused (UsageError) where the
    longest prompt + `max_new_tokens` exceed the model's max_position_embeddings."""
    device = next(model.parameters()).device
    width = max(len(r) for r in rows)
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if context and width + max_new_tokens > context:  # positions it was never trained on: cap, do not extrapolate
        raise UsageError(f"a prompt of {width} tokens + {max_new_tokens} new tokens needs {width + max_new_tokens} "
                         f"positions; the model has {context} (max_position_embeddings): ask for at most "
                         f"{max(context - width, 0)} new tokens")
    pad = 0 if pad is None else pad
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    total = width + max_new_tokens
    cache = decode_cache(model, total) if model.config._attn_implementation == "sdpa" else \
        StaticCache(config=model.config, max_cache_len=total)
    generator = torch.Generator(device=device).manual_seed(seed)
    before = model.config._attn_implementation
    if before == "sdpa":  # others (eager for soft-capping, flash kernels) keep their own attention
        model.set_attn_implementation(ATTENTION)
    made = torch.full((len(rows), max_new_tokens), pad, dtype=torch.long, device=device)
    done = torch.zeros(len(rows), dtype=torch.bool, device=device)
    full_mask = torch.cat([mask, torch.ones(len(rows), max_new_tokens, dtype=mask.dtype, device=device)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    try:
        windowed = getattr(model.config.get_text_config(), "sliding_window", None) or \
            any(t != "full_attention" for t in getattr(model.config.get_text_config(), "layer_types", None) or [])
        _FILLED.length, _FILLED.padded = width, bool((mask == 0).any()) or bool(windowed)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                       cache_position=torch.arange(width, device=device), use_cache=True).logits[:, -1]
        for step in range(max_new_tokens):
            token = sample_next(logits, temperature, top_p, generator)
            token = torch.where(done, torch.full_like(token, pad), token)
            made[:, step] = token
            if eos is not None:
                done |= token == eos
            if on_step is not None:
                on_step((step + 1) * len(rows))
            if bool(done.all()) or step + 1 == max_new_tokens:
                break
            _FILLED.length = width + step + 1
            logits = model(input_ids=token[:, None], attention_mask=full_mask[:, :width + step + 1],
                           position_ids=positions[:, -1:] + step + 1, cache=cache,
                           cache_position=torch.tensor([width + step], device=device), use_cache=True).logits[:, -1]
    finally:
        _FILLED.length, _FILLED.work = None, {}
        if model.config._attn_implementation != before:
            model.set_attn_implementation(before)
    out = []
    for row in made[:, :step + 1].tolist():
        out.append(row[:row.index(eos) + 1] if eos is not None and eos in row else row)
    return out


def timed_progress(write: Callable[[str], None], total: int, every_s: float, done_before: int = 0,
                   clock: Callable[[], float] = time.monotonic) -> Callable[[int], None]:
    """A progress callback over `total` tokens: `report(made so far)` writes "N of TOTAL tokens (P%),
    R tokens/s, ~S s left" when `every_s` seconds have passed since the last line (and never
    otherwise). `done_before`: tokens already there (read from kept chunks), not counted in the rate."""
    start, last = clock(), [clock()]

    def report(made: int) -> None:
        now = clock()
        if now - last[0] < every_s:
            return
        last[0] = now
        rate = made / max(now - start, 1e-9)
        so_far = done_before + made
        left = max(total - so_far, 0) / max(rate, 1e-9)
        write(f"teacher samples: {min(so_far, total):,} of {total:,} tokens ({min(so_far / total, 1):.0%}), "
              f"{rate:,.0f} tokens/s, ~{left:.0f} s left")
    return report
