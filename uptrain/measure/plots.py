"""PNG plots of the GQA trade: training curves, quality vs uptraining fraction, KV bytes, speed.

Every `plot_*` function writes a PNG (matplotlib, Agg backend) and returns the Figure, so
callers and tests can inspect the series. CLI:

    python -m uptrain.plots runs RUN_DIR_OR_JSONL [...] [--out loss.png]
    python -m uptrain.plots alpha TABLE.json|TABLE.csv [--out quality-vs-alpha.png]
    python -m uptrain.plots bench BENCH.json [--out DIR] [--prefix P]  # bench/compare --json output
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from uptrain.errors import UsageError, exit_on_usage_error  # noqa: E402
from uptrain.cli import ArgParser, distinct_names, prog_name  # noqa: E402

METRICS_FILE = "metrics.jsonl"


def read_metrics(path: str | Path) -> list[dict]:
    """Records of a JSON-lines metrics file (or `RUN_DIR/metrics.jsonl`).

    Blank lines, lines that are not JSON objects and a torn last line are skipped.
    """
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    if not p.is_file():
        raise UsageError(f"metrics file not found: {p}")
    records = []
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records


def _save(fig: Figure, out: str | Path) -> Figure:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    return fig


def plot_llama_decode(results: Sequence, out: Path) -> Path:
    """`uptrain.bench --runtime llama.cpp`: decode tokens/s against context, one line per model (median,
    min-max as error bars); results: bench_llama.LlamaBench."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in results:
        xs = [d.context for d in r.decode]
        med = [d.median for d in r.decode]
        err = [[m - min(d.tokens_per_s) for m, d in zip(med, r.decode)], [max(d.tokens_per_s) - m for m, d in zip(med, r.decode)]]
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=f"{Path(r.model).name} ({r.kv_heads} K/V heads)")
    threads = results[0].threads
    contexts = sorted({d.context for r in results for d in r.decode})
    ax.set(xscale="log", xlabel="context (cached tokens)", ylabel="decode tokens/s",
           title=f"llama.cpp greedy decode, {threads} thread{'s' * (threads > 1)}")
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, out)
    return out


