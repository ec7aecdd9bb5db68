"""The uptraining recipe study (issue 13): which learning rate, schedule, trainable set and
distillation win the quality back on the paper-reproduction reference model.

    python scripts/paper/prepare.py --out runs/paper          # data split (once, ~20 s)
    python scripts/studies/recipe_study.py --jobs 2                    # every stage; rerun to continue
    python scripts/studies/recipe_study.py --report                    # the tables (markdown) from the JSON
    python scripts/studies/recipe_study.py --final --jobs 2            # the chosen recipe on every start
    python scripts/studies/recipe_study.py --final --report

Starts: `results/paper/reference-mha8` converted to 4 and 1 K/V heads with `--method mean` (the
paper's) and `--method fit --calib` (16,384 tokens of the training split), plus the MHA model
itself as the control. Each run is `python -m uptrain.train configs/paper/uptrain.yaml` with
budget.fraction = alpha (default 0.025) and the overrides of one variant; its score is the
trainer's final validation loss on the first `--val-batches` x 16 blocks of 256 tokens of
runs/paper/data/val.jsonl (the same blocks for every run, so differences are paired).

The stages are greedy, one thing at a time: stage 1 varies the peak learning rate from the
paper recipe (pre-training peak 1e-3, 1/3, 1/10 = the pre-training final LR, 1/30); every later
stage starts from the best variant so far (lowest mean loss over the GQA starts) and varies one
more thing: warm-up and schedule, then what is trained, then distillation from the MHA model.
Each finished run leaves its record in the JSON, so a rerun skips it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "runs" / "recipe"
REFERENCE = REPO / "results" / "paper" / "reference-mha8"
TEACHER = "results/paper/reference-mha8"  # as the trainer reads it (its cwd is the repository root)
TRAIN = REPO / "runs" / "paper" / "data" / "train.jsonl"
T_TOKENS = 2_998_272  # the reference model's pre-training tokens
CONFIG = "configs/paper/uptrain.yaml"
# The paper's recipe, spelled out so that every variant starts from it whatever the YAML's
# defaults are now (the YAML carries the study's winner): pre-training peak lr, 10 warm-up steps,
# cosine to 1/10, everything trained, no teacher.
PAPER_RECIPE = ["optim.lr=1e-3", "optim.warmup_steps=10", "optim.min_lr_ratio=0.1", "optim.schedule=cosine",
                "trainable=all", "distill.teacher=null"]
GQA_STARTS = ("kv4-mean", "kv4-fit", "kv1-mean", "kv1-fit")
CONTROL = "mha"

# Stage -> variants; each variant is a list of key=value overrides on top of the best so far.
# "same" keeps the best so far unchanged (re-scored only when it is a new cell).
STAGES: list[tuple[str, dict[str, list[str]]]] = [
    ("peak learning rate", {
        "lr 1e-3 (paper: pre-training peak)": ["optim.lr=1e-3"],
        "lr 3e-4 (1/3)": ["optim.lr=3e-4"],
        "lr 1e-4 (1/10 = pre-training final)": ["optim.lr=1e-4"],
        "lr 3e-5 (1/30)": ["optim.lr=3e-5"],
    }),
    ("warm-up and schedule", {
        "warm-up 0": ["optim.warmup_steps=0"],
        "wsd: constant, then linear decay over the last 20%": ["optim.schedule=wsd", "optim.decay_fraction=0.2"],
        "constant lr (min_lr_ratio 1)": ["optim.min_lr_ratio=1.0"],
    }),
    # `trainable=attention` is the same parameter set as `kv` on a Llama (no biases, no q/k norms).
    ("what is trained", {
        "kv (q/k/v/o) only": ["trainable=kv"],
        "staged: kv for 1/3, then all": ["trainable_stages=[{trainable: kv, tokens: 24576}]"],
    }),
    ("distillation from the MHA model", {
        "alpha_kd 0.5, T 1": [f"distill.teacher={TEACHER}", "distill.alpha_kd=0.5"],
        "alpha_kd 0.9, T 1": [f"distill.teacher={TEACHER}", "distill.alpha_kd=0.9"],
        "alpha_kd 1.0, T 1": [f"distill.teacher={TEACHER}", "distill.alpha_kd=1.0"],
        "alpha_kd 0.9, T 2": [f"distill.teacher={TEACHER}", "distill.alpha_kd=0.9", "distill.temperature=2"],
    }),
]
# Stages whose variants also run on the MHA control (distilling it from itself, or freezing
# parts of it, says nothing about GQA; the final recipe's control is run by --final).
CONTROL_STAGES = {"peak learning rate"}


def start_model(name: str) -> Path:
    """The model folder of a start `kv{K}-{method}[-similar]` (fit: calibrated; fitw: fit from the
    weights alone); converted with the project's CLI the first time."""
    if name == CONTROL:
        return REFERENCE
    out = RUNS / "start" / name
    if not (out / "config.json").exists():
        kv, method, *grouping = name.removeprefix("kv").split("-")
        calib = ["--calib", str(TRAIN), "--calib-tokens", "16384"] if method == "fit" else []
        method = "fit" if method == "fitw" else method  # fitw: the fit from the weights alone
        subprocess.run([sys.executable, "-m", "uptrain.convert", str(REFERENCE), "--kv-heads", kv,
                        "--method", method, *calib, "--grouping", grouping[0] if grouping else "contiguous",
                        "--seed", "0", "--out", str(out), "--force"],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return out


def cell_key(start: str, alpha: float, overrides: list[str]) -> str:
    return json.dumps([start, alpha, sorted(overrides)])


def load_records(path: Path) -> dict[str, dict]:
    """cell key -> record, from the study's JSON."""
    return {cell_key(r["start"], r["alpha"], r["overrides"]): r for r in load(path)}


def run_cell(start: str, alpha: float, overrides: list[str], val_batches: int | None, threads: int) -> dict:
    """One uptraining run; returns its record (final validation loss, seconds). alpha 0: the
    converted model's loss on the same blocks, from the step-0 validation of a one-step run."""
    tag = f"{start}-a{alpha}-{hashlib.sha1(cell_key(start, alpha, overrides).encode()).hexdigest()[:10]}"
    run_dir = RUNS / "cells" / tag
    at_start = alpha == 0
    budget = (["budget.fraction=null", "budget.tokens=4096", "optim.warmup_steps=0"] if alpha == 0
              else [f"budget.fraction={alpha}", f"budget.pretrain_tokens={T_TOKENS}"])
    args = [sys.executable, "-m", "uptrain.train", CONFIG, f"model={start_model(start)}", f"run_dir={run_dir}",
            "overwrite=true", f"eval.at_start={str(at_start).lower()}", f"eval.max_batches={val_batches or 'null'}",
            f"threads={threads}", "log.log_with=[]", "checkpoint.every=0", *PAPER_RECIPE, *budget, *overrides]
    began = time.perf_counter()
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{start} {overrides} failed:\n{done.stderr[-2000:]}")
    finished = json.loads((run_dir / "finished.json").read_text())
    record = {"start": start, "alpha": alpha, "overrides": sorted(overrides), "val_loss": finished["val_loss"],
              "steps": finished["steps"], "tokens": finished["tokens"],
              "seconds": round(time.perf_counter() - began, 1), "run_dir": os.path.relpath(run_dir, REPO)}
    if at_start:
        first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        record["val_loss_step0"] = record["val_loss"] = first["val_loss"]
    return record


def run_cells(path: Path, todo: list[tuple[str, float, list[str]]], val_batches: int | None, jobs: int,
              threads: int) -> None:
    """Run (start, alpha, overrides) cells `jobs` at a time; each record is saved as it finishes."""
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(run_cell, s, a, ov, val_batches, threads) for s, a, ov in todo]
        for f in concurrent.futures.as_completed(futures):
            r = f.result()
            save(path, {cell_key(r["start"], r["alpha"], r["overrides"]): r})
            print(f"  {r['start']:15s} alpha {r['alpha']} {' '.join(r['overrides']) or '(paper recipe)'}: "
                  f"{r['val_loss']:.4f} ({r['seconds']:.0f} s)", flush=True)


