"""The KV cache as a runtime stores it: quantized when written, dequantized when read, keys after RoPE.

`--kv-cache NAME` (eval, compare, bench, sweep, demo) scores a model with its K and V stored as a
deploy runtime stores them. The formats are data (`FORMATS`): a name, the runtime and flag that give
it, the bits one stored value costs with its block scales counted, and the round trip (quantize then
dequantize) of a tensor `[..., head_dim]`, a pure function of that tensor:

- `model`: the model's own dtype, as saved (no round trip; the default).
- `fp16`, `bf16`: a 16-bit cache, as llama.cpp (`-ctk f16`, its default), vLLM (`--kv-cache-dtype auto`
  on a 16-bit model) and transformers store it for a 16-bit model.
- `fp8` (vLLM `--kv-cache-dtype fp8`, i.e. fp8_e4m3 on CUDA): each value divided by its layer's
  scale, saturated to the format's largest finite value (448) and rounded to float8 e4m3; read back
  times the scale. The scale: vLLM's rule for a checkpoint that carries none and
  `calculate_kv_scales` off (its default) is 1.0 for every layer (vLLM docs, "Quantized KV Cache",
  "No calibration (default scales)"; `BaseKVCacheMethod` in vllm/model_executor/layers/quantization/
  kv_cache.py loads k_scale/v_scale from the checkpoint when present). `fp8_e5m2`: the same with
  float8 e5m2 (largest 57344), which vLLM takes without scales.
- `q8_0`, `q4_0` (llama.cpp `-ctk q8_0 -ctv q8_0` / `q4_0`, `-fa on`: a quantized V cache needs
  flash attention): ggml's block formats. Each row of a head's `head_dim` values in blocks of 32:
  q8_0 stores d = max|x| / 127 as float16 and round(x / d) as int8 (34 bytes per 32 values); q4_0
  takes the value m of largest magnitude, d = m / -8 as float16, and min(15, trunc(x / d + 8.5)) as
  4 bits, read back as (q - 8) * d (18 bytes per 32). ggml's `quantize_row_q8_0_ref` /
  `quantize_row_q4_0_ref` (ggml-quants.c) define them; the scale's reciprocal is taken from the
  float32 d, the read uses the float16 d. llama.cpp refuses a quantized cache whose head_dim is not a
  multiple of the block (llama-context.cpp: "K cache type ... with block size 32 does not divide
  n_embd_head_k"), and so does this module (`check_format`).

What this leaves out, said where the numbers are shown (docs/measure.md): the runtimes' attention
kernels may also round the queries (llama.cpp's CPU flash attention converts Q to the K type's
dot-product type, q8_0 for both q8_0 and q4_0; vLLM's FlashAttention 3 quantizes Q to fp8): only
the cache's storage is emulated here. Against llama.cpp itself (results/kv-cache-parity.md, 28,584
tokens): the loss agrees within 2e-5 (q8_0) and 3e-6 (q4_0) nats/token, the loss change from
quantizing the cache within 3e-6 at q4_0; the query rounding is nearly all of the remaining logit
difference. In llama.cpp an f32 cache with flash attention on is an f16 one (K and V cast to f16).

The cache (`EmulatedKVCache`) is a transformers `DynamicCache` whose `update` rounds the new keys
and values before storing them: every attention layer of a transformers model calls it with its keys
after RoPE, and attends over what it returns, prefill and decode alike (as vLLM and llama.cpp read
their caches for both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from uptrain.errors import UsageError

Q_BLOCK = 32  # values per ggml q8_0 / q4_0 block (QK8_0, QK4_0)


# ---------------------------------------------------------------- round trips: tensors [..., head_dim] in, same shape out


def cast_round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` stored as `dtype` and read back in its own dtype (overflow to inf as the cast does)."""
    return x.to(dtype).to(x.dtype)


