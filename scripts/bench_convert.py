"""Measure conversion wall time and peak memory on a checkpoint with a real model's shapes.

    python scripts/bench_convert.py ../shared/data/configs/llama-2-7b-hf.json --kv-heads 8 \
        --dtype bfloat16 --work /tmp/bench-convert

Writes a random-weight checkpoint with exactly the tensor names and shapes that the config's
transformers class saves (built on the meta device, so nothing is allocated), in 5 GB shards,
then runs `python -m uptrain.convert` on it in a child process and reports wall time, peak RSS
of the child and the largest tensor. Random weights: the numbers are about I/O and memory,
not quality.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from uptrain.convert.source import TensorSpec
from uptrain.convert.shards import ShardWriter
from uptrain.units import DTYPES, parse_size

CHILD = """
import sys
from uptrain.convert.__main__ import main
rc = main(sys.argv[1:])
status = open("/proc/self/status").read()
print(int(status.split("VmHWM:")[1].split()[0]) * 1024)
sys.exit(rc)
"""


def write_random_checkpoint(config_path: Path, folder: Path, dtype: torch.dtype, shard: str) -> list[TensorSpec]:
    raw = json.loads(config_path.read_text())
    rest = {k: v for k, v in raw.items() if k != "model_type"}
    cfg = AutoConfig.for_model(raw["model_type"], **rest)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    specs = [TensorSpec(n, tuple(t.shape), dtype) for n, t in model.state_dict().items()
             if not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    folder.mkdir(parents=True)
    writer = ShardWriter(folder, specs, parse_size(shard))
    gen = torch.Generator().manual_seed(0)
    for spec in specs:
        writer.write(spec.name, (torch.randn(spec.shape, generator=gen) * 0.02).to(dtype))
    writer.close()
    (folder / "config.json").write_text(json.dumps(raw | {"dtype": str(dtype).removeprefix("torch.")}, indent=2))
    return specs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--work", type=Path, required=True, help="scratch folder (deleted at the end)")
    args = p.parse_args()
    src, out = args.work / "src", args.work / "out"
    shutil.rmtree(args.work, ignore_errors=True)
    t0 = time.perf_counter()
    specs = write_random_checkpoint(args.config, src, DTYPES[args.dtype], "5GB")
    t_make = time.perf_counter() - t0
    t0 = time.perf_counter()
    # The child reports its own VmHWM: ru_maxrss of a forked child starts from the parent's RSS.
    child = subprocess.run([sys.executable, "-c", CHILD, str(src), "--kv-heads", str(args.kv_heads),
                            "--out", str(out)], check=True, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    print(child.stdout)
    peak = int(child.stdout.strip().splitlines()[-1])
    total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    largest = max(s.nbytes for s in specs)
    shutil.rmtree(args.work)
    print(json.dumps({"config": args.config.name, "kv_heads": args.kv_heads, "dtype": args.dtype,
                      "checkpoint_bytes": total, "largest_tensor_bytes": largest, "convert_wall_s": round(wall, 1),
                      "convert_peak_rss_bytes": peak, "make_checkpoint_s": round(t_make, 1),
                      "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {platform.python_version()}",
                      "torch": torch.__version__}, indent=2))


if __name__ == "__main__":
    main()