def stage_candidates(number: int, variants: dict[str, list[str]], best: list[str]) -> dict[str, list[str]]:
    """label -> overrides of a stage: the best so far (from stage 2 on), then each variant on top of it."""
    candidates = {"best so far": best} if number > 1 else {}
    return candidates | {label: merged(best, ov) for label, ov in variants.items()}


MIN_GAIN = 0.005  # nats: a variant must beat the best so far by more than this to replace it


def best_overrides(records: dict, stage_variants: list[list[str]], alpha: float) -> list[str]:
    """The variant of this stage with the lowest mean loss over the GQA starts; the best so far
    (the first candidate from stage 2 on) stays unless another beats it by more than MIN_GAIN,
    so a change within the noise does not make the recipe more complicated."""
    def mean_loss(ov: list[str]) -> float:
        losses = [records[cell_key(s, alpha, ov)]["val_loss"] for s in GQA_STARTS]
        return sum(losses) / len(losses)
    winner = min(stage_variants, key=mean_loss)
    incumbent = stage_variants[0]
    return winner if mean_loss(winner) < mean_loss(incumbent) - MIN_GAIN else incumbent


def merged(base: list[str], extra: list[str]) -> list[str]:
    """`base` overrides with those of `extra` replacing the same keys."""
    keys = {e.split("=", 1)[0] for e in extra}
    return [b for b in base if b.split("=", 1)[0] not in keys] + extra


