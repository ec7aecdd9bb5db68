"""Measure layer-wise reconstruction (`uptrain.convert.math.refine`) at alpha = 0; numbers for results/refine.md.

    PYTHONPATH=$PWD .venv/bin/python scripts/studies/refine_study.py --model stories --kv 2 1 [--json out.json]
    PYTHONPATH=$PWD .venv/bin/python scripts/studies/refine_study.py --model reference --kv 4 2 1
    # keep the refined model (a folder like the converter's) for uptraining: one combination -> DIR,
    # several -> DIR/kvK-START-steps..-lr..-batch..-INPUTS
    ... --model stories --kv 2 --starts fit --save runs/stories-kv2-refined
    # a sweep: every combination of the listed values, from the fit+calib start
    ... --starts fit --steps 100 300 --lr 1e-3 3e-3 1e-2 --batch 2 4 8 --inputs original converted

Converts the checkpoint (mean; fit with calibration) into temporary folders, loads both models
in memory (small models only), captures the original's attention inputs/outputs on the
calibration sequences, refines each converted layer in turn, and scores the held-out loss with
`uptrain.measure.eval.evaluate` (the same settings as results/conversion-methods.md):
- stories: examples/stories260K-mha8, calibration = first N tokens of
  examples/data/tinystories-train-sample.txt, scored on the lines of
  examples/data/tinystories-valid-sample.txt (512-token windows, stride 256).
- reference: results/paper/reference-mha8, calibration = first N tokens of the paper split's
  train.jsonl, scored on the first 12 documents of its val.jsonl (256-token windows, stride 192).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "tools"))  # shown.py
sys.path.insert(0, str(REPO / "scripts" / "paper"))

from uptrain.convert import convert  # noqa: E402
from uptrain.convert.layers.calibrate import Calibration, calibration_sequences, read_calibration_texts  # noqa: E402
from uptrain.convert.math import refine  # noqa: E402
from uptrain.convert.math.refine import refine_model  # noqa: E402
from uptrain.measure.eval import evaluate, load_model, tokenize_texts  # noqa: E402
from shown import shown  # noqa: E402  (scripts/tools/shown.py: paths as results/ names them)

DOCS = 12


def setup(name: str, tmp: Path) -> dict:
    """Checkpoint, calibration file, held-out texts and windows of a study model."""
    if name == "stories":
        texts = [t for t in (REPO / "examples/data/tinystories-valid-sample.txt").read_text().splitlines() if t.strip()]
        return dict(checkpoint=REPO / "examples/stories260K-mha8", calib=REPO / "examples/data/tinystories-train-sample.txt",
                    texts=texts, max_length=512, stride=256)
    from prepare import split_corpora  # scripts/paper/prepare.py: the paper reproduction's split
    split_corpora(REPO / "examples" / "data" / "paper", tmp, val_share=0.05)  # shipped, = ../shared's (md5)
    texts = [json.loads(line)["text"] for line in (tmp / "val.jsonl").read_text().splitlines()][:DOCS]
    return dict(checkpoint=REPO / "results/paper/reference-mha8", calib=tmp / "train.jsonl",
                texts=texts, max_length=256, stride=192)


def sequences_of(tokenizer, path: Path, tokens: int, window: int) -> list[torch.Tensor]:
    """What `--calib` runs (`calibrate.calibration_sequences`) as tensors, single tokens left out."""
    return sequences_and_documents(tokenizer, path, tokens, window)[0]


def sequences_and_documents(tokenizer, path: Path, tokens: int, window: int) -> tuple[list[torch.Tensor], list[int]]:
    """`sequences_of` and the document of each (refine holds out whole documents, as the converter does)."""
    seqs, documents, _, _ = calibration_sequences(read_calibration_texts(path), tokenizer, tokens, window)
    kept = [(torch.tensor(s), d) for s, d in zip(seqs, documents) if len(s) > 1]
    return [s for s, _ in kept], [d for _, d in kept]


def loss(model, tokenizer, s: dict) -> float:
    return evaluate(model, tokenize_texts(tokenizer, s["texts"]), s["max_length"], s["stride"]).loss


def save_refined(model, converted_folder: Path, out: Path) -> None:
    """Write the refined `model` to `out` as the converter writes a folder: weights and config with
    `save_pretrained`, plus every other file of the converted folder (tokenizer, conversion record)."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    written = {f.name for f in out.iterdir()}
    for f in converted_folder.iterdir():
        if f.is_file() and f.name not in written and ".safetensors" not in f.name:  # the converted weights and their shard index
            shutil.copy2(f, out / f.name)


