"""`python -m uptrain.sweep`: the quality / KV-cache trade curve over K/V head counts, one command.

    python -m uptrain.sweep CKPT --data HELD_OUT [--calib FILE] [--method fit] [--refine]
                            [--kv-heads 4,2,1 | all] [--baseline mean] --out DIR
                            [--bench [--runtime llama.cpp]] [--uptrain-tokens N [--train-data FILE]]

Converts CKPT to each K/V head count (default: every count below the source's that it can take),
scores each on held-out text within the model's context with `uptrain.eval`'s own code, and
measures the KV cache per token and at the model's full context for `--batch` sequences. Writes:

  DIR/kv{N}/        each converted folder, as `uptrain.convert` writes it (DIR/mean-kv{N}/: --baseline)
  DIR/sweep.json    one record per count and the source: kv_heads, loss, perplexity,
                    kv_bytes_per_token, kv_bytes_at_context, the conversion settings, seconds
  DIR/sweep.png     loss against KV bytes per token, the source as the reference line
  DIR/kv{N}-uptrained/  with --uptrain-tokens N: the uptraining run of each count (model/ inside)

`--bench` adds each folder's decode tokens/s (uptrain.bench's timer), `--uptrain-tokens N` a short
uptraining of each converted folder with the project's recipe and its loss after it (a second
curve on sweep.png, a second recommendation): uptrain.sweep_extras.

and prints the table and a recommendation: the smallest count whose loss is within
`--max-loss-increase` (default 1%) of the source's, or a plain statement that none is.

A rerun with the same arguments continues: the counts already in sweep.json with their folder are
kept, the rest converted (each folder appears whole: `uptrain.convert`'s atomic output). Each count
is its own conversion today (its own read of the source and, with --calib, its own calibration).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from uptrain.cli import ArgParser, format_table, positive_int, prog_name
from uptrain.convert.registry.choices import GROUPINGS, METHODS
from uptrain.convert.io.hfconfig import model_shape, source_family
from uptrain.convert.math.heads import divisors
from uptrain.convert.pipeline import check_kv_heads
from uptrain.convert.plan import human_seconds
from uptrain.convert.io.source import read_config, resolve_source
from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.sweep_extras import add_extra_args, after_uptraining, check_extras, notes, run_extras, table_columns
from uptrain.threads import add_threads_arg, announce_threads, start_threads
from uptrain.units import kv_cache_bytes_per_token

RECORDS = "sweep.json"


@dataclass
class Point:
    """One point of the curve: a model folder scored on the held-out text."""

    label: str  # "source", "fit kv2", "mean kv2"
    method: str  # "source" or the conversion method (+ "+refine")
    kv_heads: int
    loss: float
    perplexity: float
    kv_bytes_per_token: float
    kv_bytes_at_context: float  # per token x the model's context x --batch sequences
    folder: str
    settings: dict
    seconds: float  # conversion + scoring
    # --bench (uptrain.sweep_extras): median decode tokens/s, timed by uptrain.bench's code, and how
    decode_tokens_per_s: float | None = None
    bench: dict | None = None
    # --uptrain-tokens N (uptrain.sweep_extras): the folder uptrained with the recipe, scored again
    loss_after_uptraining: float | None = None
    perplexity_after_uptraining: float | None = None
    uptrain_tokens: int | None = None  # tokens trained (the budget, in whole optimizer steps)
    uptrain_steps: int | None = None
    uptrain_seconds: float | None = None  # uptraining + scoring
    uptrained_folder: str | None = None  # OUT/kv{N}-uptrained/model
    uptrain_settings: dict | None = None


def sweep_counts(spec: str, heads: int, kv: int, mqa_only: bool, model_type: str) -> list[int]:
    """The K/V head counts asked for, largest first: "all" (every count below `kv` the model can
    take) or "4,2,1"; UsageError (one line) for a count it cannot take or one not below `kv`."""
    if spec == "all":
        counts = [1] if mqa_only else [k for k in divisors(kv) if k < kv]
    else:
        try:
            counts = sorted({int(part) for part in spec.split(",") if part.strip()}, reverse=True)
        except ValueError:
            raise UsageError(f"--kv-heads takes counts like 4,2,1 or all, got {spec!r}") from None
    for count in counts:
        if count >= kv:
            raise UsageError(f"--kv-heads {count} is not below the source's {kv} K/V heads: a sweep compares "
                             f"smaller caches with the source (valid: {', '.join(map(str, sweep_counts('all', heads, kv, mqa_only, model_type)))})")
        check_kv_heads(count, heads, kv, mqa_only, model_type)
    if not counts:
        raise UsageError(f"the source has {kv} K/V head(s): no smaller count to sweep")
    return sorted(counts, reverse=True)


def recommend(points: list[Point], source_loss: float, max_increase: float) -> str:
    """The smallest K/V count of the chosen method within `max_increase` of the source's loss."""
    bound = source_loss * (1 + max_increase)
    fitting = [p for p in points if p.loss <= bound]
    if not fitting:
        best = min(points, key=lambda p: p.loss)
        return (f"none of the counts is within {max_increase:.1%} of the source's loss {source_loss:.4f} (at most "
                f"{bound:.4f}); the closest is {best.kv_heads} K/V heads at {best.loss:.4f} "
                f"({best.loss / source_loss - 1:+.1%}): uptrain it, or keep more K/V heads")
    pick = min(fitting, key=lambda p: p.kv_heads)
    return (f"recommended: {pick.kv_heads} K/V heads, the smallest count within {max_increase:.1%} of the "
            f"source's loss ({pick.loss:.4f} vs {source_loss:.4f}, {pick.loss / source_loss - 1:+.2%}), "
            f"a KV cache {points[0].settings['source_kv_heads'] / pick.kv_heads:g}x smaller")