def _series(records: Sequence[Mapping], x: str, y: str) -> tuple[list[float], list[float]]:
    """(xs, ys) of the records that carry numbers for both keys."""
    pts = [(r[x], r[y]) for r in records
           if isinstance(r.get(x), (int, float)) and isinstance(r.get(y), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def fill_tokens(records: Sequence[Mapping]) -> list[dict]:
    """Copies of `records`, those without "tokens" given step x tokens-per-step when known.

    The trainer's validation records carry "step" but not "tokens"; tokens per step is taken
    from the first record that has both (with step > 0).
    """
    per_step = next((r["tokens"] / r["step"] for r in records
                     if isinstance(r.get("tokens"), (int, float)) and isinstance(r.get("step"), (int, float))
                     and r["step"] > 0), None)
    out = []
    for r in records:
        r = dict(r)
        if "tokens" not in r and per_step is not None and isinstance(r.get("step"), (int, float)):
            r["tokens"] = r["step"] * per_step
        out.append(r)
    return out


def plot_training_runs(runs: Mapping[str, Sequence[Mapping]], out: str | Path) -> Figure:
    """LM loss (solid), val_loss (dashed, dots) and KD loss (dotted) vs training tokens, one colour per run.

    `runs`: label -> metric records ({"step", "tokens", "lm_loss"/"loss", "val_loss", "kd_loss"});
    a run without any "tokens" is drawn against "step". The training curve is `lm_loss` where
    recorded: a distillation run's `loss` mixes in the KD term and would not compare with plain
    runs; its KD term is drawn on its own.
    """
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xlabel = "tokens"
    for i, (label, records) in enumerate(runs.items()):
        records = fill_tokens(records)
        x = "tokens" if any("tokens" in r for r in records) else "step"
        xlabel = xlabel if x == "tokens" else "tokens (or step)"
        train_key = "lm_loss" if any("lm_loss" in r for r in records) else "loss"
        for key, style in ((train_key, "-"), ("val_loss", "--"), ("kd_loss", ":")):
            xs, ys = _series(records, x, key)
            if xs:
                dots = key == "val_loss" or len(xs) < 3  # a lone point needs a marker to show
                ax.plot(xs, ys, style, color=f"C{i}", marker="o" if dots else None,
                        markersize=3, label=f"{label} {key}")
    if not ax.lines:
        plt.close(fig)
        raise UsageError("no run has records with tokens/step and loss/val_loss")
    ax.set(xlabel=xlabel, ylabel="loss (nats/token)", title="Uptraining loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out)


def read_alpha_table(path: str | Path) -> list[dict]:
    """Rows {kv, method, alpha, val_loss} from a JSON list or a CSV file with that header."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"table not found: {p}")
    if p.suffix.lower() == ".csv":
        with p.open(newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        rows = json.loads(p.read_text())
    try:
        return [{"kv": int(r["kv"]), "method": str(r.get("method", "mean")),
                 "alpha": float(r["alpha"]), "val_loss": float(r["val_loss"])} for r in rows]
    except (KeyError, TypeError, ValueError) as err:
        raise UsageError(f"{p}: each row needs kv, alpha, val_loss (and method): {err}") from None


def plot_quality_vs_alpha(rows: Sequence[Mapping], out: str | Path, reference: float | None = None) -> Figure:
    """Validation loss vs uptraining fraction alpha, one line per (kv heads, method).

    `reference`: the source model's loss, drawn as a horizontal line when given.
    """
    groups: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        groups[(int(r["kv"]), str(r.get("method", "mean")))].append((float(r["alpha"]), float(r["val_loss"])))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (kv, method), pts in sorted(groups.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{kv} KV heads, {method}")
    if reference is not None:
        ax.axhline(reference, color="k", linestyle=":", label="source model")
    ax.set(xlabel="uptraining fraction alpha", ylabel="validation loss (nats/token)",
           title="Quality vs uptraining fraction")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out)


def _labels(bench_rows: Sequence[Mapping]) -> list[str]:
    """Legend labels: the shortest trailing folder names that tell the models apart, with K/V heads."""
    names = distinct_names([str(row["model"]) for row in bench_rows])
    return [f"{name} ({row['kv_heads']} kv)" for name, row in zip(names, bench_rows)]


def binary_size(n: float, _pos: object = None) -> str:
    """'512 B', '1.5 KiB', '8 MiB': a byte count for an axis tick."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _bars(ax, series: Sequence[tuple[str, float]], **style) -> None:
    """One bar per (label, value): a series measured at a single context is a bar, not a lone dot."""
    ax.bar(range(len(series)), [v for _, v in series], color=[f"C{i}" for i in range(len(series))], **style)
    ax.set_xticks(range(len(series)), [label for label, _ in series], rotation=20, ha="right", fontsize=8)


def plot_kv_bytes(bench_rows: Sequence[Mapping], out: str | Path) -> Figure:
    """Measured KV-cache size (batch 1) vs context length, one line per model (one bar per model
    when every model was measured at a single context); the axis in B/KiB/MiB/GiB.

    `bench_rows`: `dataclasses.asdict(BenchResult)` dicts (context keys may be strings, as in JSON).
    """
    fig, ax = plt.subplots(figsize=(7, 4.5))
    contexts = {int(c) for row in bench_rows for c in row["kv_bytes"]}
    if len(contexts) == 1:
        (context,) = contexts
        _bars(ax, [(label, b) for row, label in zip(bench_rows, _labels(bench_rows)) for b in row["kv_bytes"].values()])
        ax.set(xlabel=f"model (context {context} tokens)")
    else:
        for row, label in zip(bench_rows, _labels(bench_rows)):
            pts = sorted((int(c), b) for c, b in row["kv_bytes"].items())
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set(xlabel="context length (tokens)")
        ax.legend(fontsize=8)
    top = max((b for row in bench_rows for b in row["kv_bytes"].values()), default=1) or 1
    unit = 1024 ** min(3, int(math.log(top, 1024)))  # round ticks in the unit the labels use
    ticks = matplotlib.ticker.MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]).tick_values(0, top / unit)
    ax.yaxis.set_major_locator(matplotlib.ticker.MultipleLocator((ticks[1] - ticks[0]) * unit))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(binary_size))
    ax.set(ylabel="KV-cache size (batch 1)", title="KV-cache size")
    ax.grid(alpha=0.3)
    return _save(fig, out)


SWEEP_METRICS = {"loss": "held-out loss (nats/token)",  # what plot_sweep can draw: the y axis's label
                 "kl_to_source": "KL to the source (nats/token, held-out text)"}


def _after(p: Mapping, metric: str):
    """The point's `metric` after uptraining (None: not uptrained, or not measured)."""
    if metric == "loss":
        return p.get("loss_after_uptraining")
    return (p.get("fidelity_after_uptraining") or {}).get(metric)


def frontier(points: list, metric: str = "loss") -> list:
    """The points no other point beats on both KV bytes and `metric` (fewer or equal bytes and a lower
    value, or fewer bytes and an equal value), by bytes ascending: the trade's frontier."""
    measured = sorted((p for p in points if _value(p, metric) is not None),
                      key=lambda p: (_bytes(p), _value(p, metric)))
    best, out = float("inf"), []
    for p in measured:
        if _value(p, metric) < best:
            out.append(p)
            best = _value(p, metric)
    return out


