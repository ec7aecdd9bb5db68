"""Tokens/s of uptrain.train against a minimal hand-written PyTorch loop (same model, batch, dtype).

    python scripts/bench/bench_trainer.py --model ../shared/data/models/stories260K-gqa4 \
        --data ../shared/data/corpora/tinystories-train-sample.txt --seq-len 256 --micro-batch 8 \
        --grad-accum 2 --steps 40 --warmup 5 --repeats 3

`--hidden N` replaces the model's weights by a random Llama of width N (same tokenizer and head
layout) to see the overhead when compute dominates. Both loops run the same optimizer steps on
the same packed blocks; throughput is measured over steps warmup+1..steps (first steps excluded).
The trainer runs as a user would run it: progress bar, metrics JSON lines, TensorBoard on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from uptrain.data import DataSource, documents
from uptrain.data.blocks import token_blocks
from uptrain.train.model.losses import lm_loss_sum
from uptrain.train.report.mfu import mfu, model_flops_per_token
from uptrain.train import train
from uptrain.train.config import load_config
from uptrain.train.state.run_state import MetricsLog
from uptrain.train.setup import make_optimizer

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo-cpu.yaml"


def random_model(source: str, hidden: int, layers: int, out: Path) -> str:
    """Save a random Llama with `source`'s tokenizer and head layout but width `hidden`."""
    config = AutoConfig.from_pretrained(source)
    config.update({"hidden_size": hidden, "intermediate_size": int(hidden * 8 / 3) // 8 * 8,
                   "num_hidden_layers": layers, "head_dim": hidden // config.num_attention_heads})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return str(out)


def hand_loop(args, model_path: str) -> float:
    """Tokens/s of the plainest correct loop: forward, loss, backward, clip, AdamW step."""
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    model.train()
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=args.mixed_precision == "bf16")
    blocks = token_blocks(documents(DataSource(files=[args.data])), AutoTokenizer.from_pretrained(model_path), args.seq_len)
    blocks = blocks.with_format("torch")[:]["input_ids"].to(device)  # [n_blocks, seq_len]
    optimizer = make_optimizer(model, load_config(DEMO, [f"model={model_path}", f"data.train.files=[{args.data}]"]).optim)
    tokens_per_step = args.seq_len * args.micro_batch * args.grad_accum
    start = 0.0
    for step in range(args.steps):
        if step == args.warmup:
            _sync()
            start = time.perf_counter()
        for i in range(args.grad_accum):
            first = ((step * args.grad_accum + i) * args.micro_batch) % (len(blocks) - args.micro_batch)
            ids = blocks[first:first + args.micro_batch]
            with autocast:
                logits = model(input_ids=ids).logits
            loss_sum, n = lm_loss_sum(logits, ids)
            (loss_sum / (n * args.grad_accum)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _sync()
    return (args.steps - args.warmup) * tokens_per_step / (time.perf_counter() - start)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def trainer(args, model_path: str, run_dir: Path) -> float:
    """Tokens/s of uptrain.train over the same steps, from its own metrics log."""
    tokens_per_step = args.seq_len * args.micro_batch * args.grad_accum
    overrides = [f"model={model_path}", f"run_dir={run_dir}", f"data.train.files=[{args.data}]",
                 f"data.seq_len={args.seq_len}", f"batch.micro_batch={args.micro_batch}",
                 f"batch.grad_accum={args.grad_accum}", f"budget.tokens={args.steps * tokens_per_step}",
                 "eval.every=0", "eval.max_batches=1", "checkpoint.every=0", f"seed={args.seed}",
                 "data.repeat_data=true", "overwrite=true", f"mixed_precision={args.mixed_precision}"]
    train(load_config(DEMO, overrides))
    # Each record's tok_per_s is tokens / seconds since the loop started: recover the seconds.
    records = [r for r in MetricsLog(run_dir / "metrics.jsonl", True).read() if "loss" in r]
    elapsed = {r["step"]: r["tokens"] / r["tok_per_s"] for r in records}
    return (args.steps - args.warmup) * tokens_per_step / (elapsed[args.steps] - elapsed[args.warmup])


def startup(args, model_path: str, run_dir: Path) -> dict[str, float]:
    """Seconds from launching `python -m uptrain.train` (a fresh process, as a user runs it) to
    the printed plan (imports, checks, data, model: set-up done) and to the first step's metrics
    record (after the step-0 validation and step 1), and the whole run; separate from steady state."""
    overrides = [f"model={model_path}", f"run_dir={run_dir}", f"data.train.files=[{args.data}]",
                 f"data.seq_len={args.seq_len}", f"batch.micro_batch={args.micro_batch}",
                 f"batch.grad_accum={args.grad_accum}", f"budget.tokens={2 * args.seq_len * args.micro_batch * args.grad_accum}",
                 "eval.every=0", "eval.max_batches=1", "checkpoint.every=0", "overwrite=true", "log.progress_bar=false", "optim.warmup_steps=0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    err_file = run_dir.parent / "startup-stderr.txt"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "uptrain.train", str(DEMO), *overrides], stdout=subprocess.PIPE,
                            stderr=err_file.open("w"), text=True, env=env)
    marks, metrics = {}, run_dir / "metrics.jsonl"

    def read_stdout() -> None:  # the plan line is printed once set-up is done
        for line in proc.stdout:
            if line.startswith("plan:") and "plan" not in marks:
                marks["plan"] = time.perf_counter() - t0

    reader = threading.Thread(target=read_stdout)
    reader.start()
    while proc.poll() is None:
        if "first_step" not in marks and metrics.is_file() and '"loss"' in metrics.read_text():
            marks["first_step"] = time.perf_counter() - t0
        time.sleep(0.05)
    reader.join()
    err = err_file.read_text()
    marks["total"] = time.perf_counter() - t0
    assert proc.returncode == 0 and "plan" in marks and "first_step" in marks, (proc.returncode, marks, err[-2000:])
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--hidden", type=int, default=0, help="random model of this width (0: the model as is)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    parser.add_argument("--work", default=None, help="folder for the temporary model and runs")
    parser.add_argument("--startup-only", action="store_true", help="only the launch-to-first-step timing")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="device peak (bf16 dense) for MFU")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        model_path = random_model(args.model, args.hidden, args.layers, Path(tmp) / "model") if args.hidden else args.model
        marks = startup(args, model_path, Path(tmp) / "startup")
        print(f"startup (fresh process, load average {os.getloadavg()[0]:.1f}): plan printed after {marks['plan']:.1f} s, "
              f"first step recorded after {marks['first_step']:.1f} s, 2-step run {marks['total']:.1f} s")
        if args.startup_only:
            return
        reference = AutoModelForCausalLM.from_pretrained(model_path)
        n_params = sum(p.numel() for p in reference.parameters())
        per_token = model_flops_per_token(reference, args.seq_len)  # uptrain/train/report/mfu.py: 6N + attention
        hand, ours = [], []
        for _ in range(args.repeats):  # interleaved, so drifts in machine load hit both alike
            hand.append(hand_loop(args, model_path))
            ours.append(trainer(args, model_path, Path(tmp) / "run"))
    h, o = statistics.median(hand), statistics.median(ours)
    print("\n| model | params | seq_len x micro x accum | hand loop tok/s | trainer tok/s | overhead |")
    print("|---|---|---|---|---|---|")
    print(f"| {'random Llama w' + str(args.hidden) if args.hidden else Path(args.model).name} | {n_params:,} | "
          f"{args.seq_len} x {args.micro_batch} x {args.grad_accum} | {h:,.0f} | {o:,.0f} | {(h - o) / h:+.1%} |")
    print(f"runs (tok/s): hand {[round(x) for x in hand]}, trainer {[round(x) for x in ours]}; threads {torch.get_num_threads()}")
    if args.peak_tflops:
        for name, rate in (("hand loop", h), ("trainer", o)):
            print(f"MFU {name}: {mfu(rate, per_token, args.peak_tflops):.1%} "
                  f"({rate * per_token / 1e12:.0f} TFLOP/s of {args.peak_tflops:.0f})")


if __name__ == "__main__":
    main()
