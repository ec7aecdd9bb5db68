"""One uptraining recipe for the demo and the sweep (issue 60): which peak learning rate and
distillation share, measured on two models with loss and KL side by side.

    python scripts/paper/prepare.py --out runs/paper-split --flat   # the reference model's split, once
    python scripts/studies/one_recipe.py --jobs 2                   # every cell; rerun to continue
    python scripts/studies/one_recipe.py --report                   # the table (markdown) from the record

Before this study the demo uptrained at lr 1e-3 (the bundled model) or 1e-4 (a model of yours) with
alpha_kd 1.0 and 10 warm-up steps, and `sweep --uptrain-tokens` at lr 3e-4, alpha_kd 0.9, no warm-up
and weight decay 0.1 (the recipe study's choice on the reference model at 73,728 tokens). Here both
start from the converter's quality path at 2 K/V heads (`--method fit --grouping similar --calib
TRAIN --calib-tokens 16384 --refine`) and uptrain for --tokens tokens in the demo's frame
(configs/demo-cpu.yaml: 128-token blocks, 8 x 2 per step, cosine to 1/10) with each (lr, alpha_kd,
warm-up, weight decay) cell, distilled from the source; each end is scored by `uptrain.eval
--reference SOURCE` on held-out text (loss and KL to the source). One thread per run, seed 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "runs" / "one-recipe"
MODELS = {  # name -> (source, training and calibration text, held-out text)
    "stories260K-mha8": (REPO / "examples/stories260K-mha8", REPO / "examples/data/tinystories-train-sample.txt",
                         REPO / "examples/data/tinystories-valid-sample.txt"),
    "reference-mha8": (REPO / "results/paper/reference-mha8", REPO / "runs/paper-split/train.jsonl",
                       REPO / "runs/paper-split/val40.jsonl"),
}
# name -> overrides of configs/demo-cpu.yaml (after the model, texts, teacher and budget).
CELLS = {
    "lr1e-4-kd1.0": ["optim.lr=1e-4", "distill.alpha_kd=1.0"],
    "lr3e-4-kd1.0": ["optim.lr=3e-4", "distill.alpha_kd=1.0"],
    "lr1e-3-kd1.0": ["optim.lr=1e-3", "distill.alpha_kd=1.0"],
    "lr1e-4-kd0.9": ["optim.lr=1e-4", "distill.alpha_kd=0.9"],
    "lr3e-4-kd0.9": ["optim.lr=3e-4", "distill.alpha_kd=0.9"],
    "lr1e-3-kd0.9": ["optim.lr=1e-3", "distill.alpha_kd=0.9"],
    "sweep-recipe": ["optim.lr=3e-4", "distill.alpha_kd=0.9", "optim.warmup_steps=0", "optim.weight_decay=0.1"],
}


def start(model: str) -> Path:
    """The quality-path conversion of `model` to 2 K/V heads (made once)."""
    source, train, _ = MODELS[model]
    out = RUNS / model / "start-kv2"
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "uptrain.convert", str(source), "--kv-heads", "2", "--method", "fit",
                        "--grouping", "similar", "--calib", str(train), "--calib-tokens", "16384", "--refine",
                        "--threads", "2", "--out", str(out)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return out


def score(folder: Path, model: str) -> dict:
    """`uptrain.eval FOLDER --reference SOURCE` on the held-out text: loss and KL to the source."""
    source, _, valid = MODELS[model]
    done = subprocess.run([sys.executable, "-m", "uptrain.eval", str(folder), "--reference", str(source),
                           "--data", str(valid), "--threads", "1", "--json", "-"], cwd=REPO, check=True,
                          capture_output=True, text=True)
    row = json.loads(done.stdout)[0]
    return {k: row[k] for k in ("loss", "kl_to_source", "top1_agreement", "loss_vs_source")}


def run_cell(model: str, cell: str, tokens: int) -> dict:
    """Uptrain the model's start with one cell's overrides, then score it."""
    source, train, valid = MODELS[model]
    run_dir = RUNS / model / cell
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "uptrain.train", "configs/demo-cpu.yaml", f"model={start(model)}",
                    f"run_dir={run_dir}", "overwrite=true", f"data.train.files=[{train}]",
                    f"data.val.files=[{valid}]", f"distill.teacher={source}", f"budget.tokens={tokens}",
                    "threads=1", "log.log_with=[]", "log.progress_bar=false", "eval.every=0",
                    "checkpoint.every=0", *CELLS[cell]], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - began
    return {"model": model, "cell": cell, "overrides": CELLS[cell], "tokens": tokens,
            "train_seconds": round(seconds, 1), **score(run_dir / "model", model)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record", type=Path, default=REPO / "results" / "one-recipe.json")
    p.add_argument("--tokens", type=int, default=400_000, help="uptraining tokens per cell (the demo's budget)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--report", action="store_true")
    args = p.parse_args()
    records = json.loads(args.record.read_text()) if args.record.is_file() else []
    if args.report:
        return report(records)
    models = args.models.split(",")
    for m in models:
        start(m)
    done = {(r["model"], r["cell"]) for r in records}
    for m in models:
        if (m, "start") not in done:
            records.append({"model": m, "cell": "start", "tokens": 0, **score(start(m), m)})
    todo = [(m, c) for m in models for c in CELLS if (m, c) not in done]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for f in concurrent.futures.as_completed([pool.submit(run_cell, m, c, args.tokens) for m, c in todo]):
            records.append(f.result())
            print(json.dumps(records[-1]), flush=True)
            args.record.write_text(json.dumps(records, indent=1) + "\n")
    args.record.write_text(json.dumps(records, indent=1) + "\n")


def report(records: list[dict]) -> None:
    """One row per cell; per model its loss (vs source) and KL; the mean rank over both scores."""
    models = sorted({r["model"] for r in records})
    print("| cell | " + " | ".join(f"{m} loss (- source, nats) | {m} KL" for m in models) + " |")
    print("|---" * (1 + 2 * len(models)) + "|")
    for cell in ["start", *CELLS]:
        rows = {r["model"]: r for r in records if r["cell"] == cell}
        cells = [f"{rows[m]['loss']:.4f} ({rows[m]['loss_vs_source']:+.4f}) | {rows[m]['kl_to_source']:.4f}"
                 if m in rows else "— | —" for m in models]
        print(f"| {cell} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
