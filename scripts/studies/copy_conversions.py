"""Conversions that keep copying (issue 59): loss, KL and the copy probe of each conversion of a model
whose heads copy, at 4, 2 and 1 K/V heads, before and after the demo's uptraining.

    python scripts/studies/copy_conversions.py --model examples/copy-mha8 --jobs 2   # a rerun continues
    python scripts/studies/copy_conversions.py --report                               # the table

Starts (`uptrain.convert MODEL --kv-heads K ...`): `mean` (the paper's), `fit` (from the weights),
`fit-similar-calib` (`--method fit --grouping similar --calib TRAIN`), `refine` (the same + `--refine`:
the quality path), `refine-repeats` (the quality path calibrated on TRAIN's stories each read twice:
story, the next story, the story again; `--starts refine-repeats`). Each is scored by `uptrain.eval FOLDER --reference MODEL --data HELD_OUT` (loss, KL,
the copy probe: `copy_gain_kept`, the share of the source's gain from a passage's first reading to its
second), then uptrained with the demo's recipe and budget (uptrain/train/recipe.py, 400K tokens of
TRAIN, configs/demo-cpu.yaml's frame) and scored again. One thread per run, seed 0; records in
results/copy-conversions.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples/data/tinystories-train-sample.txt"
VALID = REPO / "examples/data/tinystories-valid-sample.txt"
STARTS = {
    "mean": ["--method", "mean"],
    "fit": ["--method", "fit"],
    "fit-similar-calib": ["--method", "fit", "--grouping", "similar", "--calib", str(TRAIN), "--calib-tokens", "16384"],
    "refine": ["--method", "fit", "--grouping", "similar", "--calib", str(TRAIN), "--calib-tokens", "16384",
               "--refine"],
}
STARTS["refine-contiguous"] = ["--method", "fit", "--grouping", "contiguous", "--calib", str(TRAIN), "--calib-tokens",
                               "16384", "--refine"]  # the grouping lever: heads 0-3 and 4-7 share, whatever they do
STARTS["refine-1200"] = [*STARTS["refine"], "--refine-steps", "1200"]  # three times the default's steps
SAMPLES = REPO / "runs" / "copy-conversions" / "copy-samples.jsonl"  # python -m uptrain.train.samples MODEL --tokens 32768
STARTS["refine-samples"] = ["--method", "fit", "--grouping", "similar", "--calib", str(SAMPLES), "--calib-tokens",
                            "16384", "--refine"]  # calibrated on the model's own text (its repeats included)
REPEATS = REPO / "runs" / "copy-conversions" / "calib-repeats.txt"  # made by `repeats_text`
STARTS["refine-repeats"] = ["--method", "fit", "--grouping", "similar", "--calib", str(REPEATS), "--calib-tokens",
                            "16384", "--refine"]


def repeats_text() -> Path:
    """The calibration lever: TRAIN's stories, each document the start of a story, of the next one, then
    the first start again (a repeat ~70 tokens later, within the window), so the fit and the refinement
    see the heads copy."""
    from uptrain.data import DataSource, read_documents

    stories = read_documents(DataSource(files=[str(TRAIN)]))
    # each document within the model's 512-token window: 60 words of a story, 30 of the next, the 60 again
    cut = lambda text, n: " ".join(text.split()[:n])  # noqa: E731
    docs = [f"{cut(a, 60)} {cut(b, 30)} {cut(a, 60)}" for a, b in zip(stories, stories[1:] + stories[:1])]
    REPEATS.parent.mkdir(parents=True, exist_ok=True)
    REPEATS.write_text("\n\n".join(" ".join(d.split()) for d in docs) + "\n")
    return REPEATS


KEEP = ("loss", "kl_to_source", "top1_agreement", "copy_first_loss", "copy_second_loss", "copy_top1",
        "copy_gain", "copy_gain_kept", "source_copy_top1", "source_copy_gain")


def score(folder: Path, model: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "uptrain.eval", str(folder), "--reference", str(model), "--data",
                           str(VALID), "--threads", "1", "--json", "-"], cwd=REPO, check=True, capture_output=True,
                          text=True)
    row = json.loads(done.stdout)[0]
    return {k: row.get(k) for k in KEEP}


def cell(model: Path, runs: Path, start: str, kv: int, tokens: int, train_text: str = "stories") -> dict:
    """Convert, score; uptrain on `train_text` (stories: TRAIN; repeats: `repeats_text`), score again."""
    folder = runs / f"kv{kv}-{start}"
    if not (folder / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "uptrain.convert", str(model), "--kv-heads", str(kv), *STARTS[start],
                        "--threads", "1", "--out", str(folder), "--force"], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL)
    record = {"start": start, "kv_heads": kv, "train_text": train_text, "converted": score(folder, model)}
    if tokens:
        from uptrain.train.recipe import recipe_overrides

        run_dir = runs / f"kv{kv}-{start}-uptrained" if train_text == "stories" else runs / f"kv{kv}-{start}-on-{train_text}"
        text = REPEATS if train_text.startswith("repeats") else TRAIN
        # "-512": blocks of the model's whole context (the demo's frame trains on 128-token blocks), the same tokens a step
        frame = ["data.seq_len=512", "batch.micro_batch=2"] if train_text.endswith("-512") else []
        subprocess.run([sys.executable, "-m", "uptrain.train", "configs/demo-cpu.yaml", f"model={folder}",
                        f"run_dir={run_dir}", "overwrite=true", f"data.train.files=[{text}]",
                        f"data.val.files=[{VALID}]", *recipe_overrides(str(model)), f"budget.tokens={tokens}",
                        "threads=1", "log.log_with=[]", "log.progress_bar=false", "eval.every=0",
                        "checkpoint.every=0", *frame], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        record |= {"uptrained": score(run_dir / "model", model), "tokens": tokens}
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=REPO / "examples/copy-mha8")
    p.add_argument("--record", type=Path, default=REPO / "results/copy-conversions.json")
    p.add_argument("--kv-heads", default="4,2,1")
    p.add_argument("--starts", default="mean,fit,fit-similar-calib,refine")
    p.add_argument("--tokens", type=int, default=400_000, help="uptraining tokens (0: none)")
    p.add_argument("--train-text", choices=["stories", "repeats", "stories-512", "repeats-512"], default="stories",
                   help="the uptraining's text: TRAIN, or TRAIN's stories each read twice (`repeats_text`); -512: "
                        "in 512-token blocks (the model's context) instead of the demo's 128")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--report", action="store_true")
    args = p.parse_args()
    records = json.loads(args.record.read_text()) if args.record.is_file() else []
    if args.report:
        return report(records)
    runs = REPO / "runs" / "copy-conversions" / args.model.name
    if "refine-repeats" in args.starts.split(",") or args.train_text.startswith("repeats"):
        repeats_text()
    done = {(r["start"], r["kv_heads"], r.get("train_text", "stories")) for r in records}
    todo = [(s, int(k)) for k in args.kv_heads.split(",") for s in args.starts.split(",")
            if (s, int(k), args.train_text) not in done]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(cell, args.model.resolve(), runs, s, k, args.tokens, args.train_text) for s, k in todo]
        for f in concurrent.futures.as_completed(futures):
            records.append(f.result())
            print(json.dumps(records[-1]), flush=True)
            args.record.write_text(json.dumps(records, indent=1) + "\n")


def report(records: list[dict]) -> None:
    print("| K/V heads | start | loss | KL | copy loss 1st -> 2nd | copy top-1 | copy gain kept | after uptraining: "
          "loss | KL | copy gain kept |")
    print("|---" * 10 + "|")
    for r in sorted(records, key=lambda r: (-r["kv_heads"], list(STARTS).index(r["start"]), r.get("train_text", ""))):
        c, u = r["converted"], r.get("uptrained") or {}
        kept = lambda d: "—" if d.get("copy_gain_kept") is None else f"{d['copy_gain_kept']:.1%}"  # noqa: E731
        after = (f"{u['loss']:.4f} | {u['kl_to_source']:.4f} | {kept(u)}" if u else "— | — | —")
        start = r["start"] + ("" if r.get("train_text", "stories") == "stories" else f", uptrained on {r['train_text']}")
        print(f"| {r['kv_heads']} | {start} | {c['loss']:.4f} | {c['kl_to_source']:.4f} | "
              f"{c['copy_first_loss']:.3f} -> {c['copy_second_loss']:.3f} | {c['copy_top1']:.1%} | {kept(c)} | {after} |")


if __name__ == "__main__":
    main()
