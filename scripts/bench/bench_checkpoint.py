"""Seconds of one trainer checkpoint (uptrain.train.state.run_state.save_checkpoint) against the size of the state.

One process (the model and AdamW state written by rank 0 through accelerate's save_state):

    .venv/bin/python scripts/bench/bench_checkpoint.py --sizes 125m,350m,1b --repeats 3 \
        --run-dir runs/bench-ckpt --drop-caches --out runs/ckpt-1p.jsonl

Two processes, DDP on CPU (rank 0 still writes everything) and the sharded path
(uptrain.train.parallel.shard.shard_model + save_sharded: every rank writes its shard with
torch.distributed.checkpoint, as `shard: fsdp2` runs do):

    .venv/bin/accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no --main_process_port 29517 scripts/bench/bench_checkpoint.py --sizes 125m,350m \
        --mode ddp --repeats 3 --run-dir runs/bench-ckpt --drop-caches --out runs/ckpt-2p-ddp.jsonl
    .venv/bin/accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no --main_process_port 29518 scripts/bench/bench_checkpoint.py --sizes 125m,350m,1b \
        --mode sharded --repeats 3 --run-dir runs/bench-ckpt --drop-caches --out runs/ckpt-2p-sh.jsonl

(`--mode sharded` without a launcher shards over a one-process group: the one-writer DCP baseline.)
Results: results/checkpoint-time.md.

Each size is a Llama (transformers LlamaConfig, random init, float32, vocab 32000, MHA) with an
AdamW optimizer whose state is populated by one real step on zero gradients (taken a few parameters
at a time, so no full set of gradients is ever held). Each repetition writes a checkpoint into a
fresh run folder (timed: save_checkpoint as the trainer calls it; its parts save_state, the sharded
write and the fsyncs are timed on every rank), records the bytes on disk, and deletes the folder
(outside the timed part). `--drop-caches` runs `sync; echo 3 > /proc/sys/vm/drop_caches` before
each repetition (needs root). One JSON line per size goes to stdout and `--out` (rank 0).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

import uptrain.train.state.run_state as run_state
from uptrain.train.parallel import shard

# hidden, layers, intermediate, heads (MHA: kv heads = heads); vocab 32000 for all.
SHAPES = {
    "125m": (768, 12, 2048, 12),
    "350m": (1024, 24, 2816, 16),
    "1b": (2048, 16, 5632, 32),  # TinyLlama's width and MLP, 16 of its 22 layers, MHA
    "1.1b": (2048, 22, 5632, 32),
}
VOCAB = 32000


def build_model(size: str, seed: int) -> LlamaForCausalLM:
    hidden, layers, inter, heads = SHAPES[size]
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048,
                         tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def make_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW with the trainer's two groups (weight decay on matrices only)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ], lr=1e-4, betas=(0.9, 0.95), eps=1e-8)


def populate_state(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], chunk: int = 8) -> None:
    """One AdamW step on zero gradients, `chunk` parameters at a time (a parameter without a
    gradient is skipped by step): exp_avg, exp_avg_sq and step exist for every parameter."""
    for i in range(0, len(params), chunk):
        group = params[i:i + chunk]
        for p in group:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for p in group:
            p.grad = None


def disk_bytes(folder: Path) -> dict[str, int]:
    """Apparent bytes of a checkpoint: weights (safetensors), optimizer (.bin), sharded (DCP), total."""
    out = {"weights": 0, "optimizer": 0, "sharded": 0, "other": 0}
    for here, _, files in os.walk(folder):
        for name in files:
            path = Path(here) / name
            size = path.stat().st_size
            if shard.SHARDED_STATE in path.parts:
                out["sharded"] += size
            elif name.endswith(".safetensors") or name.startswith("pytorch_model"):
                out["weights"] += size
            elif name.startswith("optimizer"):
                out["optimizer"] += size
            else:
                out["other"] += size
    out["total"] = sum(out.values())
    return out


class Timers:
    """Wraps save_state, the sharded write and run_state._fsync_tree to time them (this rank)."""

    def __init__(self, accelerator: Accelerator):
        self.t = {"save_state": 0.0, "save_sharded": 0.0, "fsync": 0.0}
        save_state, fsync_tree = accelerator.save_state, run_state._fsync_tree

        def timed(name, fn):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.t[name] += time.perf_counter() - start
            return wrapper

        accelerator.save_state = timed("save_state", save_state)
        run_state._fsync_tree = timed("fsync", fsync_tree)
        self.timed = timed

    def reset(self):
        for k in self.t:
            self.t[k] = 0.0


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def gather_max(accelerator: Accelerator, values: dict[str, float]) -> dict[str, float]:
    """Per-key maximum over ranks (the slowest rank sets the checkpoint's time)."""
    if accelerator.num_processes == 1:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    t = _all_reduce_max(t)
    return dict(zip(keys, t.tolist()))


def _all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def bench_size(args, accelerator: Accelerator, timers: Timers, size: str) -> dict:
    model = build_model(size, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    if args.mode == "sharded":
        model = shard.shard_model(model, accelerator)
        optimizer = make_adamw(model)
        populate_state(optimizer, list(model.parameters()))
        save_extra = timers.timed("save_sharded", lambda folder: shard.save_sharded(model, optimizer, folder))
    else:
        optimizer = make_adamw(model)
        model, optimizer = accelerator.prepare(model, optimizer)
        populate_state(optimizer, list(accelerator.unwrap_model(model).parameters()))
        save_extra = None
    gc.collect()
    reps, dropped = [], None
    for rep in range(args.repeats):
        run_dir = Path(args.run_dir) / f"{size}-{args.mode}-p{accelerator.num_processes}-r{rep}"
        if accelerator.is_main_process:
            if run_dir.exists():
                shutil.rmtree(run_dir)
            if args.drop_caches:
                dropped = drop_caches()
        accelerator.wait_for_everyone()
        timers.reset()
        start = time.perf_counter()
        final = run_state.save_checkpoint(accelerator, run_dir, rep + 1, {"step": rep + 1}, keep=1,
                                          save_extra=save_extra)
        seconds = time.perf_counter() - start
        parts = gather_max(accelerator, {"total": seconds, **timers.t})
        accelerator.wait_for_everyone()
        rec = {"rep": rep, **{f"{k}_s": round(v, 3) for k, v in parts.items()}}
        if accelerator.is_main_process:
            rec["bytes"] = disk_bytes(final)
            start = time.perf_counter()
            shutil.rmtree(run_dir)
            rec["delete_s"] = round(time.perf_counter() - start, 3)
            print(json.dumps({"size": size, **rec}), file=sys.stderr, flush=True)
        accelerator.wait_for_everyone()
        reps.append(rec)
    out = None
    if accelerator.is_main_process:
        med = {k: statistics.median(r[k] for r in reps) for k in reps[0] if k.endswith("_s")}
        total_bytes = reps[0]["bytes"]["total"]
        out = {"size": size, "shape": dict(zip(("hidden", "layers", "intermediate", "heads"), SHAPES[size])),
               "vocab": VOCAB, "params": n_params, "processes": accelerator.num_processes, "mode": args.mode,
               "repeats": args.repeats, "seed": args.seed, "caches_dropped": dropped,
               "bytes": reps[0]["bytes"], "state_gb": round(total_bytes / 1e9, 3),
               "median_s": {k: round(v, 3) for k, v in med.items()},
               "gb_per_s": round(total_bytes / 1e9 / med["total_s"], 3),
               "gb_per_s_per_writer": round(total_bytes / 1e9 / med["total_s"] /
                                            (accelerator.num_processes if args.mode == "sharded" else 1), 3),
               "reps": reps, "load_avg": os.getloadavg()}
    del model, optimizer, save_extra
    accelerator.free_memory()  # prepare() keeps references to the model and optimizer
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="125m,350m,1b", help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--mode", choices=("ddp", "sharded"), default="ddp",
                        help="ddp: accelerate.prepare (one process: plain); sharded: shard_model + save_sharded")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--run-dir", default="runs/bench-ckpt", help="parent of the per-repetition run folders")
    parser.add_argument("--drop-caches", action="store_true", help="sync; echo 3 > /proc/sys/vm/drop_caches before each rep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="append one JSON line per size here (rank 0)")
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; choose from {list(SHAPES)}")
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    timers = Timers(accelerator)
    for size in sizes:
        result = bench_size(args, accelerator, timers, size)
        if accelerator.is_main_process:
            line = json.dumps(result)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and Path(args.run_dir).is_dir() and not any(Path(args.run_dir).iterdir()):
        Path(args.run_dir).rmdir()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