def report(files: list[Path]) -> None:
    """Markdown rows of the JSON lines written by --json. Rows run without a mean start take mean
    pooling's loss from results/conversion-methods-*.json (the same evaluation)."""
    means = {}
    for name in ("stories", "reference"):
        data = json.loads((REPO / f"results/conversion-methods-{name}.json").read_text())
        means.update({(name, r["kv_heads"]): r["loss"] for r in data["rows"]
                      if r["method"] == "mean" and r["grouping"] == "contiguous"})
    print("| model | K/V | start | inputs | steps | lr | batch | start loss | refined loss | gap closed "
          "(start -> refined) | held-out layer error before -> after | s/layer | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for f in files:
        for line in f.read_text().splitlines():
            r = json.loads(line)
            r["mean"] = r["mean"] if r["mean"] is not None else means[(r["model"], r["kv"])]
            gap = (lambda x: "—" if r["mean"] is None else f"{(r['mean'] - x) / (r['mean'] - r['original']):.0%}")
            errs = ", ".join(f"{x['error_before']:.2f}->{x['error_after']:.2f}" for x in r["layers"])
            print(f"| {r['model']} | {r['kv']} | {r['start']} | {r['inputs']} | {r['steps']} | {r['lr']:g} | {r['batch']} "
                  f"| {r['start_loss']:.3f} | {r['refined']:.3f} | {gap(r['start_loss'])} -> {gap(r['refined'])} "
                  f"| {errs} | {r['seconds'] / len(r['layers']):.0f} | {r['load']:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", type=Path, nargs="+", help="print the markdown rows of these --json files and exit")
    p.add_argument("--model", choices=["stories", "reference"], default="stories")
    p.add_argument("--kv", type=int, nargs="+", default=[2, 1])
    p.add_argument("--starts", nargs="+", default=["fit", "mean"], choices=["fit", "mean"],
                   help="closed-form starts (fit: fit + calibration)")
    p.add_argument("--inputs", nargs="+", default=["original"], choices=["original", "converted"])
    p.add_argument("--steps", type=int, nargs="+", default=[refine.STEPS])
    p.add_argument("--lr", type=float, nargs="+", default=[refine.LR])
    p.add_argument("--batch", type=int, nargs="+", default=[refine.BATCH])
    p.add_argument("--schedule", choices=refine.SCHEDULES, default="cosine",
                   help="constant: the optimiser before issue 43 (results/refine.md's rows: --steps 1200 --lr 1e-2 "
                        "--batch 4 --eval-every 20)")
    p.add_argument("--holdout", type=float, default=0.125)
    p.add_argument("--patience", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=refine.EVAL_EVERY)
    p.add_argument("--calib-tokens", type=int, default=16384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, help="append the rows (JSON lines) to this file")
    p.add_argument("--save", type=Path, help="save each refined model (with the tokenizer) here: the folder itself "
                   "for one combination, else one subfolder per combination")
    args = p.parse_args()
    if args.report:
        return report(args.report)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="refine-study-") as tmp_name:
        tmp = Path(tmp_name)
        s = setup(args.model, tmp)
        original, tokenizer = load_model(str(s["checkpoint"]), dtype="float32", device=args.device)
        base = loss(original, tokenizer, s)
        print(f"original {base:.4f}", flush=True)
        window = min(2048, original.config.max_position_embeddings)
        seqs, documents = sequences_and_documents(tokenizer, s["calib"], args.calib_tokens, window)
        print(f"calibration: {len(seqs)} sequences, {sum(len(x) for x in seqs)} tokens", flush=True)
        calibration = Calibration(s["calib"], args.calib_tokens, args.device)
        for kv in args.kv:
            starts = {}
            for method in args.starts:
                out = tmp / f"kv{kv}-{method}"
                convert(str(s["checkpoint"]), out, kv, method, calibration=calibration if method == "fit" else None)
                starts[method] = out
            mean_loss = None
            if "mean" in starts:
                mean_loss = loss(load_model(str(starts["mean"]), "float32", args.device)[0], tokenizer, s)
            for method, folder in starts.items():
                start_loss = loss(load_model(str(folder), "float32", args.device)[0], tokenizer, s)
                print(f"kv {kv} {method}: {start_loss:.4f}", flush=True)
                for inputs, steps, lr, batch in itertools.product(args.inputs, args.steps, args.lr, args.batch):
                    converted = load_model(str(folder), "float32", args.device)[0]
                    t0 = time.perf_counter()
                    results = refine_model(original, converted, seqs, inputs=inputs, steps=steps, lr=lr, batch=batch,
                                           holdout_fraction=args.holdout, patience=args.patience,
                                           eval_every=args.eval_every, seed=args.seed, documents=documents,
                                           schedule=args.schedule,
                                           log=lambda m: print("  " + m, flush=True))
                    seconds = time.perf_counter() - t0
                    refined = loss(converted, tokenizer, s)
                    row = dict(model=args.model, kv=kv, start=method, inputs=inputs, steps=steps, lr=lr, batch=batch,
                               holdout=args.holdout, patience=args.patience, eval_every=args.eval_every,
                               schedule=args.schedule,
                               calib_tokens=args.calib_tokens, seed=args.seed, original=base, mean=mean_loss,
                               start_loss=start_loss, refined=refined, seconds=round(seconds, 1),
                               layers=[r.as_dict() for r in results], load=os.getloadavg()[0],
                               machine=f"{os.cpu_count()} cores {platform.machine()}", torch=torch.__version__)
                    gap = "" if mean_loss is None else f" gap closed {(mean_loss - refined) / (mean_loss - base):.1%}"
                    print(f"kv {kv} {method}+refine inputs={inputs} steps={steps} lr={lr} batch={batch}: "
                          f"{start_loss:.4f} -> {refined:.4f}{gap} ({seconds:.0f}s, load {row['load']:.1f})", flush=True)
                    if args.save:
                        one = len(args.kv) * len(starts) * len(args.inputs) * len(args.steps) * len(args.lr) * len(args.batch) == 1
                        out = args.save if one else args.save / f"kv{kv}-{method}-steps{steps}-lr{lr:g}-batch{batch}-{inputs}"
                        save_refined(converted, folder, out)
                        row["saved"] = shown(out)
                        print(f"saved {out}", flush=True)
                    if args.json:
                        with open(args.json, "a") as f:
                            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
