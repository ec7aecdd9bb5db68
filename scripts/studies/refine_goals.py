"""Issue 24's two goals measured with layer-wise reconstruction (refine) before uptraining;
numbers for results/refine-uptrain.md.

    PYTHONPATH=$PWD python scripts/studies/refine_goals.py reference [--steps 1200]   # goal A
    PYTHONPATH=$PWD python scripts/studies/refine_goals.py stories --steps 1200 300 --tokens 399360 200704 100352  # goal B
    PYTHONPATH=$PWD python scripts/studies/refine_goals.py report

reference (goal A): results/paper/reference-mha8 converted with recipe_study's `start_model`
(fit + calib, 16,384 tokens of runs/paper/data/train.jsonl, which this writes with
scripts/paper/prepare.py's split of examples/data/paper), refined as scripts/studies/refine_study.py
refines it, saved to runs/recipe/start/kvK-fit-refine, then uptrained and scored by
recipe_study's `run_cell` (the recipe study's recipe, its 16 validation batches of 16 x 256
tokens of runs/paper/data/val.jsonl) at alpha 0 and 0.005, with the MHA control and the plain fit
+ calib starts at 0.005. Records: results/refine-uptrain-reference.json (recipe_study's format).

stories (goal B): the demo's conversion (examples/stories260K-mha8 -> 2 K/V heads, fit, similar
grouping, calibrated on 16,384 tokens of the training sample), refined (timed) and saved, scored
with the demo's own `held_out_loss` (examples/data/tinystories-valid-sample.txt, 512-token
windows, stride 256), then uptrained as the demo uptrains (configs/demo-cpu.yaml, distillation
from the MHA source at alpha_kd 1.0, the demo's data overrides) for each --tokens budget and
scored again. Rows: results/refine-uptrain-stories.jsonl (JSON lines).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "studies"))  # recipe_study, refine_study
sys.path.insert(0, str(REPO / "scripts" / "paper"))

import recipe_study as rs  # noqa: E402
from refine_study import save_refined, sequences_of  # noqa: E402

from uptrain.convert import convert  # noqa: E402
from uptrain.convert.layers.calibrate import Calibration  # noqa: E402
from uptrain.convert.math.refine import refine_model  # noqa: E402
from uptrain.measure.eval import load_model  # noqa: E402

RECIPE = ["optim.lr=3e-4", "optim.warmup_steps=0", f"distill.teacher={rs.TEACHER}", "distill.alpha_kd=0.9"]
REF_JSON = REPO / "results" / "refine-uptrain-reference.json"
STORIES_JSONL = REPO / "results" / "refine-uptrain-stories.jsonl"
OUT = REPO / "runs" / "refine-goals"


def refine_folder(source: Path, folder: Path, calib: Path, out: Path, steps: int) -> dict:
    """Refine the converted `folder` towards `source` on the first 16,384 tokens of `calib`; save to `out`."""
    original, tokenizer = load_model(str(source), dtype="float32")
    converted = load_model(str(folder), dtype="float32", with_tokenizer=False)[0]
    seqs = sequences_of(tokenizer, calib, 16384, min(2048, original.config.max_position_embeddings))
    t0 = time.perf_counter()
    results = refine_model(original, converted, seqs, steps=steps, seed=0, log=lambda m: print("  " + m, flush=True))
    seconds = time.perf_counter() - t0
    save_refined(converted, folder, out)
    return dict(steps=steps, refine_seconds=round(seconds, 1), load=os.getloadavg(),
                layers=[r.as_dict() for r in results])


def reference(steps: int, extra_lr: list[float]) -> None:
    from prepare import split_corpora
    if not rs.TRAIN.exists():
        split_corpora(REPO / "examples" / "data" / "paper", rs.TRAIN.parent, val_share=0.05)
    for kv in (4, 1):
        out = rs.RUNS / "start" / f"kv{kv}-fit-refine"
        if not (out / "config.json").exists():
            info = refine_folder(rs.REFERENCE, rs.start_model(f"kv{kv}-fit"), rs.TRAIN, out, steps)
            print(f"kv{kv} refined in {info['refine_seconds']} s, load {info['load']}", flush=True)
            (out / "refine.json").write_text(json.dumps(info, indent=1) + "\n")
    cells = [(rs.CONTROL, 0.005, RECIPE), ("kv4-fit-refine", 0.0, []), ("kv4-fit-refine", 0.005, RECIPE),
             ("kv1-fit-refine", 0.0, []), ("kv1-fit-refine", 0.005, RECIPE),
             ("kv4-fit", 0.005, RECIPE), ("kv1-fit", 0.005, RECIPE)]
    cells += [(f"kv{kv}-fit-refine", 0.005, rs.merged(RECIPE, [f"optim.lr={lr:g}"])) for lr in extra_lr for kv in (4, 1)]
    records = rs.load_records(REF_JSON)
    rs.run_cells(REF_JSON, [c for c in cells if rs.cell_key(*c) not in records], 16, 1, 1)


def uptrain(model: Path, run_dir: Path, tokens: int) -> float:
    """The demo's uptraining (uptrain/demo.py's overrides of configs/demo-cpu.yaml) from `model`; seconds."""
    from uptrain.demo import CONFIG, EXAMPLES, TRAIN, VALID
    args = [sys.executable, "-m", "uptrain.train", str(CONFIG), f"model={model}", f"run_dir={run_dir}",
            "overwrite=true", f"data.train.files=[{TRAIN}]", f"data.val.files=[{VALID}]",
            f"distill.teacher={EXAMPLES / 'stories260K-mha8'}", "distill.alpha_kd=1.0", "threads=1",
            f"budget.tokens={tokens}", "log.log_with=[]", "log.progress_bar=false"]
    t0 = time.perf_counter()
    subprocess.run(args, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def stories(steps_list: list[int], budgets: list[int], plain: bool, refined: bool, out: Path = OUT,
            rows: Path = STORIES_JSONL) -> None:
    from uptrain.data import DataSource, read_documents
    from uptrain.demo import EXAMPLES, TRAIN, VALID, held_out_loss
    source = EXAMPLES / "stories260K-mha8"
    valid = read_documents(DataSource(files=[str(VALID)]))
    start = out / "stories-kv2-fit-similar"
    starts = [(f"fit+calib+similar+refine{s}", out / f"stories-kv2-refine{s}", s) for s in steps_list] if refined else []

    def write(row: dict) -> None:
        row |= dict(load_now=os.getloadavg(), machine=f"{os.cpu_count()} cores", torch=torch.__version__)
        print(json.dumps({k: v for k, v in row.items() if k != "layers"}), flush=True)
        with open(rows, "a") as f:
            f.write(json.dumps(row) + "\n")

    if not (start / "config.json").exists():  # a rerun reuses the start and the refined folders
        t0 = time.perf_counter()
        convert(str(source), start, 2, "fit", force=True, calibration=Calibration(TRAIN, 16384, "cpu"),
                grouping="similar")
        write(dict(model="source", loss=held_out_loss(source, valid)[0]))
        write(dict(model="fit+calib+similar", convert_seconds=round(time.perf_counter() - t0, 1),
                   loss=held_out_loss(start, valid)[0]))
    for name, folder, steps in starts:
        if not (folder / "config.json").exists():
            info = refine_folder(source, start, TRAIN, folder, steps)
            write(dict(model=name, loss=held_out_loss(folder, valid)[0], **info))
    if plain:
        starts.append(("fit+calib+similar", start, 0))
    for tokens in budgets:
        for name, folder, _ in starts:
            run_dir = out / f"uptrain-{folder.name}-{tokens}"
            seconds = uptrain(folder, run_dir, tokens)
            finished = json.loads((run_dir / "finished.json").read_text())
            write(dict(model=f"{name} + demo uptraining", tokens=tokens, trained_tokens=finished["tokens"],
                       steps_trained=finished["steps"], uptrain_seconds=round(seconds, 1),
                       loss=held_out_loss(run_dir / "model", valid)[0]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("goal", choices=["reference", "stories", "report"])
    p.add_argument("--steps", type=int, nargs="+", default=[1200], help="refine step caps")
    p.add_argument("--tokens", type=int, nargs="+", default=[400000], help="stories: uptraining budgets")
    p.add_argument("--plain", action="store_true", help="stories: also uptrain the unrefined start")
    p.add_argument("--out", type=Path, help="stories: work here and write the rows to OUT/rows.jsonl (a timing run)")
    p.add_argument("--no-refined", action="store_true", help="stories: uptrain only the unrefined start (--plain)")
    p.add_argument("--extra-lr", type=float, nargs="*", default=[],
                   help="reference: also uptrain the refined starts at alpha 0.005 with these peak lrs")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.goal == "reference":
        reference(args.steps[0], args.extra_lr)
    elif args.goal == "stories":
        extra = dict(out=args.out, rows=args.out / "rows.jsonl") if args.out else {}
        stories(args.steps, args.tokens, args.plain, not args.no_refined, **extra)
    else:
        records = rs.load_records(REF_JSON)
        control = records[rs.cell_key(rs.CONTROL, 0.005, RECIPE)]["val_loss"]
        print("| start | alpha | overrides | val loss | vs control | steps | tokens | seconds |\n|---|---|---|---|---|---|---|---|")
        for r in records.values():
            print(f"| {r['start']} | {r['alpha']} | {' '.join(r['overrides'])} | {r['val_loss']:.4f} "
                  f"| {(r['val_loss'] - control) / control:+.2%} | {r['steps']} | {r['tokens']} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
