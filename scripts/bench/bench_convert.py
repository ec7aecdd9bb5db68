"""Measure conversion wall time and peak memory on a checkpoint with a real model's shapes,
against copying the same folder.

    python scripts/bench/bench_convert.py ../shared/data/configs/llama-2-7b-hf.json --kv-heads 8 \
        --dtype bfloat16 --work runs/bench-convert [--layers 4] [--set KEY=VALUE ...] [--repeats 3] \
        [--warmup 1] [--evict] [--keep]

Writes a random-weight checkpoint with exactly the tensor names and shapes that the config's
transformers class saves (built on the meta device, so nothing is allocated), in 5 GB shards
(`--layers` cuts the layer count, every tensor keeps its real shape). Then, `--repeats` times,
interleaved (the order alternates each round; `--warmup` rounds first, not counted):
`python -m uptrain.convert` in a child process
(wall time, the child's own peak RSS, its phase times from uptrain_conversion.json), and
`cp -r SRC COPY && sync -f COPY` (a copy made durable, as the converter's output is). Before
each run the source is read once, so both start from a cached source, or with `--evict` dropped
from the page cache (`sync`, then `posix_fadvise(DONTNEED)` on every source file; `fincore`
confirms it where installed), so both read it from the disk. Prints the median of each and
their ratio, with the load average before each run and what each run read from the disk (source
pages evicted meanwhile: on a slow disk these dominate the timings). Random weights: the numbers are about I/O and memory, not quality. `--set` edits
the config (e.g. 70B shapes from the 7B config); `--keep` keeps the source between invocations
(reused when its config matches).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from uptrain.convert.io.passthrough import stored_tensors
from uptrain.convert.io.source import TensorSpec
from uptrain.convert.io.shards import ShardWriter, finish_shards
from uptrain.units import DTYPES, parse_size

CHILD = """
import sys
from uptrain.convert.__main__ import main
rc = main(sys.argv[1:])
status = open("/proc/self/status").read()
print(int(status.split("VmHWM:")[1].split()[0]) * 1024)
sys.exit(rc)
"""


def write_random_checkpoint(raw: dict, folder: Path, dtype: torch.dtype, shard: str) -> list[TensorSpec]:
    rest = {k: v for k, v in raw.items() if k != "model_type"}
    cfg = AutoConfig.for_model(raw["model_type"], **rest)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    specs = [TensorSpec(n, tuple(t.shape), dtype) for n, t in model.state_dict().items()
             if not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    folder.mkdir(parents=True)
    writer = ShardWriter(folder, [s.stored() for s in specs], parse_size(shard))
    gen = torch.Generator().manual_seed(0)
    for spec in specs:
        writer.write(spec.name, (torch.randn(spec.shape, generator=gen) * 0.02).to(dtype))
    writer.close()
    finish_shards(folder, [writer])
    (folder / "config.json").write_text(json.dumps(raw | {"dtype": str(dtype).removeprefix("torch.")}, indent=2))
    return specs


def read_all(folder: Path) -> None:
    """Bring the folder into the page cache (a cached source for every run)."""
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            while fh.read(64 * 2**20):
                pass


def evict(folder: Path) -> None:
    """Write back every dirty page, then drop the folder's files from the page cache."""
    os.sync()
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if shutil.which("fincore"):
        cached = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, folder.iterdir())],
                                capture_output=True, text=True).stdout.split()
        left = sum(int(x) for x in cached if x.isdigit())
        if left > 64 * 2**20:
            print(f"warning: {left / 2**20:.0f} MiB of the source is still cached after eviction", file=sys.stderr)


def prime(src: Path, cold: bool) -> None:
    (evict if cold else read_all)(src)