def fp8_round_trip(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """vLLM's fp8 cache write and read: x / scale saturated to the format's finite range, rounded to
    `dtype` (float8_e4m3fn or float8_e5m2, round to nearest even), times `scale`, in float32."""
    top = torch.finfo(dtype).max
    stored = (x.float() / scale).clamp(-top, top).to(dtype)
    return (stored.float() * scale).to(x.dtype)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] as float32 blocks [..., head_dim / Q_BLOCK, Q_BLOCK] (head_dim checked before)."""
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // Q_BLOCK, Q_BLOCK)


def q8_0_round_trip(x: torch.Tensor) -> torch.Tensor:
    """ggml q8_0 over blocks of 32 along the last dim: d = amax / 127 (stored float16), q = round(x / d)
    half away from zero (C's roundf), read back as q * float16(d)."""
    b = _blocks(x)  # [..., nb, 32]
    d = b.abs().amax(-1, keepdim=True) / 127  # [..., nb, 1]
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    scaled = b * inv
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # roundf: |q| <= 127
    return (q * d.half().float()).reshape(x.shape).to(x.dtype)


def q4_0_round_trip(x: torch.Tensor) -> torch.Tensor:
    """ggml q4_0 over blocks of 32 along the last dim: m = the value of largest magnitude (the first
    such), d = m / -8 (stored float16), q = min(15, trunc(x / d + 8.5)), read back as (q - 8) * float16(d)."""
    b = _blocks(x)  # [..., nb, 32]
    first = b.abs().argmax(-1, keepdim=True)  # the first largest magnitude, as ggml's strict `<` keeps it
    d = torch.gather(b, -1, first) / -8  # [..., nb, 1]
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc(b * inv + 8.5), max=15)  # (int8_t)(x0 + 8.5f), x0 + 8.5 >= 0.5
    return ((q - 8) * d.half().float()).reshape(x.shape).to(x.dtype)


# ---------------------------------------------------------------- the formats, as data


@dataclass(frozen=True)
class KVFormat:
    """One way a runtime stores K and V: `bits` per value with block scales counted (None: the model's
    dtype), `block` values a head's row is cut into (None: no blocks), `round_trip` of a tensor
    [..., head_dim] (None: stored as computed), and what to type at deploy time."""

    name: str
    bits: float | None
    block: int | None
    round_trip: Callable[[torch.Tensor], torch.Tensor] | None
    deploy: str

    def bytes_per_element(self, model_dtype: torch.dtype) -> float:
        """Bytes one stored value costs, its share of the block's scale included."""
        return model_dtype.itemsize if self.bits is None else self.bits / 8


FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("model", None, None, None, "the runtime's default for the model's dtype"),
    KVFormat("fp16", 16, None, lambda x: cast_round_trip(x, torch.float16), "llama.cpp: -ctk f16 -ctv f16 (its "
             "default); vLLM: --dtype float16; transformers: torch_dtype=torch.float16"),
    KVFormat("bf16", 16, None, lambda x: cast_round_trip(x, torch.bfloat16), "llama.cpp: -ctk bf16 -ctv bf16; "
             "vLLM: --dtype bfloat16; transformers: torch_dtype=torch.bfloat16"),
    KVFormat("fp8", 8, None, lambda x: fp8_round_trip(x, torch.float8_e4m3fn), "vLLM: --kv-cache-dtype fp8 "
             "(fp8_e4m3, scale 1.0 unless the checkpoint carries k_scale/v_scale)"),
    KVFormat("fp8_e5m2", 8, None, lambda x: fp8_round_trip(x, torch.float8_e5m2), "vLLM: --kv-cache-dtype fp8_e5m2"),
    KVFormat("q8_0", 8.5, Q_BLOCK, q8_0_round_trip, "llama.cpp: -ctk q8_0 -ctv q8_0 -fa on"),
    KVFormat("q4_0", 4.5, Q_BLOCK, q4_0_round_trip, "llama.cpp: -ctk q4_0 -ctv q4_0 -fa on"),
)}
DEFAULT = "model"


