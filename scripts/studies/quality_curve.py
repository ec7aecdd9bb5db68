"""The quality-per-compute curve on the hard case (issue 49): held-out loss and KL to the source
against uptraining tokens and CPU-seconds, on stories260K-mha8 -> K/V heads, for named recipes.

    python scripts/studies/quality_curve.py --kv-heads 2 --cells paper,recipe-text,recipe-samples --jobs 2
    python scripts/studies/quality_curve.py --report          # results/quality-curve.md's tables from the record

Each cell uptrains one start (`mean`: the paper's pooling; `quality`: fit + similar grouping +
calibration + refine, the converter's quality path) with the project's trainer, evaluating on the
shipped held-out stories every `--every` steps (the trainer's packed-block validation: loss, KL and
top-1 agreement against the source), and scores the final model as the demo does (`uptrain.demo`'s
table: every held-out story whole, 512-token windows, stride 256). One thread per cell, seed 0.
Records go to --record (JSON lines, one per cell: its overrides, the curve, the final score, CPU
seconds of the whole cell, uptime load at start and end).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "examples" / "stories260K-mha8"
TRAIN = REPO / "examples" / "data" / "tinystories-train-sample.txt"
VALID = REPO / "examples" / "data" / "tinystories-valid-sample.txt"
PY = sys.executable
SCORING = threading.Lock()
REUSE = False  # --reuse: score a cell's finished run again instead of training it (its CPU time then unknown)

# The starts: the converter's arguments after `SOURCE --kv-heads K`.
STARTS = {
    "mean": ["--method", "mean"],
    "quality": ["--method", "fit", "--grouping", "similar", "--calib", str(TRAIN), "--calib-tokens", "16384",
                "--refine"],
}
RUNS = REPO / "runs" / "quality-curve"  # the default --out, where the student-mix cell's samples are written
# the no-data starts (issue 61): calibrated on the source's own samples, not the shipped stories
# (`python -m uptrain.train.samples SOURCE --tokens 1050000 --top-p 1.0 --max-new-tokens 256 --out RUNS/teacher-samples-1m.jsonl`)
SAMPLES_1M = RUNS / "teacher-samples-1m.jsonl"


def _calibrated_on(text: Path) -> list[str]:
    """The quality path's converter arguments, calibrated on 16,384 tokens of `text` (no --refine)."""
    return ["--method", "fit", "--grouping", "similar", "--calib", str(text), "--calib-tokens", "16384"]


_ON_SAMPLES = _calibrated_on(SAMPLES_1M)
STARTS |= {
    "samples-repeats": [*_ON_SAMPLES, "--refine"],  # the demo's no-data start (repeat windows: the default)
    "samples-documents": [*_ON_SAMPLES, "--calib-windows", "documents", "--refine"],
    "samples-fit": [*_ON_SAMPLES, "--calib-windows", "documents"],  # the closed-form fit, not refined
    # calibrated on samples drawn hotter (`... --tokens 40000 --temperature T --out RUNS/teacher-samples-40k-TT.jsonl`)
    **{f"samples-T{t}": [*_calibrated_on(RUNS / f"teacher-samples-40k-T{t}.jsonl"), "--refine"] for t in (1.2, 1.5)},
}
# The cells: a start and the trainer's overrides of configs/demo-cpu.yaml (after model, run_dir, data).
TEXT = [f"data.train.files=[{TRAIN}]"]
KD = [f"distill.teacher={SOURCE}", "distill.alpha_kd=1.0"]


def samples(tokens: int | str = "BUDGET", top_p: float | None = None, longest: int = 256,
            temperature: float = 1.0) -> list[str]:
    """Train on `tokens` of the source's own samples (data.train.teacher_samples; BUDGET: as many as the
    cell's uptraining tokens, every token fresh; top_p: the sampling's, else the config's 0.95; each at most
    `longest` new tokens; temperature: the sampling's, written out so that a cell keeps its meaning when the
    library's default moves), not the shipped text."""
    nucleus = "" if top_p is None else f", top_p: {top_p}"
    nucleus += f", temperature: {temperature}"
    return ["data.train.files=null", f"data.train.teacher_samples={{tokens: {tokens}, max_new_tokens: {longest}{nucleus}}}",
            "data.repeat_data=true"]