def _parser() -> ArgParser:
    p = ArgParser(prog=prog_name("uptrain.sweep"), description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="the MHA (or GQA) model: a local folder or a Hub id")
    p.add_argument("--data", type=Path, required=True, help="held-out text to score on (.txt: a blank line between "
                   "documents; .jsonl/.json/.parquet: a text field); not the calibration text")
    p.add_argument("--calib", type=Path, help="calibration text for --method fit / --refine (not --data)")
    p.add_argument("--calib-tokens", type=positive_int, default=32768, help="calibration tokens (default 32768)")
    p.add_argument("--method", choices=METHODS, default="mean", help="conversion method (default mean: the paper's)")
    p.add_argument("--grouping", choices=GROUPINGS, default="contiguous", help="which query heads share a K/V head")
    p.add_argument("--refine", action="store_true", help="layer-wise reconstruction after the start (needs --calib)")
    p.add_argument("--kv-heads", default="all", help="counts to sweep: 4,2,1 or all (default: every count below "
                   "the source's that it can take)")
    p.add_argument("--baseline", choices=["mean"], help="also sweep mean pooling, drawn beside the chosen method")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences for the KV bytes at full context")
    p.add_argument("--max-loss-increase", type=float, default=0.01, help="the recommendation's bound (default 0.01)")
    p.add_argument("--stories", type=positive_int, default=None, help="score only the first N held-out documents")
    p.add_argument("--out", type=Path, required=True, help="the sweep's folder (a rerun continues it)")
    add_extra_args(p)
    add_threads_arg(p, "conversion and scoring")
    return p


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start_threads(args.threads)
    folder = resolve_source(args.checkpoint)
    raw = read_config(folder)
    family, shape = source_family(raw), model_shape(raw)
    counts = sweep_counts(args.kv_heads, shape.heads, shape.kv_heads, family.mqa_only, raw.get("model_type", "?"))
    if args.refine and args.calib is None:
        raise UsageError("--refine needs --calib FILE (the text each layer is refined on)")
    if args.calib is not None and args.calib.resolve() == args.data.resolve():
        raise UsageError("--calib and --data are the same file: score on text the calibration did not see "
                         "(split your text, e.g. the last tenth of its documents for --data)")
    check_extras(args, folder, raw)  # --bench / --uptrain-tokens: refused here, before anything is written
    from uptrain.data import DataSource, read_documents
    from uptrain.measure.eval import model_windows

    texts = read_documents(DataSource(files=[str(args.data)]), args.stories)
    if not texts:
        raise UsageError(f"--data {args.data} holds no held-out text to score on")
    max_length, stride = model_windows([str(folder)])
    methods = [args.method] + ([args.baseline] if args.baseline and args.baseline != args.method else [])
    print(f"sweep: {shape.kv_heads} K/V heads ({shape.heads} query heads) -> {', '.join(map(str, counts))} with "
          f"{' and '.join(methods)}; {len(counts) * len(methods)} conversions, each scored on {len(texts):,} "
          f"held-out documents in {max_length}-token windows (the model's context); into {args.out}", flush=True)
    announce_threads()
    args.out.mkdir(parents=True, exist_ok=True)
    done = _read_points(args.out)
    scoring = _scoring(args)  # a point is kept by a rerun only when scored on the same text
    done = {label: p for label, p in done.items() if all(p.settings.get(k) == v for k, v in scoring.items())}
    points = [done.get("source") or _score(folder, "source", "source", shape.kv_heads, scoring, 0.0, texts,
                                           max_length, stride, args.batch)]
    _write_points(args.out, points)
    score_s = points[0].seconds
    for method in methods:
        kept = {}
        for count in counts:
            point = done.get(f"{method} kv{count}")
            if point is not None and Path(point.folder).is_dir() and _same_settings(point, args, method):
                print(f"== {point.label}: kept from the earlier run ({point.folder})", flush=True)
                kept[count] = point
        todo = [n for n in counts if n not in kept]
        made = _convert_together(args, folder, method, todo, shape.kv_heads, score_s) if todo else {}
        for count in counts:  # each scored and recorded in turn: a stopped sweep keeps what it scored
            points.append(kept.get(count) or _score(*made[count], texts, max_length, stride, args.batch))
            _write_points(args.out, points)
    run_extras(args, folder, points, texts, max_length, stride, raw, lambda done: _write_points(args.out, done))
    _report(args, points, methods[0])
    return 0


