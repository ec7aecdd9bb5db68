"""Conversions that keep copying (issue 59): loss, KL and the copy probe of each conversion of a model
whose heads copy, at 4, 2 and 1 K/V heads, before and after the demo's uptraining.

    python scripts/studies/copy_conversions.py --model examples/copy-mha8 --jobs 2   # a rerun continues
    python scripts/studies/copy_conversions.py --report                               # the table

Starts (`uptrain.convert MODEL --kv-heads K ...`): `mean` (the paper's), `fit` (from the weights),
`fit-similar-calib` (`--method fit --grouping similar --calib TRAIN`), `refine` (the same + `--refine`:
the quality path, with the default `--calib-windows repeats`), `refine-1200` (3x its steps); the levers
measured before that default, each with `--calib-windows documents` (`-documents`: `refine-repeats`,
`refine-packed`, `refine-far`, ...). `--train-text` picks the uptraining's text and blocks (`stories`:
the demo's former 128-token blocks; `stories-512-copy0.5`: what the demo now does for a model that
copies across its context). Each is scored by `uptrain.eval FOLDER --reference MODEL --data HELD_OUT` (loss, KL,
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
CALIBRATED = ["--method", "fit", "--grouping", "similar", "--calib", str(TRAIN), "--calib-tokens", "16384"]
STARTS = {
    "mean": ["--method", "mean"],
    "fit": ["--method", "fit"],
    "fit-similar-calib": CALIBRATED,
    "refine": [*CALIBRATED, "--refine"],  # the quality path (its default --calib-windows repeats)
    "refine-1200": [*CALIBRATED, "--refine", "--refine-steps", "1200"],  # three times the default's steps
}
SAMPLES = REPO / "runs" / "copy-conversions" / "copy-samples.jsonl"  # python -m uptrain.train.samples MODEL --tokens 32768
REPEATS = REPO / "runs" / "copy-conversions" / "calib-repeats.txt"  # made by `repeats_text`
PACKED = REPO / "runs" / "copy-conversions" / "calib-packed.txt"  # made by `packed_text`
FAR = REPO / "runs" / "copy-conversions" / "calib-far-repeats.txt"  # made by `far_repeats_text`
# Measured before --calib-windows repeats was the default: one document per forward pass (`-documents`).
_DOCUMENTS = ["--calib-windows", "documents"]
_LEVERS = {
    "fit-similar-calib": CALIBRATED,
    "refine": [*CALIBRATED, "--refine"],
    "refine-contiguous": [*CALIBRATED[:3], "contiguous", *CALIBRATED[4:], "--refine"],  # heads 0-3 / 4-7 share
    "refine-1200": [*CALIBRATED, "--refine", "--refine-steps", "1200"],
    "refine-samples": [*CALIBRATED[:5], str(SAMPLES), *CALIBRATED[6:], "--refine"],  # the model's own text
    "refine-repeats": [*CALIBRATED[:5], str(REPEATS), *CALIBRATED[6:], "--refine"],  # a story read ~70 tokens later
    "refine-packed": [*CALIBRATED[:5], str(PACKED), *CALIBRATED[6:], "--refine"],  # stories joined to ~512 tokens
    "refine-far": [*CALIBRATED[:5], str(FAR), *CALIBRATED[6:], "--refine"],  # a passage read again 0-380 later
    "refine-far-1200": [*CALIBRATED[:5], str(FAR), *CALIBRATED[6:], "--refine", "--refine-steps", "1200"],
}
STARTS |= {f"{name}-documents": [*args, *_DOCUMENTS] for name, args in _LEVERS.items()}


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


def _stories_and_tokens(model: Path) -> tuple[list[str], object]:
    from transformers import AutoTokenizer

    from uptrain.data import DataSource, read_documents

    return read_documents(DataSource(files=[str(TRAIN)])), AutoTokenizer.from_pretrained(model)


def packed_text(model: Path, context: int = 512) -> Path:
    """The packing lever: TRAIN's stories joined, one after another, into documents of about `context`
    tokens (the calibration cuts each document alone into windows, so one story makes a ~200-token
    window and the refinement never sees a key further back than that)."""
    stories, tok = _stories_and_tokens(model)
    docs, doc, used = [], [], 0
    for story in stories:
        n = len(tok(story, add_special_tokens=False)["input_ids"])
        if doc and used + n > context:
            docs.append(" ".join(doc))
            doc, used = [], 0
        doc.append(" ".join(story.split()))
        used += n
    PACKED.parent.mkdir(parents=True, exist_ok=True)
    PACKED.write_text("\n\n".join(docs) + "\n")
    return PACKED


def far_repeats_text(model: Path, context: int = 512, passage: int = 64, seed: int = 0) -> Path:
    """The far-repeat lever: documents of about `context` tokens, each a passage of `passage` tokens of a
    story, 0 to `context` - 2 x `passage` tokens of the following stories, then the passage again (the
    distance drawn uniformly per document), so the fit and the refinement see the heads copy across the
    distances the probe reads at."""
    import random

    stories, tok = _stories_and_tokens(model)
    ids = [tok(s, add_special_tokens=False)["input_ids"] for s in stories]
    flat = [t for doc in ids for t in doc]
    rng, docs, at = random.Random(seed), [], 0
    while at + context < len(flat):
        gap = rng.randint(0, context - 2 * passage - 8)
        piece = flat[at:at + passage]
        docs.append(tok.decode(piece + flat[at + passage:at + passage + gap] + piece))
        at += passage + gap
    FAR.parent.mkdir(parents=True, exist_ok=True)
    FAR.write_text("\n\n".join(" ".join(d.split()) for d in docs) + "\n")
    return FAR


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
        text = REPEATS if train_text.startswith("repeats") else FAR if train_text.startswith("far") else TRAIN
        # "-512": blocks of the model's whole context (the demo's frame trains on 128-token blocks), the same tokens a step
        frame = ["data.seq_len=512", "batch.micro_batch=2"] if "-512" in train_text else []
        # "-copy": every block with a passage read again (data.copy_repeats, uptrain.data.blocks.read_again); "-copy0.5": half
        frame += [f"data.copy_repeats={train_text.split('-copy')[1] or 1.0}"] if "-copy" in train_text else []
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
    p.add_argument("--train-text", choices=["stories", "repeats", "stories-512", "repeats-512", "far-512", "stories-512-copy",
                                                  "stories-512-copy0.5"], default="stories",
                   help="the uptraining's text: TRAIN, TRAIN's stories each read twice (`repeats_text`), or passages "
                        "read again 0-380 tokens later (`far_repeats_text`); -copy: TRAIN with data.copy_repeats=1 (or the share "
                        "after it); -512: "
                        "in 512-token blocks (the model's context) instead of the demo's 128")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--report", action="store_true")
    args = p.parse_args()
    records = json.loads(args.record.read_text()) if args.record.is_file() else []
    if args.report:
        return report(records)
    runs = REPO / "runs" / "copy-conversions" / args.model.name
    starts = args.starts.split(",")
    if any(s.startswith("refine-repeats") for s in starts) or args.train_text.startswith("repeats"):
        repeats_text()
    if any(s.startswith("refine-packed") for s in starts):
        packed_text(args.model)
    if any(s.startswith("refine-far") for s in starts) or args.train_text.startswith("far"):
        far_repeats_text(args.model)
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
    for r in sorted(records, key=lambda r: (r.get("model", ""), -r["kv_heads"], list(STARTS).index(r["start"]),
                                            r.get("train_text", ""))):
        c, u = r["converted"], r.get("uptrained") or {}
        kept = lambda d: "—" if d.get("copy_gain_kept") is None else f"{d['copy_gain_kept']:.1%}"  # noqa: E731
        after = (f"{u['loss']:.4f} | {u['kl_to_source']:.4f} | {kept(u)}" if u else "— | — | —")
        start = r["start"] + ("" if r.get("train_text", "stories") == "stories" else f", uptrained on {r['train_text']}")
        start = f"{r['model']}: {start}" if "model" in r else start  # results/copy-conversions-other-models.json
        print(f"| {r['kv_heads']} | {start} | {c['loss']:.4f} | {c['kl_to_source']:.4f} | "
              f"{c['copy_first_loss']:.3f} -> {c['copy_second_loss']:.3f} | {c['copy_top1']:.1%} | {kept(c)} | {after} |")


if __name__ == "__main__":
    main()