CELLS: dict[str, tuple[str, list[str]]] = {
    "paper": ("mean", [*TEXT, "distill.alpha_kd=0", "distill.teacher=null"]),
    "recipe-text": ("quality", [*TEXT, *KD]),
    "recipe-text-512": ("quality", [*TEXT, *KD, "data.seq_len=512", "batch.micro_batch=2"]),
    "recipe-text-512-lr3e-3": ("quality", [*TEXT, *KD, "data.seq_len=512", "batch.micro_batch=2", "optim.lr=3e-3"]),
    "recipe-text-lr3e-3": ("quality", [*TEXT, *KD, "optim.lr=3e-3", "optim.warmup_steps=50"]),
    "recipe-samples": ("quality", [*samples(), *KD]),
    "recipe-samples-lr5e-4": ("quality", [*samples(), *KD, "optim.lr=5e-4"]),
    "recipe-samples-lr2.5e-4": ("quality", [*samples(), *KD, "optim.lr=2.5e-4"]),
    "recipe-samples-lr2e-3": ("quality", [*samples(), *KD, "optim.lr=2e-3", "optim.warmup_steps=50"]),
    "recipe-samples-512": ("quality", [*samples(), *KD, "data.seq_len=512", "batch.micro_batch=2"]),
    "recipe-samples-lr5e-4-attention": ("quality", [*samples(), *KD, "optim.lr=5e-4", "trainable=attention"]),
    "recipe-samples-lr1e-3-attention": ("quality", [*samples(), *KD, "optim.lr=1e-3", "trainable=attention"]),
    "recipe-samples-lr5e-4-T2": ("quality", [*samples(), *KD, "optim.lr=5e-4", "distill.temperature=2.0"]),
    "recipe-samples-lr5e-4-top_p1": ("quality", [*samples(top_p=1.0), *KD, "optim.lr=5e-4"]),
    # issue 61's levers on the best cell: a cross-entropy term beside distillation (10% hard labels), and
    # warm-up-stable-decay (the peak held, a linear decay over the last 20% of steps) against the cosine
    "recipe-samples-lr5e-4-ce0.1": ("quality", [*samples(), f"distill.teacher={SOURCE}", "distill.alpha_kd=0.9",
                                                "optim.lr=5e-4"]),
    "recipe-samples-lr5e-4-wsd": ("quality", [*samples(), *KD, "optim.lr=5e-4", "optim.schedule=wsd"]),
    # the student's own continuations (sampled once from the start: `python -m uptrain.train.samples START --tokens
    # 1050000 --top-p 1.0 --max-new-tokens 256`) beside as many of the source's, both scored by the source
    "recipe-student-mix-lr5e-4": ("quality", [f"data.train.files=[{RUNS}/student-samples.jsonl,{RUNS}/teacher-samples-1m.jsonl]",
                                              "data.repeat_data=true", *KD, "optim.lr=5e-4"]),
    # fewer samples read more than once (the budget's half, read twice; its quarter, four times): sampling is
    # a third of the no-data path's CPU (results/cpu-throughput.md), so a sample read twice costs less
    "recipe-samples-lr5e-4-reuse2": ("quality", [*samples("HALF"), *KD, "optim.lr=5e-4"]),
    "recipe-samples-lr5e-4-reuse4": ("quality", [*samples("QUARTER"), *KD, "optim.lr=5e-4"]),
    # the no-data starts at the reuse2 cell's training: which start trains best, not which scores best
    **{f"start-{kind}-reuse2": (kind, [*samples("HALF"), *KD, "optim.lr=5e-4"])
       for kind in ("mean", "samples-repeats", "samples-documents", "samples-fit", "samples-T1.2", "samples-T1.5")},
    # each layer's attention output matched to the source's during uptraining (distill.attention_match), on reuse2
    **{f"recipe-samples-lr5e-4-reuse2-att{w}": ("quality", [*samples("HALF"), *KD, "optim.lr=5e-4",
                                                            f"distill.attention_match={w}"]) for w in ("0.1", "1")},
    # samples drawn hotter than the source's own distribution (the targets stay the source's at T=1): wider
    # inputs, nearer real text's (the source's loss on its T=1 samples is 1.31, on the held-out stories 1.67)
    **{f"recipe-samples-lr5e-4-reuse2-T{t}": ("quality", [*samples("HALF", temperature=t), *KD, "optim.lr=5e-4"])
       for t in (1.1, 1.2, 1.3, 1.5)},
    # longer blocks (the same 2,048 tokens a step): positions past 128 trained with their context; at 512 the
    # samples run to 512 tokens too (held-out stories are scored in 512-token windows)
    "recipe-samples-lr5e-4-reuse2-256": ("quality", [*samples("HALF"), *KD, "optim.lr=5e-4", "data.seq_len=256",
                                                     "batch.micro_batch=4"]),
    "recipe-samples-lr5e-4-reuse2-512": ("quality", [*samples("HALF", longest=512), *KD, "optim.lr=5e-4",
                                                     "data.seq_len=512", "batch.micro_batch=2"]),
    # samples up to 512 tokens, read in 128-token blocks: the later parts of long stories, at the block's cost
    "recipe-samples-lr5e-4-reuse2-long": ("quality", [*samples("HALF", longest=512), *KD, "optim.lr=5e-4"]),
    "recipe-samples-lr5e-4-reuse2-long-T1.2": ("quality", [*samples("HALF", longest=512, temperature=1.2), *KD,
                                                           "optim.lr=5e-4"]),
    # smaller optimizer steps (8 or 4 blocks of 128 a step, not 16): more updates for the same tokens
    "recipe-samples-lr5e-4-reuse2-b8": ("quality", [*samples("HALF"), *KD, "optim.lr=5e-4", "batch.grad_accum=1"]),
    "recipe-samples-lr5e-4-reuse2-b4": ("quality", [*samples("HALF"), *KD, "optim.lr=5e-4", "batch.micro_batch=4",
                                                    "batch.grad_accum=1"]),
    # 64-token blocks (the same 2,048 tokens a step): attention is nearly half a step's CPU time at 128 tokens
    "recipe-samples-lr5e-4-64": ("quality", [*samples(), *KD, "optim.lr=5e-4", "data.seq_len=64", "batch.micro_batch=16"]),
    # the control: the source itself (nothing converted) distilled from itself on its samples, the
    # recipe's own floor: how far from the source the recipe's noise leaves a student that starts exact
    "control-source-samples-lr5e-4": ("source", [*samples(), *KD, "optim.lr=5e-4"]),
}


