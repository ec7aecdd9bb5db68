"""Tables and plots of the paper reproduction from results/paper/*.json (written by run.py).

    python scripts/paper/report.py [--results results/paper] [--runs runs/paper]

Writes RESULTS/TABLE.md, alpha.csv, quality-vs-alpha.png and loss-curves.png. Works on partial
results: missing cells show as "-". The loss curves need the training runs' metrics in RUNS; an
existing loss-curves.png is redrawn only when all of them are there (a clone has none).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's uptrain
from uptrain.measure.plots import plot_quality_vs_alpha, plot_training_runs, read_metrics

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results" / "paper"
RUNS = REPO / "runs" / "paper"
KVS, METHODS, ALPHAS = (4, 2, 1), ("mean", "first", "random"), (0.0, 0.025, 0.05, 0.1)


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"  # RESULTS as main() set it
    return json.loads(path.read_text()) if path.exists() else None


def cell(record: dict | None) -> str:
    return f"{record['val_loss']:.3f}" if record else "-"


def main(argv: list[str] | None = None) -> None:
    global RESULTS, RUNS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="folder of NAME.json scores, written to")
    p.add_argument("--runs", type=Path, default=RUNS, help="folder of the training runs (for the loss curves)")
    args = p.parse_args(argv)
    RESULTS, RUNS = args.results, args.runs
    mha = load("mha")
    rows = []
    lines = ["| K/V heads | method | " + " | ".join(f"alpha = {a}" for a in ALPHAS) + " |",
             "|---|---|" + "---|" * len(ALPHAS)]
    if mha:
        control = [mha] + [load(f"kv8-mha-alpha{a}") for a in ALPHAS[1:]]
        lines.append(f"| 8 (MHA reference, pretrained on T = {mha['pretrain_tokens']:,} tokens; "
                     f"control: trained alpha x T more) | mha | " + " | ".join(cell(r) for r in control) + " |")
        rows += [{"kv": 8, "method": "mha (control)", "alpha": a, "val_loss": r["val_loss"]}
                 for a, r in zip(ALPHAS, control) if r]
    for kv in KVS:
        for method in METHODS:
            records = [load(f"kv{kv}-{method}-alpha{0 if a == 0 else a}") for a in ALPHAS]
            rows += [{"kv": kv, "method": method, "alpha": a, "val_loss": r["val_loss"]}
                     for a, r in zip(ALPHAS, records) if r]
            lines.append(f"| {kv} | {method} | " + " | ".join(cell(r) for r in records) + " |")
    stories = [("stories260K-gqa4 (original, 4 K/V heads)", load("stories-gqa4"))]
    for kv in (2, 1):
        stories += [(f"-> {kv} K/V heads, converted (mean)", load(f"stories-kv{kv}-converted")),
                    (f"-> {kv} K/V heads, uptrained 1M tokens", load(f"stories-kv{kv}-uptrained"))]
    lines += ["", "| stories260K model | val loss (tinystories-valid-sample.txt) |", "|---|---|"]
    lines += [f"| {name} | {cell(r)} |" for name, r in stories]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "TABLE.md").write_text("\n".join(lines) + "\n")
    with open(RESULTS / "alpha.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["kv", "method", "alpha", "val_loss"])
        writer.writeheader()
        writer.writerows(rows)
    if rows:
        plot_quality_vs_alpha(rows, RESULTS / "quality-vs-alpha.png", mha["val_loss"] if mha else None)
    curves = {"MHA pretraining": RESULTS / "pretrain-metrics.jsonl"}
    curves |= {f"kv{kv} mean, alpha {a}": RUNS / f"kv{kv}-mean" / f"alpha{a}" / "metrics.jsonl"
               for kv in KVS for a in (0.1, 0.05)}
    present = {label: read_metrics(p) for label, p in curves.items() if p.exists()}
    if present and (len(present) == len(curves) or not (RESULTS / "loss-curves.png").exists()):
        plot_training_runs(present, RESULTS / "loss-curves.png")
    print((RESULTS / "TABLE.md").read_text())


if __name__ == "__main__":
    main()
