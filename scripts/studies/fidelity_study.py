"""Fidelity beside the loss, at every K/V count, for every start and after a short uptraining.

    python scripts/studies/fidelity_study.py --model stories --out runs/fidelity      # the bundled stories260K-mha8
    python scripts/studies/fidelity_study.py --model reference --out runs/fidelity    # results/paper/reference-mha8
    python scripts/studies/fidelity_study.py --table runs/fidelity                    # results/fidelity.json + tables

Everything runs through `uptrain.sweep` (so each number is what a user gets from it, scored against
the source by `uptrain.eval --reference`'s code): per model, at every K/V count below the source's,

1. `--method fit --grouping similar --calib T --refine --baseline mean`: mean pooling and the
   project's start (fit + calibration + refine);
2. the same without `--refine`: fit + calibration alone;
3. a copy of (1) continued with `--uptrain-tokens N` and the recipe (configs/paper/uptrain.yaml),
   once per distillation weight `distill.alpha_kd` in 0 (no distillation), 0.9 (the recipe's) and 1.0
   (pure distillation): every converted folder of both methods uptrained and scored again.

`--table` gathers the sweeps' records into results/fidelity.json and prints the markdown tables of
results/fidelity.md, with the places where the ranking by loss and the ranking by KL disagree.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from itertools import combinations
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ALPHAS = (0.0, 0.9, 1.0)
MODELS = {  # name: (checkpoint, held-out text, calibration / training text, uptraining tokens)
    "stories": ("examples/stories260K-mha8", "examples/data/tinystories-valid-sample.txt",
                "examples/data/tinystories-train-sample.txt", 40960),
    "reference": ("results/paper/reference-mha8", "runs/paper-split/val40.jsonl", "runs/paper-split/train.jsonl",
                  12288),
}


def _sweep(args: list[str]) -> None:
    command = [sys.executable, "-m", "uptrain.sweep", *args]
    print("$ " + " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=REPO, check=True)


def _reference_split() -> None:
    """The paper reproduction's split of the shipped corpora (results/sweep.md), its first 40 held-out documents."""
    split = REPO / "runs" / "paper-split"
    if (split / "val40.jsonl").is_file():
        return
    sys.path.insert(0, str(REPO / "scripts" / "paper"))
    from prepare import split_corpora

    split_corpora(REPO / "examples" / "data" / "paper", split, val_share=0.05)
    lines = (split / "val.jsonl").read_text().splitlines()[:40]
    (split / "val40.jsonl").write_text("\n".join(lines) + "\n")


def run(model: str, out: Path, threads: int) -> None:
    checkpoint, held_out, calib, tokens = MODELS[model]
    if model == "reference":
        _reference_split()
    common = [checkpoint, "--data", held_out, "--calib", calib, "--calib-tokens", "16384", "--method", "fit",
              "--grouping", "similar", "--kv-heads", "all", "--threads", str(threads)]
    start = out / model
    _sweep([*common, "--refine", "--baseline", "mean", "--out", str(start)])
    _sweep([*common, "--out", str(out / f"{model}-fit")])
    for alpha in ALPHAS:
        folder = out / f"{model}-kd{alpha:g}"
        if not folder.exists():  # the conversions of (1) kept (the sweep's record proves them the same)
            shutil.copytree(start, folder, symlinks=True)
        _sweep([*common, "--refine", "--baseline", "mean", "--out", str(folder), "--uptrain-tokens", str(tokens),
                "--uptrain-set", f"distill.alpha_kd={alpha:g}"])


FIELDS = ("loss", "kl_to_source", "top1_agreement", "greedy_agreement", "greedy_prefix")


def _points(folder: Path) -> list[dict]:
    return json.loads((folder / "sweep.json").read_text())["points"]


def _rows(out: Path, model: str) -> list[dict]:
    """One row per (K/V count, start): the fields before and after each uptraining."""
    rows = []
    starts = {"mean": ("mean", out / model), "fit + calib": ("fit", out / f"{model}-fit"),
              "fit + calib + refine": ("fit+refine", out / model)}
    for start, (method, folder) in starts.items():
        for p in _points(folder)[1:]:
            if p["method"] != method:
                continue
            row = {"model": model, "kv_heads": p["kv_heads"], "start": start, "uptrained": None,
                   **{k: p[k] for k in FIELDS}}
            rows.append(row)
            if start == "fit + calib":
                continue
            for alpha in ALPHAS:
                done = next(q for q in _points(out / f"{model}-kd{alpha:g}") if q["label"] == p["label"])
                after = done["fidelity_after_uptraining"] or {}
                rows.append({**row, "uptrained": {"tokens": done["uptrain_tokens"], "alpha_kd": alpha},
                             "loss": done["loss_after_uptraining"], **{k: after.get(k) for k in FIELDS[1:]}})
    return rows


def _name(row: dict) -> str:
    u = row["uptrained"]
    return row["start"] + ("" if u is None else f", uptrained {u['tokens']:,} tok, alpha_kd {u['alpha_kd']:g}")


def _table(rows: list[dict]) -> str:
    lines = ["| K/V heads | model | loss | KL to source | top-1 agr. | greedy agr. | greedy prefix |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -r["kv_heads"]):
        lines.append(f"| {r['kv_heads']} | {_name(r)} | {r['loss']:.4f} | {r['kl_to_source']:.4f} | "
                     f"{r['top1_agreement']:.1%} | {r['greedy_agreement']:.1%} | {r['greedy_prefix']:.1f} |")
    return "\n".join(lines)


def disagreements(rows: list[dict]) -> list[str]:
    """Pairs at one K/V count that the loss and the KL order differently (ties of 1e-4 left out):
    the starts against each other, and each start's uptrainings against it and each other."""
    said = []
    for count in sorted({r["kv_heads"] for r in rows}, reverse=True):
        same = [r for r in rows if r["kv_heads"] == count]
        for a, b in combinations(same, 2):
            if a["start"] != b["start"] and (a["uptrained"] or b["uptrained"]):
                continue
            dl, dk = a["loss"] - b["loss"], a["kl_to_source"] - b["kl_to_source"]
            if abs(dl) > 1e-4 and abs(dk) > 1e-4 and (dl > 0) != (dk > 0):
                lower_loss, lower_kl = (a, b) if dl < 0 else (b, a), (a, b) if dk < 0 else (b, a)
                said.append(f"kv{count}: {_name(lower_loss[0])} has the lower loss ({lower_loss[0]['loss']:.4f} vs "
                            f"{lower_loss[1]['loss']:.4f}), {_name(lower_kl[0])} the lower KL "
                            f"({lower_kl[0]['kl_to_source']:.4f} vs {lower_kl[1]['kl_to_source']:.4f})")
    return said


def table(out: Path) -> None:
    done = [m for m in MODELS if all((out / f / "sweep.json").is_file()
                                     for f in (m, f"{m}-fit", *(f"{m}-kd{a:g}" for a in ALPHAS)))]
    records = {m: _rows(out, m) for m in done}
    (REPO / "results" / "fidelity.json").write_text(json.dumps(records, indent=1) + "\n")
    for model, rows in records.items():
        print(f"\n## {model}\n\n{_table(rows)}\n\nWhere loss and KL rank differently:\n")
        print("\n".join(f"- {line}" for line in disagreements(rows)) or "- nowhere")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS))
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "fidelity")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--table", type=Path, metavar="OUT", help="gather OUT's sweeps into results/fidelity.json")
    args = parser.parse_args()
    if args.table:
        table(args.table)
    else:
        run(args.model, args.out, args.threads)


if __name__ == "__main__":
    main()