def load() -> float:
    return os.getloadavg()[0]


def run(cmd: list[str], log: Path) -> float:
    """Run `cmd` (one thread), its output to `log`; the CPU seconds it used (its own children included).

    Measured on that child alone (`os.wait4`). Before 2026-12-05 this was the difference of
    RUSAGE_CHILDREN around the run, which with --jobs 2 also counted the other cell's process when
    it ended meanwhile (CPU-s above the wall time in results/quality-curve.jsonl: `report` shows
    those at most their wall time)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {log}")
    return usage.ru_utime + usage.ru_stime


def start(kind: str, kv: int, out: Path) -> tuple[Path, float]:
    """The converted start (made once per kind and K/V count) and the CPU seconds it took to make
    (`source`: the source itself, unconverted: the control)."""
    if kind == "source":
        return SOURCE, 0.0
    folder = out / f"start-{kind}-kv{kv}"
    stamp = folder / "cpu_seconds.json"
    if not stamp.is_file():
        cpu = run([PY, "-m", "uptrain.convert", str(SOURCE), "--kv-heads", str(kv), *STARTS[kind], "--threads", "1",
                   "--force", "--out", str(folder)], out / f"start-{kind}-kv{kv}.log")
        stamp.write_text(json.dumps({"cpu_seconds": cpu}))
    return folder, json.loads(stamp.read_text())["cpu_seconds"]


def curve(run_dir: Path) -> list[dict]:
    """(step, tokens, val loss, KL, top-1) of each validation in the run's metrics.jsonl."""
    rows, tokens = [], 0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        tokens = r.get("tokens", tokens)
        if "val_loss" in r:
            rows.append({"step": r["step"], "tokens": tokens if r["step"] else 0, "val_loss": r["val_loss"],
                         "kl": r.get("val_kl_to_teacher"), "top1": r.get("val_top1_agreement")})
    return rows


