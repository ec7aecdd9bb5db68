"""KV-cache size and decode throughput of causal LMs, measured on this machine.

`python -m uptrain.bench MODEL [MODEL ...] [--context 128 256] [--batch 1 8] [--memory-budget 24GB]
    [--kv-cache NAME]`
(`--runtime llama.cpp`: GGUF files or folders in llama.cpp instead, see `uptrain.measure.bench_llama`)

KV bytes are read from the cache a real forward leaves behind (a DynamicCache whose layers
hold keys/values [batch, kv_heads, seq, head_dim]) and checked against the config formula
2 x layers x kv_heads x head_dim x bytes per token; a mismatch (e.g. sliding-window layers
capping the cache) is reported as a warning. Decode throughput is timed through `generate`
(greedy, exactly `new_tokens` new tokens) with warm-up and repeats; the median is reported.

`--kv-cache NAME` (uptrain.measure.kv_cache: fp16, bf16, fp8, q8_0, q4_0, ...): the KV bytes a runtime
storing its cache in that format holds, block scales counted (`kv_bytes_per_token`, the bytes at
each context and the batch in the memory budget). transformers does not store that format (the
emulation keeps dequantized values), so these are the format's formula, not measured, and the
record says so (`kv_bytes_measured_in`); the cache transformers held is kept beside it
(`kv_bytes_per_token_stored`) and decoding is timed with the model as saved. With --runtime
llama.cpp the cache is allocated in that type and measured (bench_llama).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.cli import ArgParser, format_table, positive_int, prog_name, write_json
from uptrain.convert.io.hfconfig import model_shape
from uptrain.measure.bench_llama import add_llama_args, llama_tables, run_llama_bench
from uptrain.measure.kv_cache import DEFAULT, KVFormat, add_kv_cache_arg, check_paths, kv_format, model_bytes_per_token
from uptrain.measure.models import LOAD_DTYPES, load_model, require_model_folder
from uptrain.threads import CpuMonitor, add_threads_arg, announce_threads, busy_note, machine_cpus, start_threads
from uptrain.units import kv_cache_bytes_per_token, parse_size


MIN_DECODE_S = 0.05  # shortest decode time per repeat that we report as a speed
MAX_SPREAD = 0.25  # widest (max - min) / median over repeats that we report as a speed


@dataclass
class DecodeResult:
    """Median timings of `generate` for one (batch, context) setting."""

    batch: int
    context: int
    new_tokens: int
    decode_tokens_per_s: float  # batch x (new_tokens - 1) / time after the first new token (median)
    generate_tokens_per_s: float  # batch x new_tokens / whole generate call (prefill included)
    times_s: list[float] = field(default_factory=list)  # whole generate call, per repeat
    decode_times_s: list[float] = field(default_factory=list)  # decode part, per repeat
    cpu_busy_others: float | None = None  # CPUs other processes kept busy while timing (None: not measured)
    busy: str | None = None  # "noisy: CPU busy ..." when those and our threads oversubscribed the CPUs

    @property
    def decode_range(self) -> tuple[float, float]:
        """(slowest, fastest) decode tokens/s over the repeats."""
        rates = [self.batch * (self.new_tokens - 1) / t for t in self.decode_times_s] or [self.decode_tokens_per_s]
        return min(rates), max(rates)

    @property
    def unreliable(self) -> str | None:
        """Why this timing cannot carry a headline number (None when it can).

        A speed timed while other processes kept the CPUs busy (`busy`) is the first reason: a
        competing job slows every repeat alike, so the spread cannot show it. Below MIN_DECODE_S,
        timer resolution, thread wake-ups and the OS scheduler dominate; a spread (max - min) /
        median above MAX_SPREAD means another job was competing.
        """
        if self.busy:
            return self.busy
        if not self.decode_times_s:
            return None
        median = statistics.median(self.decode_times_s)
        if median < MIN_DECODE_S:
            return f"too short ({median * 1e3:.1f} ms per repeat; raise --new-tokens or --batch)"
        spread = (max(self.decode_times_s) - min(self.decode_times_s)) / median
        if len(self.decode_times_s) > 1 and spread > MAX_SPREAD:
            return f"noisy (repeats spread {spread:.0%}; a competing job? raise --repeats)"
        return None


@dataclass
class BenchResult:
    """KV-cache and speed figures of one model."""

    model: str
    dtype: str
    device: str
    threads: int  # torch CPU threads
    layers: int
    kv_heads: int
    head_dim: int
    weight_bytes: int  # parameters (tied ones once) and buffers
    kv_bytes_per_token_formula: float  # 2 x layers x kv_heads x head_dim x bytes per value in `kv_cache`
    kv_bytes_per_token: float  # in `kv_cache`: measured at the longest context (`model`), else the formula
    kv_bytes: dict[int, int]  # context length -> cache bytes (batch 1) in `kv_cache`, as kv_bytes_per_token
    max_batch: dict[int, int] | None  # context length -> largest batch within the memory budget
    decode: list[DecodeResult]
    kv_cache: str = DEFAULT  # the cache format the KV bytes are given in (uptrain.measure.kv_cache)
    kv_bytes_measured_in: str = "measured: the cache transformers holds"  # or why the bytes are a formula
    kv_bytes_per_token_stored: float | None = None  # measured bytes/token of the cache transformers held


def kv_bytes_per_token_formula(config, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element, from the model's config."""
    shape = model_shape(config)
    return kv_cache_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, torch.empty((), dtype=dtype).element_size())


