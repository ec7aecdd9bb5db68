"""Tokens per CPU-second of the no-data uptraining path on a small model, against the bare
matrix-multiply rate (issue 61's throughput lever).

    OMP_NUM_THREADS=1 python scripts/studies/cpu_throughput.py --out results/cpu-throughput.json

What it measures, each on one thread unless named (the machine's other core may be busy: the
record keeps the load average beside each number):
  - the bare fp32 matrix-multiply rate (a 1024^3 product and the model's own shapes);
  - the training step that distils stories260K-mha8 into its 2 K/V-head start (student forward and
    backward, the source's forward, the KL, AdamW), by attention implementation and block length,
    with its FLOPs per token (uptrain.train.report.mfu) and a profile of where the time goes;
  - the real trainer (`python -m uptrain.train`, configs/demo-cpu.yaml with the recipe's
    distillation), by micro batch, torch.compile and threads: its median tokens/s after the first
    third of the steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "examples" / "stories260K-mha8"
START = REPO / "runs" / "quality-curve" / "start-quality-kv2"  # scripts/studies/quality_curve.py makes it


def matmul_rate(m: int, k: int, n: int) -> float:
    """GFLOP/s of an (m, k) @ (k, n) fp32 product on the current threads."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        a @ b
    reps = max(3, int(2e9 / (2 * m * k * n)))
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.perf_counter() - t0) / 1e9


def step_rate(attn: str, batch: int, seq_len: int, profile: bool = False) -> dict:
    """Tokens/s of one distillation step (student fwd+bwd, source fwd, KL, AdamW) on random tokens."""
    from transformers import AutoModelForCausalLM

    from uptrain.train.report.mfu import model_flops_per_token

    student = AutoModelForCausalLM.from_pretrained(START, attn_implementation=attn)
    teacher = AutoModelForCausalLM.from_pretrained(SOURCE, attn_implementation=attn).eval()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    x = torch.randint(0, student.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))

    def step():
        with torch.no_grad():
            target = teacher(x).logits.log_softmax(-1)
        loss = torch.nn.functional.kl_div(student(x).logits.log_softmax(-1), target, log_target=True,
                                          reduction="batchmean")
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(20):
        step()
    tok_s = 20 * batch * seq_len / (time.perf_counter() - t0)
    flops = model_flops_per_token(student, seq_len) + model_flops_per_token(teacher, seq_len) / 3
    out = {"attn": attn, "batch": batch, "seq_len": seq_len, "tok_per_s": round(tok_s),
           "flops_per_token": int(flops), "gflop_per_s": round(tok_s * flops / 1e9, 1)}
    if profile:
        out["time_share"] = time_shares(step)
    return out


def time_shares(step) -> dict:
    """Share of a step's CPU time by kind of op: matrix multiplies, attention kernels, the rest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    kinds = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm"), "attention": ("scaled_dot_product", "softmax_backward",
                                                                                "aten::_softmax")}
    shares = {kind: sum(e.self_cpu_time_total for e in events if any(n in e.key for n in names)) / total
              for kind, names in kinds.items()}
    shares["other"] = 1 - sum(shares.values())
    return {k: round(v, 3) for k, v in shares.items()}


def trainer_rate(name: str, overrides: list[str], tokens: int, work: Path) -> dict:
    """Median tokens/s (after the first third of the steps) of a real uptrain.train run."""
    run_dir = work / name
    cmd = [sys.executable, "-m", "uptrain.train", "configs/demo-cpu.yaml", f"model={START}", f"run_dir={run_dir}",
           "overwrite=true", f"distill.teacher={SOURCE}", "distill.alpha_kd=1.0", f"budget.tokens={tokens}",
           "eval.every=0", "checkpoint.every=0", "log.log_with=[]", "log.progress_bar=false", *overrides]
    load = os.getloadavg()[0]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"tok_per_s"' in line]
    rows = rows[len(rows) // 3:]
    return {"name": name, "overrides": overrides, "tok_per_s": round(statistics.median(r["tok_per_s"] for r in rows)),
            "steps_timed": len(rows), "load_before": round(load, 2)}


TRAINER = {  # name: overrides of configs/demo-cpu.yaml (its recipe: micro batch 8 x 2 accumulations of 128 tokens)
    "recipe": ["threads=1"],
    "micro16x1": ["threads=1", "batch.micro_batch=16", "batch.grad_accum=1"],
    "micro64x1": ["threads=1", "batch.micro_batch=64", "batch.grad_accum=1"],
    "compile": ["threads=1", "compile=true"],
    "seq64": ["threads=1", "data.seq_len=64", "batch.micro_batch=16"],
    "seq512": ["threads=1", "data.seq_len=512", "batch.micro_batch=2"],
    "threads2": ["threads=2"],
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "results" / "cpu-throughput.json")
    p.add_argument("--tokens", type=int, default=300_000, help="trainer tokens per setting")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "cpu-throughput")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    record = {"machine": f"{os.cpu_count()} cores", "torch": torch.__version__, "load_start": os.getloadavg()[0],
              "matmul_gflop_per_s": {f"{m}x{k}x{n}": round(matmul_rate(m, k, n), 1)
                                     for m, k, n in [(1024, 1024, 1024), (2048, 64, 64), (2048, 64, 172), (2048, 64, 512)]}}
    record["step"] = [step_rate(attn, b, s, profile=(attn == "sdpa")) for attn in ("sdpa", "eager")
                      for b, s in [(32, 64), (16, 128), (4, 512)]]
    record["trainer"] = [trainer_rate(name, o, args.tokens, args.work) for name, o in TRAINER.items()]
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