def kv_format(name: str) -> KVFormat:
    """The format called `name`; a one-line UsageError listing the names otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise UsageError(f"--kv-cache {name!r} is not a cache format; use one of {', '.join(FORMATS)}") from None


def kv_formats(spec: str) -> list[KVFormat]:
    """A comma list of names ('fp8,q8_0'), each once, in the order given."""
    names = [part.strip() for part in spec.split(",") if part.strip()]
    if not names:
        raise UsageError(f"--kv-cache takes names like fp8,q8_0 (of {', '.join(FORMATS)}), got {spec!r}")
    return [kv_format(n) for n in dict.fromkeys(names)]


def check_format(fmt: KVFormat, head_dim: int, model: str) -> None:
    """Refuse (one line) a block format whose block does not divide the model's head_dim, as llama.cpp does."""
    if fmt.block is not None and head_dim % fmt.block:
        raise UsageError(f"--kv-cache {fmt.name}: {model} has head_dim {head_dim}, not a multiple of the "
                         f"{fmt.block}-value block llama.cpp stores {fmt.name} in (llama.cpp refuses this cache "
                         f"for it); choose fp16, bf16 or fp8")


def why_not(fmt: KVFormat, head_dim: int) -> str | None:
    """`check_format`'s reason as a string (None: the model can take the format)."""
    try:
        check_format(fmt, head_dim, "the model")
    except UsageError as err:
        return str(err).split(": ", 1)[1]
    return None


def bytes_per_token(fmt: KVFormat, layers: int, kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> float:
    """KV bytes one token costs in this format: 2 x layers x kv_heads x head_dim x bytes per value,
    block scales counted (per-layer scalar scales, as fp8's, are a few bytes per model, not per token)."""
    from uptrain.units import kv_cache_bytes_per_token

    return kv_cache_bytes_per_token(layers, kv_heads, head_dim, fmt.bytes_per_element(model_dtype))


# ---------------------------------------------------------------- the cache transformers calls


def _cache_class():
    from transformers import DynamicCache

    class EmulatedKVCache(DynamicCache):
        """A DynamicCache storing each layer's new keys (after RoPE) and values [batch, kv_heads, seq,
        head_dim] as `fmt` stores them: the attention reads back the rounded values, prefill and decode."""

        def __init__(self, fmt: KVFormat, config=None):
            super().__init__(config=config)
            self.fmt = fmt

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            rt = self.fmt.round_trip
            return super().update(rt(key_states), rt(value_states), layer_idx, *args, **kwargs)

    return EmulatedKVCache


def new_cache(fmt: KVFormat | None, config=None):
    """A fresh emulating cache for one forward or one decode (None for the `model` format: no cache)."""
    if fmt is None or fmt.round_trip is None:
        return None
    return _cache_class()(fmt, config)


def active(fmt: KVFormat | None) -> KVFormat | None:
    """`fmt` when it changes the stored values, else None (the model's own dtype: nothing to emulate)."""
    return None if fmt is None or fmt.round_trip is None else fmt


def model_bytes_per_token(fmt: KVFormat, model: torch.nn.Module) -> float:
    """`bytes_per_token` of a loaded model: its config's shape, its weights' dtype for `model`."""
    from uptrain.convert.io.hfconfig import model_shape

    shape = model_shape(model.config.get_text_config())
    return bytes_per_token(fmt, shape.layers, shape.kv_heads, shape.head_dim, model.dtype)


def check_paths(fmt: KVFormat, paths) -> None:
    """`check_format` for every model folder of `paths`, from its config alone (before any weights load)."""
    if fmt.block is None:
        return
    from transformers import AutoConfig

    from uptrain.convert.io.hfconfig import model_shape

    for path in paths:
        check_format(fmt, model_shape(AutoConfig.from_pretrained(path).get_text_config()).head_dim, str(path))


def add_kv_cache_arg(parser, several: bool = False) -> None:
    """`--kv-cache NAME` (`several`: a comma list, the sweep's)."""
    names = ", ".join(FORMATS)
    parser.add_argument("--kv-cache", default=None if several else DEFAULT, metavar="NAMES" if several else "NAME",
                        help=(f"also score every model with its K/V cache stored in these formats, a comma list "
                              f"of {names} (the model's own dtype is always scored)" if several else
                              f"the K/V cache stored as a runtime stores it: {names} (default {DEFAULT}: the "
                              f"model's own dtype); docs/measure.md says which runtime flag each is"))