def study(path: Path, alpha: float, val_batches: int, jobs: int, only_stages: int) -> None:
    for name in (CONTROL, *GQA_STARTS):
        start_model(name)
    threads = 1 if jobs > 1 else 2
    best: list[str] = []
    for number, (stage, variants) in enumerate(STAGES[:only_stages], start=1):
        candidates = stage_candidates(number, variants, best)
        starts = (*GQA_STARTS, CONTROL) if stage in CONTROL_STAGES else GQA_STARTS
        records = load_records(path)
        todo = [(s, alpha, ov) for ov in candidates.values() for s in starts
                if cell_key(s, alpha, ov) not in records]
        print(f"== stage {number}: {stage}: {len(todo)} runs to do", flush=True)
        run_cells(path, todo, val_batches, jobs, threads)
        best = best_overrides(load_records(path), list(candidates.values()), alpha)
        print(f"   best so far: {' '.join(best) or '(paper recipe)'}", flush=True)


FINAL_STARTS = tuple(f"kv{kv}-{m}" for kv in (4, 2, 1)
                     for m in ("mean", "first", "fitw", "fit", "fit-similar")) + (CONTROL,)


def final(path: Path, val_batches: int, jobs: int, threads: int, baselines_only: bool = False,
          recipe_only: bool = False) -> None:
    """The chosen recipe (the study's winner) on every start, scored like the study (same blocks,
    same JSON): the converted models (alpha 0), mean pooling under the paper recipe at alpha 0.1
    (the baseline to beat), the recipe at alpha 0.025 on every start, then at alpha 0.05 on the
    4- and 1-K/V-head starts and the control. `baselines_only`: the first two, which need no
    recipe (they can run while the study is still going); `recipe_only`: the others."""
    means = [s for s in FINAL_STARTS if s.endswith("-mean")]
    batches = [] if recipe_only else [[(s, 0.0, []) for s in FINAL_STARTS], [(s, 0.1, []) for s in means]]
    if not baselines_only:
        tuned = chosen_recipe(path)
        print(f"recipe: {' '.join(tuned)}", flush=True)
        batches += [[(s, 0.025, tuned) for s in FINAL_STARTS],
                    [(s, 0.05, tuned) for s in ("kv4-mean", "kv4-fit", "kv1-mean", "kv1-fit", CONTROL)]]
    for name in FINAL_STARTS:
        start_model(name)
    for batch in batches:
        records = load_records(path)
        run_cells(path, [b for b in batch if cell_key(*b) not in records], val_batches, jobs, threads)