def score(paths: list[Path]) -> list[dict]:
    """The demo's table for `paths` against the source: loss, KL, top-1 on every held-out story."""
    from uptrain.data import DataSource, read_documents
    from uptrain.measure.eval import evaluate_paths, model_windows

    texts = read_documents(DataSource(files=[str(VALID)]))
    max_length, stride = model_windows([str(SOURCE)])
    results = evaluate_paths([str(p) for p in paths], texts, max_length, stride, reference=str(SOURCE))
    return [{"loss": r.loss, "kl": r.kl_to_source, "top1": r.top1_agreement} for r in results]


def run_cell(name: str, kv: int, tokens: int, every: int, out: Path, extra: list[str]) -> dict:
    kind, overrides = CELLS[name]
    shares = {"BUDGET": 1.05, "HALF": 0.525, "QUARTER": 0.2625}  # the samples: budget (or its share) + 5% held out
    for word, share in shares.items():
        overrides = [o.replace(word, str(int(tokens * share))) for o in overrides]
    folder, start_cpu = start(kind, kv, out)
    run_dir = out / f"{name}-kv{kv}-{tokens}"
    load0, t0 = load(), time.time()
    cpu = None if REUSE and (run_dir / "model" / "config.json").is_file() else run([PY, "-m", "uptrain.train", "configs/demo-cpu.yaml", f"model={folder}", f"run_dir={run_dir}",
               "overwrite=true", f"data.val.files=[{VALID}]", *overrides, "threads=1", f"budget.tokens={tokens}",
               f"eval.every={every}", "checkpoint.every=0", "log.log_with=[]", "log.progress_bar=false", *extra],
              out / f"{name}-kv{kv}-{tokens}.log")
    record = {"cell": name, "kv_heads": kv, "start": kind, "overrides": overrides + extra, "tokens": tokens,
              "train_cpu_s": cpu and round(cpu, 1), "start_cpu_s": round(start_cpu, 1), "wall_s": round(time.time() - t0, 1),
              "load": [round(load0, 2), round(load(), 2)], "curve": curve(run_dir)}
    meta = run_dir / "teacher_samples" / "meta.json"
    if meta.is_file():
        record["samples"] = {k: json.loads(meta.read_text())[k] for k in ("tokens", "seconds", "tokens_per_s")}
    with SCORING:  # one at a time: two threads loading models at once raced in transformers (meta tensors)
        record["final"], = score([run_dir / "model"])
    return record


SOURCE_LOSS = 1.6671  # the source on the same stories, scored the same way (README, results/fidelity.md)


