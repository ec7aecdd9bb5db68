"""The KV cache the teacher-sample decoder reads (uptrain.train.model.sampling): laid out for one query.

Decoding one token reads every cached key and value of its row, at every step; on a CPU that read is
most of a small teacher's step. Profiled on stories260K (head_dim 8, batch 256): the einsum of one
query against keys stored (B, H, T, D) ran at ~6 GB/s where a plain sum over the same tensor runs at
~18 GB/s; a (1 x D) @ (D x T) product over keys stored transposed, (B, H, D, T), runs 1.6x faster.
So `DecodeLayer` stores keys transposed and hands them out as a (B, H, T, D) *view*: every reader
(transformers' SDPA for the prefill, the fallbacks) sees the usual layout, and `decode_attention`
multiplies by the transposed storage directly.

It also stores each group of identical K/V heads once. A teacher expanded from GQA to MHA by
repeating heads (the embedded stories260K-mha8: 8 K/V heads, 4 distinct) computes every repeated
head's keys and values twice; `repeated_kv_groups` finds, per layer, the largest g such that heads
come in adjacent runs of g bit-identical keys and values (query head h reads K/V head h // (H / Hkv),
so a run of g serves its queries as one GQA head); the layer then keeps heads 0, g, 2g, ... and the
attention reads half (or less) of the cache. The result is the same computation on the same numbers.
"""

from __future__ import annotations

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

PROBE_TOKENS = 32  # random tokens whose keys and values show which heads repeat


class DecodeLayer(StaticLayer):
    """A full-attention static cache layer: keys stored (B, h, D, T), values (B, h, T, D), with
    h = K/V heads / `group` (the first head of each run of `group` identical ones). `update` returns
    (keys (B, h, T, D) as a view of the transposed storage, values (B, h, T, D)), all `max_cache_len`
    positions (the unwritten ones zero), as StaticLayer does."""

    def __init__(self, max_cache_len: int, group: int = 1):
        super().__init__(max_cache_len=max_cache_len)
        self.group = group
        self.written = 0  # positions filled so far (a python int: no tensor read per step)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, self.num_heads = key_states.shape[0], key_states.shape[1] // self.group
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.keys_t = key_states.new_zeros(self.batch_size, self.num_heads, self.k_head_dim, self.max_cache_len)
        self.values = value_states.new_zeros(self.batch_size, self.num_heads, self.max_cache_len, self.v_head_dim)
        self.keys = self.keys_t.transpose(-1, -2)
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states (B, Hkv, L, D): written at the next L positions."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new, at = key_states.shape[-2], self.written
        if self.group > 1:
            key_states, value_states = key_states[:, ::self.group], value_states[:, ::self.group]
        self.keys_t[..., at:at + new] = key_states.transpose(-1, -2)
        self.values[:, :, at:at + new] = value_states
        self.written += new
        self.cumulative_length.add_(new)
        return self.keys, self.values


def run_group(keys: torch.Tensor, values: torch.Tensor) -> int:
    """The largest g dividing the head count such that keys and values (B, Hkv, T, D) come in adjacent
    runs of g bit-identical heads (1: none repeat)."""
    heads = keys.shape[1]
    for g in range(heads, 1, -1):
        if heads % g == 0 and all(torch.equal(t, t[:, ::g].repeat_interleave(g, dim=1)) for t in (keys, values)):
            return g
    return 1


@torch.no_grad()
def repeated_kv_groups(model: torch.nn.Module) -> list[int]:
    """Per decoder layer, the run length of identical K/V heads (`run_group`) on the keys and values of
    PROBE_TOKENS random tokens (seeded): heads that differ in their weights do not give bit-identical
    keys and values on them; both must repeat (K heads repeated over distinct V heads are no GQA head).

    Probed at every call, not kept per model: a sampler whose model is trained between calls (a
    student) must not read a grouping of its old weights. A key of the parameters' data pointers and
    version counters would miss writes through `.data` (which bypass the counter); the probe is one
    forward of PROBE_TOKENS tokens on one row: on stories260K, one CPU thread, 3.4 ms against 0.91 s
    for a call of 64 rows x 256 new tokens (0.4%)."""
    config = model.config.get_text_config()
    device = next(model.parameters()).device
    tokens = torch.randint(0, config.vocab_size, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    cache = StaticCache(config=model.config, max_cache_len=PROBE_TOKENS)
    model(input_ids=tokens.to(device), cache=cache, use_cache=True)
    return [run_group(layer.keys, layer.values) if type(layer) is StaticLayer else 1 for layer in cache.layers]


def decode_cache(model: torch.nn.Module, max_cache_len: int) -> StaticCache:
    """A StaticCache for `model` whose full-attention layers are `DecodeLayer`s (sliding-window layers
    keep their own), each storing one of every run of identical K/V heads."""
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    groups = repeated_kv_groups(model)
    for i, layer in enumerate(cache.layers):
        if type(layer) is StaticLayer:
            cache.layers[i] = DecodeLayer(max_cache_len, groups[i] if i < len(groups) else 1)
    return cache
