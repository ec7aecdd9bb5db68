"""`uptrain.bench --runtime llama.cpp`: decode speed and memory of GGUF models in llama.cpp.

    python -m uptrain.bench MODEL... --runtime llama.cpp [--context 128 512 1024 2048]
        [--new-tokens 16] [--repeats 3] [--llama-cpp DIR --outtype f16] [--kv-cache NAME] [--json PATH] [--plot DIR]

MODEL is a .gguf file, or a Hugging Face folder converted on the fly (into a temporary folder,
with llama.cpp's convert_hf_to_gguf.py from --llama-cpp DIR). One context of the largest size
asked is allocated per model; the cache is filled once, growing: at each context length L (in
increasing order) the prompt is extended to L random tokens (prefill, untimed), then `new_tokens`
tokens are decoded one by one, greedily (argmax of the logits, no sampler), and timed; each repeat
drops the decoded tokens again (llama.cpp removes them from its cache), so every repeat decodes
from the same L cached tokens. Memory: the KV cache llama.cpp allocates (its own log line, for
the whole context, as llama.cpp preallocates it) beside the formula 2 x layers x kv_heads x
head_dim x bytes per cell, and this process's resident memory after decoding at each L.

`--kv-cache NAME` (uptrain.measure.kv_cache's names): the cache is allocated in that ggml type
(`LLAMA_KV_TYPES`: model -> f16, llama.cpp's default; fp16 -> f16, bf16, q8_0, q4_0), with flash
attention on for the quantized ones (llama.cpp refuses a quantized V cache without it) and off
otherwise, as before; fp8 is vLLM's and refused. The bytes are llama.cpp's own log line, as always,
beside `kv_bytes_per_token`, the type's formula with its block scales (q8_0: 34 bytes per 32 values).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from uptrain.errors import UsageError
from uptrain.measure import gguf
from uptrain.measure.kv_cache import DEFAULT, check_paths, kv_format
from uptrain.threads import CpuMonitor, applied, busy_note, machine_cpus
from uptrain.units import kv_cache_bytes_per_token

TYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}  # bytes per element of a KV cache type
# --kv-cache NAME -> the ggml type llama.cpp's K and V caches are allocated in (model: its default)
LLAMA_KV_TYPES = {DEFAULT: "f16", "fp16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q4_0"}
NEEDS_FLASH_ATTN = {"q8_0", "q4_0"}  # llama-context.cpp: "V cache quantization requires flash_attn"


@dataclass
class LlamaDecode:
    """Greedy single-token decode after `context` cached tokens (tokens/s over `repeats`)."""

    context: int
    new_tokens: int
    tokens_per_s: list[float]
    rss_bytes: int
    kv_bytes_at_context: int  # llama.cpp's bytes per cell x context: what the filled part holds
    note: str | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_s)


@dataclass
class LlamaBench:
    """One model in llama.cpp: its shape as the GGUF states it, its KV cache and decode speeds."""

    model: str
    gguf: str
    gguf_bytes: int
    threads: int
    n_ctx: int
    n_ctx_train: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    kv_allocated_bytes: int
    kv_cells: int
    kv_type: str
    kv_formula_bytes: int  # 2 x layers x kv_heads x head_dim x bytes x cells
    decode: list[LlamaDecode] = field(default_factory=list)
    kv_cache: str = DEFAULT  # --kv-cache name the cache was allocated for (kv_type: the ggml type)
    kv_bytes_per_token: float = 0.0  # the formula for kv_type, block scales counted
    flash_attn: bool = False


def kv_formula(layers: int, kv_heads: int, head_dim: int, kv_type: str, cells: int) -> int:
    """Bytes of a K and a V cache of `cells` tokens: 2 x layers x kv_heads x head_dim x bytes x cells."""
    return round(kv_cache_bytes_per_token(layers, kv_heads, head_dim, TYPE_BYTES.get(kv_type, 2)) * cells)


def llama_kv_type(name: str) -> str:
    """The ggml cache type of a --kv-cache name; fp8 (vLLM's) refused in one line."""
    fmt = kv_format(name)
    if fmt.name not in LLAMA_KV_TYPES:
        raise UsageError(f"--kv-cache {fmt.name} is vLLM's cache format, llama.cpp has none; with --runtime llama.cpp "
                         f"use one of {', '.join(LLAMA_KV_TYPES)}")
    return LLAMA_KV_TYPES[fmt.name]


def random_tokens(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    """`n` token ids drawn uniformly from [3, n_vocab) (past <unk>/<s>/</s>), reproducibly."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, n_vocab) for _ in range(n)]


def greedy_decode(llm, new_tokens: int) -> float:
    """Decode `new_tokens` tokens one at a time from the cached prompt, greedily; return seconds."""
    import numpy as np

    n_vocab = llm.n_vocab()
    start = time.perf_counter()
    for _ in range(new_tokens):
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
        llm.eval([int(logits.argmax())])
    return time.perf_counter() - start


def bench_gguf(name: str, path: Path, contexts: Sequence[int], new_tokens: int, repeats: int,
               threads: int, warmup: int = 1, kv_cache: str = DEFAULT) -> LlamaBench:
    """Measure one GGUF file (see the module docstring), its cache allocated for `kv_cache`."""
    n_ctx = max(contexts) + new_tokens
    kv_type = llama_kv_type(kv_cache)
    llm, _, kv = gguf.load_llama(path, n_ctx, threads, kv_type=kv_type, flash_attn=kv_type in NEEDS_FLASH_ATTN)
    meta = gguf.gguf_meta(llm)
    limit = gguf.arch_value(meta, "context_length") or n_ctx
    if max(contexts) + new_tokens > limit:
        raise UsageError(f"{name}: context {max(contexts)} + {new_tokens} new tokens exceeds the model's limit "
                         f"{limit} tokens; pass smaller --context values")
    if kv is None:
        raise UsageError(f"{name}: llama.cpp printed no KV cache line; is {path} a decoder-only model?")
    layers = gguf.arch_value(meta, "block_count")
    heads = gguf.arch_value(meta, "attention.head_count")
    kv_heads = gguf.arch_value(meta, "attention.head_count_kv") or heads
    head_dim = gguf.arch_value(meta, "attention.key_length") or gguf.arch_value(meta, "embedding_length") // heads
    result = LlamaBench(name, str(path), path.stat().st_size, threads, n_ctx, limit, layers, heads, kv_heads,
                        head_dim, kv.bytes, kv.cells, kv.k_type,
                        kv_formula(layers, kv_heads, head_dim, kv.k_type, kv.cells), kv_cache=kv_format(kv_cache).name,
                        kv_bytes_per_token=kv_cache_bytes_per_token(layers, kv_heads, head_dim, TYPE_BYTES[kv.k_type]),
                        flash_attn=kv_type in NEEDS_FLASH_ATTN)
    prompt = random_tokens(max(contexts), llm.n_vocab())
    with gguf.quiet():
        llm.eval(prompt[:min(contexts)])  # the first prefill
        for context in sorted(contexts):
            llm.n_tokens = min(llm.n_tokens, context)
            llm.eval(prompt[llm.n_tokens:context])  # grow the cache to `context` tokens (untimed)
            speeds, others = [], []
            for run in range(warmup + repeats):
                llm.n_tokens = context  # forget the last run's decoded tokens
                with CpuMonitor() as monitor:
                    seconds = greedy_decode(llm, new_tokens)
                if run >= warmup:
                    speeds.append(new_tokens / seconds)
                    others.append(monitor.others)
            note = busy_note(max(others), machine_cpus(), threads)
            per_cell = kv.bytes / kv.cells
            result.decode.append(LlamaDecode(context, new_tokens, speeds, gguf.rss_bytes(),
                                             round(per_cell * context), note))
    with gguf.quiet():
        llm.close()
    return result


def gguf_files(models: Sequence[str], tmp: Path, llama_cpp_dir: str | None, outtype: str) -> list[tuple[str, Path]]:
    """(name, GGUF path) per MODEL: a .gguf as it is, a Hugging Face folder converted into `tmp`."""
    out = []
    converter = None
    for i, model in enumerate(models):
        path = Path(model)
        if path.is_file() and path.suffix == ".gguf":
            out.append((model, path))
        elif (path / "config.json").is_file():
            converter = converter or gguf.find_converter(llama_cpp_dir)
            out.append((model, gguf.convert_to_gguf(path, tmp / f"{i}-{path.name}.gguf", converter, outtype)))
        else:
            raise UsageError(f"{model} is neither a .gguf file nor a model folder with config.json")
    return out


def add_llama_args(parser: argparse.ArgumentParser) -> None:
    """Arguments only --runtime llama.cpp reads."""
    g = parser.add_argument_group("--runtime llama.cpp")
    g.add_argument("--llama-cpp", metavar="DIR", help="llama.cpp checkout whose convert_hf_to_gguf.py converts "
                   "model folders (default $LLAMA_CPP_DIR); not needed for .gguf files")
    g.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"],
                   help="GGUF weight type for folders converted on the fly")


def run_llama_bench(args: argparse.Namespace) -> list[LlamaBench]:
    """The llama.cpp benchmark of args.models (contexts, new tokens, repeats from the shared args)."""
    kv_cache = getattr(args, "kv_cache", None) or DEFAULT  # the sweep's namespace has none
    llama_kv_type(kv_cache)  # fp8: refused before anything else
    gguf.require_llama_cpp()
    if args.warmup < 0:
        raise UsageError("--warmup must be >= 0")
    check_paths(kv_format(kv_cache), [m for m in args.models if (Path(m) / "config.json").is_file()])
    threads = applied().threads if applied() else machine_cpus()
    with tempfile.TemporaryDirectory(prefix="uptrain-gguf-") as tmp:
        files = gguf_files(args.models, Path(tmp), args.llama_cpp, args.outtype)
        return [bench_gguf(name, path, args.context, args.new_tokens, args.repeats, threads, args.warmup, kv_cache)
                for name, path in files]


def llama_tables(results: Sequence[LlamaBench]) -> str:
    """Markdown: each model's KV cache (allocated vs formula) and its decode speed per context."""
    from uptrain.cli import format_table

    mib = 1024 * 1024
    kv = format_table(
        ["model", "GGUF MiB", "layers x heads / kv heads x head_dim", "n_ctx (limit)", "KV cache (flash attn)",
         "KV B/token (formula)", "KV allocated MiB (llama.cpp)", "KV formula MiB", "threads"],
        [(r.model, f"{r.gguf_bytes / mib:.1f}", f"{r.layers} x {r.heads} / {r.kv_heads} x {r.head_dim}",
          f"{r.n_ctx} ({r.n_ctx_train})", f"{r.kv_cache}: {r.kv_type} ({'on' if r.flash_attn else 'off'})",
          f"{r.kv_bytes_per_token:g}", f"{r.kv_allocated_bytes / mib:.2f} ({r.kv_cells} cells, {r.kv_type})",
          f"{r.kv_formula_bytes / mib:.2f}", r.threads) for r in results])
    dec = format_table(
        ["model", "context", "decode tok/s (median, min-max)", "KV at context MiB", "RSS MiB"],
        [(r.model, d.context, f"{d.median:.1f} ({min(d.tokens_per_s):.1f}-{max(d.tokens_per_s):.1f})"
          + (f": {d.note}" if d.note else ""), f"{d.kv_bytes_at_context / mib:.2f}", f"{d.rss_bytes / mib:.0f}")
         for r in results for d in r.decode])
    return kv + "\n\n" + dec