def report(record: Path, plot: Path) -> None:
    """The tables (markdown on stdout) and a plot of the trainer's KL to the source against tokens."""
    rows = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    print("| cell | K/V | start | uptraining tokens | CPU-s (start + uptraining) | loss | above source | KL | top-1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f = r["final"]
        train = r["train_cpu_s"]
        if train is not None and r["wall_s"] and train > r["wall_s"]:  # (another cell counted: see `run`)
            train = r["wall_s"]  # one thread: its own CPU time is at most its wall time
        cpu = "?" if train is None else f"{r['start_cpu_s'] + train:,.0f}" + ("*" if train != r["train_cpu_s"] else "")
        kv = "8 (the source)" if r["start"] == "source" else r["kv_heads"]
        print(f"| {r['cell']} | {kv} | {r['start']} | {r['tokens']:,} | {cpu} "
              f"| {f['loss']:.3f} | {f['loss'] / SOURCE_LOSS - 1:+.1%} | {f['kl']:.3f} | {f['top1']:.1%} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.get_cmap("tab20").colors
    for i, r in enumerate(rows):
        label, color = f"{r['cell']} (K/V {r['kv_heads']})", colors[(2 * i) % 20 + (2 * i) // 20]
        xs = [c["tokens"] / 1e6 for c in r["curve"]]
        left.plot(xs, [c["val_loss"] for c in r["curve"]], marker=".", label=label, color=color)
        if r["curve"] and r["curve"][0]["kl"] is not None:
            right.plot(xs, [c["kl"] for c in r["curve"]], marker=".", label=label, color=color)
    left.set_ylim(1.85, 3.0)  # (the mean-pooled starts begin at 4.8-5.4, off the top)
    left.legend(fontsize=6)
    left.set_ylabel("validation loss (trainer: packed blocks)")
    right.set_ylabel("KL to the source (nats/token, trainer's validation)")
    for ax in (left, right):
        ax.set_xlabel("uptraining tokens (millions)")
        ax.grid(alpha=0.3)

    fig.suptitle("stories260K-mha8: uptraining from the converted start (seed 0, one thread)")
    fig.tight_layout()
    fig.savefig(plot, dpi=120)
    print(f"\n(plot: {plot})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-heads", type=int, nargs="+", default=[2])
    p.add_argument("--cells", default="paper,recipe-text,recipe-samples")
    p.add_argument("--tokens", type=int, default=2_000_000, help="uptraining tokens per cell")
    p.add_argument("--every", type=int, default=100, help="steps between validations")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "quality-curve")
    p.add_argument("--record", type=Path, default=REPO / "results" / "quality-curve.jsonl")
    p.add_argument("--starts-only", action="store_true", help="score the starts and the source only")
    p.add_argument("--reuse", action="store_true", help="score finished runs again (no training; CPU unknown)")
    p.add_argument("--report", action="store_true", help="print the tables of --record and plot it")
    p.add_argument("--plot", type=Path, default=REPO / "results" / "quality-curve.png")
    p.add_argument("extra", nargs="*", help="key=value overrides for every cell (recorded)")
    args = p.parse_args()
    if args.report:
        return report(args.record, args.plot)
    global REUSE
    REUSE = args.reuse
    args.out.mkdir(parents=True, exist_ok=True)
    if args.starts_only:
        folders = [start(kind, kv, args.out)[0] for kv in args.kv_heads for kind in STARTS]
        for path, s in zip([SOURCE, *folders], score([SOURCE, *folders])):
            print(json.dumps({"model": str(path.relative_to(REPO)), **s}), flush=True)  # (noqa: the record's own)
        return
    import transformers  # noqa: F401  (its lazy imports are not thread-safe: import before the pool's threads)
    from uptrain.measure.eval import evaluate_paths  # noqa: F401

    transformers.AutoConfig, transformers.AutoModelForCausalLM, transformers.AutoTokenizer  # noqa: B018
    jobs = [(c, kv) for kv in args.kv_heads for c in args.cells.split(",")]
    for kind in {CELLS[c][0] for c, _ in jobs} - {"source"}:  # starts first, one at a time (each is shared)
        for kv in args.kv_heads:
            start(kind, kv, args.out)
    with ThreadPoolExecutor(args.jobs) as pool:
        for record in pool.map(lambda j: run_cell(j[0], j[1], args.tokens, args.every, args.out, args.extra), jobs):
            with open(args.record, "a") as f:  # paths as a reader of the repository sees them (test_results_paths)
                f.write(json.dumps(record).replace(str(REPO) + "/", "") + "\n")
            print(json.dumps({k: record[k] for k in ("cell", "kv_heads", "tokens", "train_cpu_s", "final")}), flush=True)


if __name__ == "__main__":
    main()