def _convert_together(args, folder: Path, method: str, counts: list[int], source_kv: int, score_s: float
                      ) -> dict[int, tuple]:
    """Convert `folder` to every count of `counts` with `method` into OUT/[mean-]kv{count}, together
    (`convert_counts`: one read of the source, one calibration pass); per count, `_score`'s first
    arguments (folder, label, method, count, settings, seconds)."""
    from uptrain.convert.several import convert_counts

    calibration, refine = None, None
    settings = _conversion_settings(args, method, source_kv)
    if settings["calib"]:
        from uptrain.convert.layers.calibrate import Calibration

        calibration = Calibration(args.calib, args.calib_tokens, "cpu")
        if args.refine:
            from uptrain.convert.layers.refine_layer import RefineSettings

            # a line per refined layer (convert_counts names its count)
            refine = RefineSettings(log=lambda line: print(f"   {line}", flush=True))
    outs = {n: args.out / (f"kv{n}" if method == args.method else f"{method}-kv{n}") for n in counts}
    began = time.monotonic()
    print(f"== {method} kv{', kv'.join(map(str, counts))}: converting together into {args.out} (one read of the "
          f"source{', one calibration pass' if calibration else ''})", flush=True)
    convert_counts(str(folder), outs, method, force=True, calibration=calibration, grouping=settings["grouping"],
                   refine=refine, on_planned=lambda plans: _print_estimate(plans, score_s))
    seconds = (time.monotonic() - began) / len(counts)  # the conversion's share of each count
    name = method + ("+refine" if refine else "")
    return {n: (outs[n], f"{method} kv{n}", name, n, {**settings, "converted_with": counts}, seconds) for n in counts}


def _print_estimate(plans: dict, score_s: float) -> None:
    """The sweep's plan: what the conversions will take at most (refine's measured step time, as the
    converter's plan states it for one count) and the scoring, from the source's own scoring time."""
    refine = [p.refinement["probe"].get("seconds_at_most") for p in plans.values() if p.refinement]
    parts = []
    if refine and all(s is not None for s in refine):
        parts.append(f"refinement at most {human_seconds(sum(refine))} ({len(refine)} counts, early stopping "
                     f"usually ends sooner)")
    parts.append(f"scoring about {human_seconds(score_s * len(plans))} ({len(plans)} models at the source's "
                 f"{human_seconds(score_s)})")
    print(f"   plan: {'; '.join(parts)}; the calibration stream and the reads once for all", flush=True)