def disk_reads() -> int:
    """Bytes that this process's finished children read from the disk (not from the page cache)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock * 512


def run_convert(src: Path, out: Path, kv_heads: int, verbose: bool = True, cold: bool = False) -> dict:
    prime(src, cold)
    load, reads = os.getloadavg()[0], disk_reads()
    t0 = time.perf_counter()
    # The child reports its own VmHWM: ru_maxrss of a forked child starts from the parent's RSS.
    child = subprocess.run([sys.executable, "-c", CHILD, str(src), "--kv-heads", str(kv_heads), "--out", str(out)]
                           + ["--verbose"] * verbose, check=True, stdout=subprocess.PIPE, text=True,
                           cwd=out.parent)  # `-c` puts the cwd first on sys.path: let PYTHONPATH pick uptrain
    wall = time.perf_counter() - t0
    record = json.loads((out / "uptrain_conversion.json").read_text())
    shutil.rmtree(out)
    return {"wall_s": wall, "peak_rss": int(child.stdout.strip().splitlines()[-1]),
            "timing_s": record.get("timing_s", {}), "streams": record.get("streams"),
            "load_before": load, "disk_read_bytes": disk_reads() - reads}


def run_copy(src: Path, dst: Path, cold: bool = False) -> dict:
    prime(src, cold)
    load, reads = os.getloadavg()[0], disk_reads()
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    subprocess.run(["sync", "-f", str(dst)], check=True)
    wall = time.perf_counter() - t0
    shutil.rmtree(dst)
    return {"wall_s": wall, "load_before": load, "disk_read_bytes": disk_reads() - reads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--layers", type=int, help="override num_hidden_layers (tensor shapes stay real)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (JSON value), e.g. hidden_size=8192")
    p.add_argument("--evict", action="store_true", help="drop the source from the page cache before each run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=0, help="rounds run first and not counted")
    p.add_argument("--work", type=Path, required=True, help="scratch folder (deleted at the end unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the source checkpoint")
    p.add_argument("--no-verbose", action="store_true", help="for converters older than --verbose")
    args = p.parse_args()
    raw = json.loads(args.config.read_text())
    if args.layers:
        raw["num_hidden_layers"] = args.layers
    for item in args.set:
        key, _, value = item.partition("=")
        raw[key] = json.loads(value)
    src, out, copy = args.work / "src", args.work / "out", args.work / "copy"
    for leftover in (out, copy):
        shutil.rmtree(leftover, ignore_errors=True)
    stamp = json.dumps(raw | {"dtype": args.dtype}, sort_keys=True)
    if not (src / "bench-source.json").is_file() or (src / "bench-source.json").read_text() != stamp:
        shutil.rmtree(args.work, ignore_errors=True)
        write_random_checkpoint(raw, src, DTYPES[args.dtype], "5GB")
        (src / "bench-source.json").write_text(stamp)
    specs = [s for s in (json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])]
    total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    largest = max(t.nbytes for t in stored_tensors(src))
    for i in range(args.warmup):
        print(f"warm-up {i + 1}: convert {run_convert(src, out, args.kv_heads, False, args.evict)['wall_s']:.1f} s, "
              f"copy {run_copy(src, copy, args.evict)['wall_s']:.1f} s", flush=True)
    converts, copies = [], []
    for i in range(args.repeats):
        if i % 2 == 0:
            converts.append(run_convert(src, out, args.kv_heads, not args.no_verbose, args.evict))
            copies.append(run_copy(src, copy, args.evict))
        else:
            copies.append(run_copy(src, copy, args.evict))
            converts.append(run_convert(src, out, args.kv_heads, not args.no_verbose, args.evict))
        print(f"round {i + 1}: convert {converts[-1]['wall_s']:.1f} s, copy {copies[-1]['wall_s']:.1f} s "
              f"(load average {converts[-1]['load_before']:.1f} / {copies[-1]['load_before']:.1f} before each)",
              flush=True)
    if not args.keep:
        shutil.rmtree(args.work)
    conv = statistics.median(c["wall_s"] for c in converts)
    cp = statistics.median(c["wall_s"] for c in copies)
    print(json.dumps({
        "config": args.config.name, "set": args.set, "layers": raw["num_hidden_layers"], "kv_heads": args.kv_heads,
        "source": "evicted" if args.evict else "cached",
        "dtype": args.dtype, "tensors": len(specs), "checkpoint_bytes": total,
        "convert_wall_s": [round(c["wall_s"], 2) for c in converts], "copy_wall_s": [round(c["wall_s"], 2) for c in copies],
        "convert_median_s": round(conv, 2), "copy_median_s": round(cp, 2), "convert_over_copy": round(conv / cp, 2),
        "paired_ratios": [round(c["wall_s"] / w["wall_s"], 2) for c, w in zip(converts, copies)],
        "median_paired_ratio": round(statistics.median(c["wall_s"] / w["wall_s"] for c, w in zip(converts, copies)), 2),
        "load_before_convert": [round(c["load_before"], 2) for c in converts],
        "load_before_copy": [round(c["load_before"], 2) for c in copies],
        "disk_read_mib_convert": [round(c["disk_read_bytes"] / 2**20) for c in converts],
        "disk_read_mib_copy": [round(c["disk_read_bytes"] / 2**20) for c in copies],
        "convert_peak_rss_bytes": max(c["peak_rss"] for c in converts),
        "largest_tensor_bytes": largest,
        "convert_phases_s": [c["timing_s"] for c in converts],
        "convert_streams": converts[-1]["streams"],
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads, "
                   f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f} at the end",
        "torch": torch.__version__}, indent=2))


if __name__ == "__main__":
    main()