def chosen_recipe(study_path: Path) -> list[str]:
    """The overrides the greedy stages of the study chose (all stages must be complete)."""
    records = load_records(study_path)
    best: list[str] = []
    for number, (_, variants) in enumerate(STAGES, start=1):
        candidates = list(stage_candidates(number, variants, best).values())
        missing = [c for c in candidates for s in GQA_STARTS if cell_key(s, 0.025, c) not in records]
        if missing:
            raise SystemExit(f"the study is not complete (stage {number}); run it first")
        best = best_overrides(records, candidates, 0.025)
    return best


def report_final(path: Path) -> None:
    """Markdown: one row per start; alpha 0, both recipes at 0.025 / 0.05 / 0.1 where run."""
    tuned = chosen_recipe(path)
    records = load_records(path)
    paper = ["optim.lr=1e-3"]  # stage 1's first row: the paper recipe itself
    columns = [(0.0, [], "alpha 0"), (0.025, paper, "paper, 0.025"), (0.025, tuned, "recipe, 0.025"),
               (0.05, tuned, "recipe, 0.05"), (0.1, [], "paper, 0.1")]
    shown = [o.replace(str(REPO) + "/", "") for o in tuned]
    print(f"recipe: `{' '.join(shown)}`\n")
    print("| start | " + " | ".join(c[2] for c in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for s in FINAL_STARTS:
        cells = [records.get(cell_key(s, a, ov)) for a, ov, _ in columns]
        print(f"| {s} | " + " | ".join(f"{c['val_loss']:.4f}" if c else "—" for c in cells) + " |")


def load(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.exists() else []


def save(path: Path, records: dict) -> None:
    """Merge `records` into the JSON (another study process may be writing it too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        merged_records = load_records(path) | records
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(list(merged_records.values()), indent=1) + "\n")
        tmp.replace(path)


def report(path: Path, alpha: float) -> None:
    """Markdown tables: one row per variant, one column per start, in stage order."""
    records = load_records(path)
    starts = (*GQA_STARTS, CONTROL)
    best: list[str] = []
    for number, (stage, variants) in enumerate(STAGES, start=1):
        candidates = stage_candidates(number, variants, best)
        print(f"\n**Stage {number}: {stage}** (on top of: `{' '.join(best) or 'paper recipe'}`)\n")
        print("| variant | " + " | ".join(starts) + " | mean of GQA |")
        print("|---" * (len(starts) + 2) + "|")
        for label, ov in candidates.items():
            cells = [records.get(cell_key(s, alpha, ov)) for s in starts]
            gqa = [c["val_loss"] for c, s in zip(cells, starts) if c and s != CONTROL]
            mean = f"{sum(gqa) / len(gqa):.4f}" if len(gqa) == len(GQA_STARTS) else "—"
            print(f"| {label} | " + " | ".join(f"{c['val_loss']:.4f}" if c else "—" for c in cells) + f" | {mean} |")
        if all(cell_key(s, alpha, ov) in records for ov in candidates.values() for s in GQA_STARTS):
            best = best_overrides(records, list(candidates.values()), alpha)
        else:
            break


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=REPO / "results" / "recipe-study.json")
    p.add_argument("--alpha", type=float, default=0.025, help="uptraining budget as a share of pre-training")
    p.add_argument("--val-batches", type=int, default=16, help="validation batches (x16 blocks of 256 tokens)")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (1 thread each when more than 1)")
    p.add_argument("--threads", type=int, help="CPU threads per run (default: 1 with --jobs > 1, else 2)")
    p.add_argument("--stages", type=int, default=len(STAGES), help="run the first N stages")
    p.add_argument("--report", action="store_true", help="print the tables from --results and stop")
    p.add_argument("--final", action="store_true",
                   help="after the study: its recipe on every start and alpha (same JSON)")
    p.add_argument("--baselines-only", action="store_true", help="--final: only the cells that need no recipe")
    p.add_argument("--recipe-only", action="store_true", help="--final: only the cells of the chosen recipe")
    args = p.parse_args()
    if args.final and args.report:
        report_final(args.results)
    elif args.final:
        final(args.results, args.val_batches, args.jobs, args.threads or (1 if args.jobs > 1 else 2), args.baselines_only,
              args.recipe_only)
    elif args.report:
        report(args.results, args.alpha)
    else:
        study(args.results, args.alpha, args.val_batches, args.jobs, args.stages)


if __name__ == "__main__":
    main()