def _score(folder: Path, label: str, method: str, kv_heads: int, settings: dict, seconds: float, texts: list[str],
           max_length: int, stride: int, batch: int) -> Point:
    """Score `folder` with uptrain.eval's code (`evaluate_paths`) and size its KV cache."""
    from transformers import AutoConfig
    from uptrain.measure.eval import evaluate_paths

    began = time.monotonic()
    (result,) = evaluate_paths([str(folder)], texts, max_length, stride)
    config = AutoConfig.from_pretrained(folder).get_text_config()
    shape = model_shape(config)
    from uptrain.units import DTYPES

    stored = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    itemsize = DTYPES.get(stored.removeprefix("torch."), DTYPES["float32"]).itemsize
    per_token = kv_cache_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, itemsize)
    context = getattr(config, "max_position_embeddings", None) or max_length
    settings = {**settings, "source_kv_heads": settings.get("source_kv_heads", kv_heads), "context": context,
                "batch": batch, "max_length": max_length, "stride": stride}
    return Point(label, method, kv_heads, result.loss, result.perplexity, per_token, per_token * context * batch,
                 str(folder), settings, round(seconds + time.monotonic() - began, 3))


def _conversion_settings(args, method: str, source_kv: int) -> dict:
    """What a count's conversion was made with (a rerun keeps a point only when they are the same)."""
    chosen = method == args.method
    calibrated = chosen and args.calib is not None and (method == "fit" or args.refine)
    return {**_scoring(args), "method": method, "grouping": args.grouping if chosen else "contiguous",
            "calib": str(args.calib.resolve()) if calibrated else None,
            "calib_tokens": args.calib_tokens if calibrated else None, "refine": bool(chosen and args.refine),
            "source_kv_heads": source_kv}


def _scoring(args) -> dict:
    """What a point's scores depend on besides its folder: the held-out text and how much of it."""
    return {"data": str(args.data.resolve()), "stories": args.stories}


def _same_settings(point: Point, args, method: str) -> bool:
    wanted = _conversion_settings(args, method, point.settings.get("source_kv_heads"))
    return all(point.settings.get(k) == v for k, v in wanted.items())


def _read_points(out: Path) -> dict[str, Point]:
    path = out / RECORDS
    if not path.is_file():
        return {}
    try:
        return {r["label"]: Point(**r) for r in json.loads(path.read_text())["points"]}
    except (ValueError, KeyError, TypeError):
        return {}  # an unreadable record: redo everything


def _write_points(out: Path, points: list[Point]) -> None:
    """sweep.json, written whole after every count (a stopped sweep keeps what it finished)."""
    tmp = out / f".{RECORDS}.tmp"
    tmp.write_text(json.dumps({"points": [asdict(p) for p in points]}, indent=1) + "\n")
    os.replace(tmp, out / RECORDS)


def _report(args, points: list[Point], method: str) -> None:
    """The table, the plot and the recommendation."""
    from uptrain.measure.plots import plot_sweep

    source = points[0]
    rows = [[p.label if p.method == "source" else f"{p.method} kv{p.kv_heads}", p.kv_heads, f"{p.loss:.4f}", f"{p.perplexity:.3f}", f"{p.loss / source.loss - 1:+.2%}",
             f"{p.kv_bytes_per_token:,.0f} B", f"{p.kv_bytes_at_context / 2**20:,.1f} MiB",
             f"{source.kv_bytes_per_token / p.kv_bytes_per_token:g}x"] for p in points]
    extra_headers, extra_cells = table_columns(points, source.loss)  # --bench, --uptrain-tokens
    print(format_table(["model", "K/V heads", "loss", "perplexity", "vs source", "KV / token",
                        f"KV at {source.settings['context']:,} tokens x {args.batch}", "KV reduction", *extra_headers],
                       [row + extra for row, extra in zip(rows, extra_cells)]))
    for line in notes(points):
        print(line)
    plot_sweep([asdict(p) for p in points], args.out / "sweep.png")
    chosen = [p for p in points[1:] if p.label.startswith(method + " ")]
    print(recommend(chosen, source.loss, args.max_loss_increase))
    uptrained = after_uptraining(chosen)
    if uptrained:
        print("after uptraining: " + recommend(uptrained, source.loss, args.max_loss_increase))
    print(f"wrote {args.out / RECORDS} and {args.out / 'sweep.png'}")


if __name__ == "__main__":
    sys.exit(main())