def cache_bytes(cache) -> int:
    """Bytes held by the keys and values of every layer of a transformers Cache."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):  # [batch, kv_heads, seq, head_dim]
                total += t.numel() * t.element_size()
    return total


def random_ids(model: torch.nn.Module, batch: int, context: int, seed: int = 0) -> torch.Tensor:
    """LongTensor [batch, context] of random token ids (content does not change cost)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.get_text_config().vocab_size, (batch, context), generator=g).to(model.device)


@torch.no_grad()
def measure_kv_bytes(model: torch.nn.Module, context: int) -> int:
    """Bytes of the KV cache after one forward of `context` tokens at batch 1."""
    out = model(input_ids=random_ids(model, 1, context), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    return cache_bytes(cache)


class _StepClock(StoppingCriteria):
    """Records when each new token is appended; never stops generation."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def decode_throughput(model: torch.nn.Module, batch: int, context: int, new_tokens: int,
                      warmup: int = 1, repeats: int = 3) -> DecodeResult:
    """Time greedy `generate` of exactly `new_tokens` tokens after a `context`-token prompt.

    Decode speed counts only the steps after the first new token (the first one pays the
    prefill); generate speed is over the whole call. Medians over `repeats` after `warmup` runs.
    On CPU the timed runs are watched (`CpuMonitor`): a speed measured while other processes and
    our threads oversubscribed the CPUs is flagged in `busy`, not refused.
    """
    if new_tokens < 2:
        raise UsageError("--new-tokens must be at least 2 to time decoding")
    ids = random_ids(model, batch, context)
    mask = torch.ones_like(ids)
    pad = model.config.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    totals, decodes = [], []
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    monitor = CpuMonitor() if model.device.type == "cpu" else None
    for i in range(warmup + repeats):
        if i == warmup and monitor is not None:
            monitor.__enter__()
        clock = _StepClock()
        sync()
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                             stopping_criteria=StoppingCriteriaList([clock]))
        sync()
        end = time.perf_counter()
        assert out.shape == (batch, context + new_tokens), out.shape
        if i >= warmup:
            totals.append(end - start)
            decodes.append(clock.times[-1] - clock.times[0])
    others = busy = None
    if monitor is not None:
        monitor.__exit__(None, None, None)
        others = round(monitor.others, 2)
        busy = busy_note(monitor.others, machine_cpus(), torch.get_num_threads())
    return DecodeResult(
        batch=batch, context=context, new_tokens=new_tokens,
        decode_tokens_per_s=batch * (new_tokens - 1) / statistics.median(decodes),
        generate_tokens_per_s=batch * new_tokens / statistics.median(totals), times_s=totals,
        decode_times_s=decodes, cpu_busy_others=others, busy=busy,
    )


def kv_at_format(fmt: KVFormat, model: torch.nn.Module, measured: dict[int, int]) -> tuple[dict[int, int], float, str]:
    """(bytes at each context, bytes per token, where they come from) of the cache stored as `fmt`.

    `measured`: context -> bytes of the cache transformers held (the model's dtype). The model's own
    format: those. Any other: the format's formula, block scales counted (`model_bytes_per_token`),
    since the emulation keeps the rounded values dequantized, in the model's dtype: nothing to measure.
    """
    if fmt.round_trip is None:
        longest = max(measured)
        return measured, measured[longest] / longest, "measured: the cache transformers holds"
    per_token = model_bytes_per_token(fmt, model)
    dtype = str(model.dtype).removeprefix("torch.")
    return ({c: round(per_token * c) for c in measured}, per_token,
            f"formula: the {fmt.name} format's bytes, not measured (transformers holds its cache in {dtype})")


def max_batch_in_budget(weight_bytes: int, kv_bytes_at_context: int, budget: int) -> int:
    """Largest batch with weights + batch x KV cache (at the context) <= budget (0 if none)."""
    return max(0, (budget - weight_bytes) // kv_bytes_at_context) if kv_bytes_at_context else 0


def bench_model(path: str, contexts: Sequence[int], batches: Sequence[int], new_tokens: int,
                dtype: str = "auto", warmup: int = 1, repeats: int = 3,
                memory_budget: int | None = None, device: str = "cpu", kv_cache: str = DEFAULT) -> BenchResult:
    """All figures for one model folder; decode is skipped when `batches` is empty. KV bytes in the
    `kv_cache` format (`kv_at_format`); decoding is timed with the model as saved."""
    fmt = kv_format(kv_cache)
    check_paths(fmt, [path])  # a block format the head_dim cannot take: refused before the weights load
    model, _ = load_model(path, dtype, device, with_tokenizer=False)
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit and max(contexts) + (new_tokens if batches else 0) > limit:
        raise UsageError(f"{path}: context {max(contexts)} + {new_tokens} new tokens exceeds "
                         f"max_position_embeddings {limit}; choose shorter --context")
    shape = model_shape(model.config)
    per_token = kv_bytes_per_token_formula(model.config, model.dtype)
    measured = {c: measure_kv_bytes(model, c) for c in sorted(contexts)}
    for c, b in measured.items():
        if b != per_token * c:
            warnings.warn(f"{path}: measured KV cache at context {c} is {b} bytes, the formula "
                          f"2 x layers x kv_heads x head_dim x bytes gives {per_token * c} "
                          "(sliding-window or shared-KV layers?)", stacklevel=2)
    # parameters() yields tied weights (embeddings = lm_head) once; buffers are RoPE tables etc.
    weights = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    at_format, at_format_per_token, source = kv_at_format(fmt, model, measured)
    budget = None if memory_budget is None else {c: max_batch_in_budget(weights, b, memory_budget)
                                                 for c, b in at_format.items()}
    decode = [decode_throughput(model, b, c, new_tokens, warmup, repeats)
              for b in batches for c in sorted(contexts)]
    longest = max(measured)
    return BenchResult(model=path, dtype=str(model.dtype).removeprefix("torch."), device=str(model.device),
                       threads=torch.get_num_threads(), layers=shape.layers,
                       kv_heads=shape.kv_heads, head_dim=shape.head_dim, weight_bytes=weights,
                       kv_bytes_per_token_formula=model_bytes_per_token(fmt, model),
                       kv_bytes_per_token=at_format_per_token, kv_bytes=at_format, max_batch=budget, decode=decode,
                       kv_cache=fmt.name, kv_bytes_measured_in=source,
                       kv_bytes_per_token_stored=measured[longest] / longest)


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Benchmark arguments shared by bench and compare."""
    g = parser.add_argument_group("benchmark")
    g.add_argument("--context", nargs="+", type=positive_int, default=[128, 256], help="context lengths (tokens)")
    g.add_argument("--batch", nargs="+", type=positive_int, default=[1, 8], help="decode batch sizes")
    g.add_argument("--new-tokens", type=positive_int, default=32, help="tokens generated per decode run")
    g.add_argument("--warmup", type=int, default=1, help="untimed runs before timing")
    g.add_argument("--repeats", type=positive_int, default=3, help="timed runs; the median is reported")
    g.add_argument("--memory-budget", type=parse_size, default=None, help="e.g. 24GB: report the largest batch that fits")
    g.add_argument("--dtype", default="auto", choices=sorted(LOAD_DTYPES), help="weights dtype; auto: as saved")
    g.add_argument("--device", default="cpu", help="torch device for the benchmark, e.g. cpu, cuda")
    add_threads_arg(g)
    g.add_argument("--plot", metavar="DIR", help="write kv-bytes.png and decode-speed.png into DIR")


def bench_from_args(args: argparse.Namespace, paths: Sequence[str]) -> list[BenchResult]:
    """Run `bench_model` on each path with the arguments of `add_bench_args`."""
    if args.warmup < 0:
        raise UsageError("--warmup must be >= 0")
    for p in paths:
        require_model_folder(p)
    kv_cache = getattr(args, "kv_cache", None) or DEFAULT  # compare has no --kv-cache of its own (yet)
    check_paths(kv_format(kv_cache), paths)  # every model checked before the first loads
    announce_threads()
    return [bench_model(p, args.context, args.batch, args.new_tokens, args.dtype, args.warmup,
                        args.repeats, args.memory_budget, args.device, kv_cache) for p in paths]


def format_decode(d: DecodeResult) -> str:
    """'median (min-max)', or why the timing is not a number to quote."""
    low, high = d.decode_range
    text = f"{d.decode_tokens_per_s:.1f} ({low:.1f}-{high:.1f})"
    return f"{text}: {d.unreliable}" if d.unreliable else text


def _kv_cell(r: BenchResult) -> str:
    """The measured bytes/token, or, for a format transformers does not store, that it is not measured."""
    if r.kv_bytes_measured_in.startswith("measured"):
        return f"{r.kv_bytes_per_token:g}"
    return f"not measured: {r.kv_cache} formula (transformers holds {r.kv_bytes_per_token_stored:g} in {r.dtype})"


def bench_tables(results: Sequence[BenchResult]) -> str:
    """The KV table and the decode table as markdown."""
    kv_rows = [(r.model, f"{r.dtype} {r.device}", r.kv_heads, r.kv_cache, f"{r.kv_bytes_per_token_formula:g}",
                _kv_cell(r), ", ".join(f"{c}: {b}" for c, b in r.kv_bytes.items()),
                "-" if r.max_batch is None else ", ".join(f"{c}: {b}" for c, b in r.max_batch.items()))
               for r in results]
    kv = format_table(["model", "dtype device", "kv heads", "KV cache", "KV B/token (formula)", "KV B/token (measured)",
                       "KV bytes at context", "max batch in budget at context"], kv_rows)
    dec_rows = [(r.model, d.batch, d.context, d.new_tokens, format_decode(d),
                 f"{d.generate_tokens_per_s:.1f}") for r in results for d in r.decode]
    dec = format_table(["model", "batch", "context", "new tokens", "decode tok/s (median, min-max)",
                        "generate tok/s (median)"], dec_rows)
    return kv + ("\n\n" + dec if dec_rows else "")


def write_outputs(args: argparse.Namespace, records: list[dict], bench_records: list[dict]) -> None:
    """`--json` (records) and `--plot` (KV bytes and decode speed of bench_records), as asked."""
    if args.json:
        write_json(records, args.json)
    if args.plot:
        from uptrain.measure.plots import plot_bench

        for p in plot_bench(bench_records, args.plot):
            print(f"wrote {p}", file=sys.stderr)


@exit_on_usage_error
def main(argv: Sequence[str] | None = None) -> int:
    """CLI: benchmark each MODEL and print KV-cache and decode tables."""
    parser = ArgParser(prog=prog_name("uptrain.bench"), description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", metavar="MODEL", help="local model folders (.gguf files too "
                        "with --runtime llama.cpp)")
    add_bench_args(parser)
    parser.add_argument("--runtime", default="transformers", choices=["transformers", "llama.cpp"],
                        help="transformers (generate) or llama.cpp (llama-cpp-python, installed separately)")
    add_llama_args(parser)
    add_kv_cache_arg(parser)
    parser.add_argument("--json", metavar="PATH", help="also write results as JSON (- for stdout)")
    args = parser.parse_args(argv)
    kv_format(args.kv_cache)  # an unknown name: refused before anything loads
    start_threads(args.threads)
    if args.runtime == "llama.cpp":
        given = [f"--{name.replace('_', '-')}" for name in ("batch", "memory_budget", "dtype", "device")
                 if getattr(args, name) != parser.get_default(name)]
        if given:  # a setting the llama.cpp run would not honour is refused, not silently dropped
            raise UsageError(f"{', '.join(given)} apply to --runtime transformers only: llama.cpp decodes one "
                             f"sequence on the CPU in the GGUF's own type (choose it with --outtype)")
        found = run_llama_bench(args)
        print(llama_tables(found), file=sys.stderr if args.json == "-" else sys.stdout)
        if args.json:
            write_json([asdict(r) for r in found], args.json)
        if args.plot:
            from uptrain.measure.plots import plot_llama_decode

            print(f"wrote {plot_llama_decode(found, Path(args.plot) / 'llama-cpp-decode.png')}", file=sys.stderr)
        return 0
    results = bench_from_args(args, args.models)
    print(bench_tables(results), file=sys.stderr if args.json == "-" else sys.stdout)
    write_outputs(args, [asdict(r) for r in results], [asdict(r) for r in results])
    return 0


if __name__ == "__main__":
    sys.exit(main())