def _bytes(p) -> float:
    return p["kv_bytes_per_token"] if isinstance(p, dict) else p.kv_bytes_per_token


def _value(p, metric: str):
    return p.get(metric) if isinstance(p, dict) else getattr(p, metric, None)


def _frontier(points: Sequence[Mapping], metric: str) -> list[Mapping]:
    """`frontier` of sweep.json records, the source's missing KL taken as 0."""
    return frontier([{**p, metric: p.get(metric) or 0.0} for p in points], metric)


def plot_sweep(points: Sequence[Mapping], out: str | Path, metric: str = "loss") -> Figure:
    """The K/V trade curve (uptrain.sweep): held-out loss (or `metric` "kl_to_source": the KL to the
    source, 0 for the source itself) against KV-cache bytes per token, one line per method through
    its counts (each point labelled with its K/V heads), the source as the reference line. `points`:
    sweep.json's records, the source first. Uptrained records (`--uptrain-tokens`) add a dashed
    second curve per method, same colour."""
    ylabel = SWEEP_METRICS[metric]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    source, rest = points[0], [p for p in points[1:] if p.get(metric) is not None]
    by_method: dict[str, list[Mapping]] = defaultdict(list)  # a line per method and cache format
    for p in rest:
        cache = p.get("kv_cache", "model")
        by_method[p["method"] if cache == "model" else f"{p['method']}, {cache} cache"].append(p)
    for method, series in by_method.items():
        series = sorted(series, key=lambda p: p["kv_bytes_per_token"])
        (line,) = ax.plot([p["kv_bytes_per_token"] for p in series], [p[metric] for p in series], marker="o",
                          label=method)
        for p in series:
            ax.annotate(f"{p['kv_heads']}", (p["kv_bytes_per_token"], p[metric]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        after = [p for p in series if _after(p, metric) is not None]
        if after:
            tokens = sorted({p.get("uptrain_tokens") for p in after if p.get("uptrain_tokens")})
            ax.plot([p["kv_bytes_per_token"] for p in after], [_after(p, metric) for p in after],
                    marker="s", linestyle="--", color=line.get_color(),
                    label=f"{method}, uptrained {' / '.join(f'{t:,}' for t in tokens)} tokens")
    edge = _frontier([source, *rest], metric)
    if len(edge) > 1:  # the trade's frontier: no other point has fewer KV bytes and a lower value
        ax.plot([p["kv_bytes_per_token"] for p in edge], [p.get(metric) or 0.0 for p in edge], color="black",
                linewidth=3, alpha=0.25, zorder=1, label="frontier (fewest bytes for the quality)")
    level = source.get(metric) or 0.0  # the source against itself: KL 0
    ax.axhline(level, color="grey", linestyle="--", label=f"source ({source['kv_heads']} K/V heads)")
    ax.scatter([source["kv_bytes_per_token"]], [level], color="grey", zorder=3)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(binary_size))
    title = "Quality against KV cache" if metric == "loss" else "Fidelity to the source against KV cache"
    ax.set(xlabel="KV cache per token (log scale; labels: K/V heads)", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out)


def plot_decode_speed(bench_rows: Sequence[Mapping], out: str | Path) -> Figure:
    """Median decode tokens/s vs context length, one line per (model, batch); one bar per (model,
    batch) when every timing is at a single context."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    contexts = {d["context"] for row in bench_rows for d in row["decode"]}
    if len(contexts) == 1:
        (context,) = contexts
        _bars(ax, [(f"{label}, batch {d['batch']}", d["decode_tokens_per_s"])
                   for row, label in zip(bench_rows, _labels(bench_rows)) for d in row["decode"]])
        ax.set(xlabel=f"model, batch (context {context} tokens)", ylabel="decode tokens/s (median)",
               title="Decode throughput", yscale="log")
        ax.grid(alpha=0.3)
        return _save(fig, out)
    styles = ["-", "--", ":", "-."]
    for i, (row, label) in enumerate(zip(bench_rows, _labels(bench_rows))):  # colour: model; style: batch
        by_batch: dict[int, list[tuple[int, float]]] = defaultdict(list)
        for d in row["decode"]:
            by_batch[d["batch"]].append((d["context"], d["decode_tokens_per_s"]))
        for j, (batch, pts) in enumerate(sorted(by_batch.items())):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[j % 4], color=f"C{i}", marker="osD^v"[j % 5],
                    label=f"{label}, batch {batch}")
    ax.set(xlabel="context length (tokens)", ylabel="decode tokens/s (median)", title="Decode throughput", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # many series: beside the axes
    return _save(fig, out)


def plot_bench(bench_rows: Sequence[Mapping], directory: str | Path, prefix: str = "") -> list[str]:
    """Write `{prefix}kv-bytes.png` and `{prefix}decode-speed.png` (if any decode rows) into `directory`."""
    written = [str(Path(directory) / f"{prefix}kv-bytes.png")]
    plot_kv_bytes(bench_rows, written[0])
    if any(row["decode"] for row in bench_rows):
        written.append(str(Path(directory) / f"{prefix}decode-speed.png"))
        plot_decode_speed(bench_rows, written[1])
    return written


def _is_accuracy(score: Mapping) -> bool:
    """A score with a standard error on the 0..1 scale (acc, acc_norm, exact_match, ...)."""
    return score["stderr"] is not None and 0.0 <= score["value"] <= 1.0


def plot_task_scores(scores: Mapping[str, Sequence[Mapping]], out: str | Path) -> Figure:
    """Bar chart of lm-eval scores with a standard error (accuracies), grouped by task/metric, one bar per model.

    `scores`: model -> `dataclasses.asdict(TaskScore)` dicts (task, metric, value, stderr).
    Metrics without a standard error or outside 0..1 (perplexities) are left out: they do not share the axis.
    """
    columns: list[str] = []
    for rows in scores.values():
        columns += [c for r in rows if _is_accuracy(r) and (c := f"{r['task']}/{r['metric']}") not in columns]
    if not columns:
        raise UsageError("no task score with a standard error (accuracy) to plot")
    names = distinct_names(list(scores))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(columns) * max(1, len(names)) / 2), 4.5))
    width = 0.8 / len(names)
    for i, (name, rows) in enumerate(zip(names, scores.values())):
        by_col = {f"{r['task']}/{r['metric']}": r for r in rows if _is_accuracy(r)}
        xs = [j + (i - (len(names) - 1) / 2) * width for j, c in enumerate(columns) if c in by_col]
        vals = [by_col[c]["value"] for c in columns if c in by_col]
        errs = [by_col[c]["stderr"] for c in columns if c in by_col]
        ax.bar(xs, vals, width, yerr=errs, capsize=3, label=name)
    ax.set_xticks(range(len(columns)), columns, rotation=20, ha="right", fontsize=8)
    ax.set(ylabel="score (± standard error)", title="Downstream tasks (lm-evaluation-harness)", ylim=(0, 1))
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _save(fig, out)


@exit_on_usage_error
def main(argv: Sequence[str] | None = None) -> int:
    """CLI: plot training runs, an alpha table, or bench JSON."""
    parser = ArgParser(prog=prog_name("uptrain.plots"), description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p_runs = sub.add_parser("runs", help="loss vs tokens of run folders / metrics.jsonl files")
    p_runs.add_argument("runs", nargs="+", metavar="RUN",
                        help="run folders (with metrics.jsonl) or metrics .jsonl files")
    p_runs.add_argument("--out", help="PNG path (default: RUN/loss.png for one run, else loss.png)")
    p_alpha = sub.add_parser("alpha", help="val_loss vs uptraining fraction from a JSON/CSV table")
    p_alpha.add_argument("table", help="JSON list or CSV with columns kv, method, alpha, val_loss")
    p_alpha.add_argument("--reference", type=float, default=None, help="source model loss")
    p_alpha.add_argument("--out", default="quality-vs-alpha.png")
    p_bench = sub.add_parser("bench", help="KV bytes and decode speed from bench --json output")
    p_bench.add_argument("json", help="the --json output of uptrain.bench or uptrain.compare")
    p_bench.add_argument("--out", default=".", help="folder for kv-bytes.png and decode-speed.png")
    p_bench.add_argument("--prefix", default="", help="prefix of the two file names")
    args = parser.parse_args(argv)

    if args.what == "runs":
        runs = {Path(r).name if Path(r).is_dir() else Path(r).stem: read_metrics(r) for r in args.runs}
        out = args.out or (str(Path(args.runs[0]) / "loss.png") if len(args.runs) == 1 and Path(args.runs[0]).is_dir()
                           else "loss.png")
        plot_training_runs(runs, out)
        written = [out]
    elif args.what == "alpha":
        plot_quality_vs_alpha(read_alpha_table(args.table), args.out, args.reference)
        written = [args.out]
    else:
        if not Path(args.json).is_file():
            raise UsageError(f"bench JSON not found: {args.json}")
        data = json.loads(Path(args.json).read_text())
        rows = [r.get("bench", r) for r in data]  # compare JSON nests bench results
        written = plot_bench(rows, args.out, args.prefix)
    for w in written:
        print(f"wrote {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
