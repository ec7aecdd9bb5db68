"""The sweep itself: its arguments, the counts, each count converted, kept or redone, and scored.

The command and what it writes: this package's doc (`uptrain/sweep/__init__.py`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from uptrain.cli import ArgParser, format_table, positive_int, prog_name
from uptrain.convert.io.output_dir import check_apart, check_writable
from uptrain.convert.options import ConversionOptions, add_conversion_args, conversion_options
from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.sweep import AS_IT_WAS
from uptrain.sweep import __doc__ as SWEEP_DOC
from uptrain.sweep.curve import run_curves
from uptrain.sweep.extras import add_extra_args, check_extras, fidelity_of, run_extras, split_budgets
from uptrain.sweep.record import MARK, SweepFolder, changes, folder_fingerprint
from uptrain.sweep.report import print_estimate, recommend, report  # noqa: F401 (recommend: public here too)
from uptrain.measure.kv_cache import add_kv_cache_arg
from uptrain.sweep.precision import cache_formats, precision_points, score_after_uptraining
from uptrain.threads import add_threads_arg, announce_threads, start_threads


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
    # --bench (`extras.py`): median decode tokens/s, timed by uptrain.bench's code, and how
    decode_tokens_per_s: float | None = None
    bench: dict | None = None
    # --uptrain-tokens N (`extras.py`): the folder uptrained with the recipe, scored again
    loss_after_uptraining: float | None = None
    perplexity_after_uptraining: float | None = None
    uptrain_tokens: int | None = None  # tokens trained (the budget, in whole optimizer steps)
    uptrain_steps: int | None = None
    uptrain_seconds: float | None = None  # uptraining + scoring
    uptrained_folder: str | None = None  # OUT/kv{N}-uptrained/model
    uptrain_settings: dict | None = None
    # against the source (uptrain.measure.fidelity, the source itself: 0 / 1 exactly)
    kl_to_source: float | None = None  # mean KL(source || model), nats/token, over the scored tokens
    top1_agreement: float | None = None  # share of those tokens where both argmaxes agree
    greedy_agreement: float | None = None  # share of greedy-continuation tokens equal to the source's
    greedy_prefix: float | None = None  # mean tokens before the first difference
    greedy_agreement_se: float | None = None  # the greedy agreement's standard error over the prompts
    loss_vs_source: float | None = None  # loss - the source's, over the same tokens
    loss_vs_source_se: float | None = None  # its standard error over documents
    # the copy probe (uptrain.measure.copy_probe): a passage read again after other text
    copy_first_loss: float | None = None
    copy_second_loss: float | None = None
    copy_top1: float | None = None  # share of the second reading's tokens predicted exactly
    copy_gain_kept: float | None = None  # (first - second loss) / the source's
    source_copy_top1: float | None = None
    fidelity_after_uptraining: dict | None = None  # the fields above from kl_to_source, of the uptrained model
    # --uptrain-tokens A,B,C (`extras.py`): one run per budget from the converted folder, and the law fitted to them
    uptrain_curve: list | None = None  # [{tokens, loss, kl_to_source, folder, settings}] per budget
    forecast: dict | None = None  # `forecast.py`: tokens to the bound, its interval, what it rests on
    kv_cache: str = "model"  # the K/V cache format it was scored with (`precision.py`, uptrain.measure.kv_cache)


def sweep_counts(spec: str, heads: int, kv: int, mqa_only: bool, model_type: str) -> list[int]:
    """The K/V head counts asked for, largest first: "all" (every count below `kv` the model can
    take) or "4,2,1"; UsageError (one line) for a count it cannot take or one not below `kv`."""
    from uptrain.convert.math.heads import divisors
    from uptrain.convert.pipeline import check_kv_heads

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


def _parser() -> ArgParser:
    p = ArgParser(prog=prog_name("uptrain.sweep"), description=SWEEP_DOC.splitlines()[0])
    p.add_argument("checkpoint", help="the MHA (or GQA) model: a local folder or a Hub id")
    p.add_argument("--data", type=Path, required=True, help="held-out text to score on (.txt: a blank line between "
                   "documents; .jsonl/.json/.parquet: a text field); not the calibration text")
    add_conversion_args(p, calib_help="calibration text for --method fit, --grouping similar and --refine, as "
                        "uptrain.convert reads it (not --data); also the uptraining's text without --train-data")
    p.add_argument("--kv-heads", default="all", help="counts to sweep: 4,2,1 or all (default: every count below "
                   "the source's that it can take)")
    p.add_argument("--baseline", choices=["mean"], help="also sweep mean pooling, drawn beside the chosen method")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences for the KV bytes at full context")
    p.add_argument("--max-loss-increase", type=float, default=0.01, help="the recommendation's bound (default 0.01)")
    p.add_argument("--max-kl", type=float, default=None, help="also bound the recommendation's KL to the source "
                   "(nats/token); where the loss cannot choose (a warning says why) the recommendation rests on "
                   "the KL alone, bounded by this or by the loss bound in nats")
    add_kv_cache_arg(p, several=True)
    p.add_argument("--stories", type=positive_int, default=None, help="score only the first N held-out documents")
    p.add_argument("--out", type=Path, required=True, help="the sweep's folder (a rerun continues it)")
    add_extra_args(p)
    add_threads_arg(p, "conversion and scoring")
    return p


def _check_args(args) -> ConversionOptions:
    """Every refusal that needs no model, before torch is imported: the conversion's (the same
    lines as uptrain.convert's), then the sweep's own."""
    options = conversion_options(args)
    options.check(calib_used_elsewhere=args.uptrain_tokens is not None)  # --calib: also the uptraining's text
    if args.calib is not None and args.calib.resolve() == args.data.resolve():
        raise UsageError("--calib and --data are the same file: score on text the calibration did not see "
                         "(split your text, e.g. the last tenth of its documents for --data)")
    if args.data.is_dir():  # a folder of texts is not read: say so, not that it is missing
        raise UsageError(f"--data {args.data} is a folder; pass the held-out text file to score on (.txt, "
                         f".jsonl, .json or .parquet)")
    if not args.data.is_file():
        raise UsageError(f"--data {args.data} does not exist; pass the held-out text file to score on")
    return options


def _open_out(args) -> SweepFolder:
    """The sweep's folder, after every refusal of --out that needs no model: the source itself, a
    folder inside it or one holding it (as uptrain.convert refuses; a symlink is followed), one that
    cannot be written, one no sweep wrote. Before the source is scored, so nothing is written."""
    checkpoint = Path(args.checkpoint).expanduser()
    if checkpoint.exists():  # a Hub id: checked again once it is downloaded (`main`)
        check_apart(args.out, checkpoint, "--out")
    check_writable(args.out, "--out")
    return SweepFolder(args.out)  # refuses a folder this version did not write, or no sweep wrote


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    """The sweep (`argv` None: this process's arguments, with `uptrain.stopping.at_once`'s stop handling, also
    for the console script; a list: as a function, for tests, the process's handlers left alone)."""
    if argv is None:
        from uptrain.stopping import at_once

        at_once.install("uptrain.sweep", AS_IT_WAS)
    args = _parser().parse_args(argv)
    split_budgets(args)  # --uptrain-tokens A,B,C: the largest is the point's uptraining, all feed the forecast
    options = _check_args(args)
    sweep = _open_out(args)
    from uptrain.convert.io.hfconfig import model_shape, source_family  # torch and transformers: seconds
    from uptrain.convert.io.source import read_config, resolve_source

    folder = resolve_source(args.checkpoint)
    check_apart(args.out, folder, "--out")  # a Hub id's download (a local folder: refused already)
    raw = read_config(folder)
    family, shape = source_family(raw), model_shape(raw)
    counts = sweep_counts(args.kv_heads, shape.heads, shape.kv_heads, family.mqa_only, raw.get("model_type", "?"))
    formats, refused = cache_formats(args.kv_cache, shape.head_dim)  # a name it does not know: refused here
    jobs = _jobs(args, options, counts)
    sweep.check_free([out for _, _, outs in jobs for out in outs.values()] + _uptrained_folders(args, jobs))
    start_threads(args.threads)
    check_extras(args, folder, raw)  # --bench / --uptrain-tokens: refused here, before anything is written
    from uptrain.data import DataSource, read_documents
    from uptrain.measure.eval import model_windows

    texts = read_documents(DataSource(files=[str(args.data)]), args.stories, field_option=None)
    if not texts:
        raise UsageError(f"--data {args.data} holds no held-out text to score on")
    max_length, stride = model_windows([str(folder)])
    _announce(args, shape, counts, jobs, len(texts), max_length, formats, refused)
    _check_conversions(folder, jobs, counts)  # what needs the model's config: before anything is written
    fingerprints = sweep.fingerprints(folder, args.data, options.calib if options.calibrated else None)
    from uptrain.measure.fidelity import GreedySettings

    greedy = GreedySettings().within(max_length, explicit=False)  # fidelity's greedy prompts, as uptrain.eval's
    scoring = {"uptrain": fingerprints["uptrain"], "data": str(args.data.resolve()), "data_sha256": fingerprints["data"],
               "stories": args.stories, "fidelity": asdict(greedy)}
    score = functools.partial(_score, texts=texts, max_length=max_length, stride=stride, batch=args.batch,
                              reference=folder, greedy=greedy)
    done = {p["label"]: Point(**p) for p in sweep.points}
    content = functools.partial(folder_fingerprint, digests=sweep.digests)
    in_formats = functools.partial(precision_points, formats=formats, scoring=scoring, done=done, score=score,
                                   fingerprint=content)
    source = done.get("source")
    if source is None or source.settings.get("scoring") != {**scoring, "checkpoint": fingerprints["checkpoint"]}:
        _say_redone("source", source, {"scoring": {**scoring, "checkpoint": fingerprints["checkpoint"]}})
        source = score(folder, "source", "source", shape.kv_heads,
                       {"scoring": {**scoring, "checkpoint": fingerprints["checkpoint"]}}, 0.0)
    points = [source, *in_formats(source)]
    sweep.write([asdict(p) for p in points])
    for name, opts, outs in jobs:
        conversion = {**opts.record(), "checkpoint": fingerprints["checkpoint"], "uptrain": fingerprints["uptrain"],
                      "calib_sha256": fingerprints["calib"] if opts.calibrated else None}
        kept = _kept(sweep, done, name, outs, conversion, scoring)
        todo = [n for n in counts if n not in kept]
        made = _convert_together(args, folder, sweep, name, opts, outs, todo, conversion, source.seconds) if todo else {}
        for count in counts:  # each scored and recorded in turn: a stopped sweep keeps what it scored
            point = kept.get(count)
            if point is None or point.settings["scoring"] != scoring:
                point = score(*(made.get(count) or _rescore(point)))
                point.settings["scoring"] = scoring
            points += [point, *in_formats(point)]
            sweep.write([asdict(p) for p in points])
    _for_this_run(points, args.batch, shape.kv_heads)
    write = lambda *_: sweep.write([asdict(p) for p in points])  # noqa: E731 (every point, whichever changed)
    models = [p for p in points if p.kv_cache == "model"]  # decode speed and uptraining: once per model, its own dtype
    run_extras(args, folder, models, texts, max_length, stride, raw, write, sweep.mark)
    if len(args.uptrain_budgets) > 1:  # --uptrain-tokens A,B,C: a run per budget, and each count's forecast
        run_curves(args, folder, models, texts, max_length, stride, raw, write, sweep.mark)
    score_after_uptraining(points, texts, max_length, stride, folder, content, write)
    sweep.write([asdict(p) for p in points])
    report(args, points, jobs[0][0], _vocab_size(raw), jobs[0][1].start_note(), refused)
    return 0


def _announce(args, shape, counts: list[int], jobs: list, documents: int, max_length: int, formats: list,
              refused: dict[str, str]) -> None:
    """The sweep's first lines: what it converts and scores, the cache formats left out and why, the threads."""
    print(f"sweep: {shape.kv_heads} K/V heads ({shape.heads} query heads) -> {', '.join(map(str, counts))} with "
          f"{' and '.join(name for name, _, _ in jobs)}; {len(counts) * len(jobs)} conversions, each scored on "
          f"{documents:,} held-out documents in {max_length}-token windows (the model's context); into {args.out}",
          flush=True)
    for name, why in refused.items():
        print(f"--kv-cache {name}: left out: {why}", flush=True)
    if formats:
        print(f"each model also scored with its K/V cache stored as {', '.join(f.name for f in formats)} "
              f"(uptrain.measure.kv_cache): {len(formats) * (1 + len(counts) * len(jobs))} more scorings", flush=True)
    announce_threads()


def _jobs(args, options: ConversionOptions, counts: list[int]) -> list[tuple[str, ConversionOptions, dict]]:
    """(method name, its options, {count: folder}) of the chosen method and the --baseline."""
    jobs = [(options.method, options, {n: args.out / f"kv{n}" for n in counts})]
    if args.baseline and args.baseline != options.method:
        jobs.append((args.baseline, options.baseline(), {n: args.out / f"{args.baseline}-kv{n}" for n in counts}))
    return jobs


def _check_conversions(folder: Path, jobs: list[tuple[str, ConversionOptions, dict]], counts: list[int]) -> None:
    """Plan each method's conversion as uptrain.convert would (`prepare`: headers and config only,
    nothing run or read) so that what this model refuses is refused before the source is scored."""
    from uptrain.convert.pipeline import prepare

    for _, options, _ in jobs:
        prepare(str(folder), counts[-1], options.method, options.seed, grouping=options.grouping,
                calibration=options.calibration(), refine=options.refine_settings(),
                group_candidates=options.candidates)


def _uptrained_folders(args, jobs) -> list[Path]:
    if args.uptrain_tokens is None:
        return []
    return [args.out / f"{out.name}-uptrained" for _, _, outs in jobs for out in outs.values()]


def _kept(sweep: SweepFolder, done: dict, name: str, outs: dict[int, Path], conversion: dict,
          scoring: dict) -> dict[int, "Point"]:
    """The earlier run's points of `name` whose folder is ours, whole, and converted as asked now;
    a line for each, and for each one redone the reason."""
    kept = {}
    for count, out in outs.items():
        point = done.get(f"{name} kv{count}")
        whole = point is not None and sweep.owns(out) and (out / "config.json").is_file()
        if whole and point.settings.get("conversion") == conversion:
            again = "" if point.settings.get("scoring") == scoring else (
                "; scored again: " + ", ".join(changes(point.settings.get("scoring") or {}, scoring)))
            print(f"== {point.label}: kept from the earlier run ({point.folder}){again}", flush=True)
            kept[count] = point
        elif point is not None:
            _say_redone(point.label, point if whole else None, {"conversion": conversion})
    return kept


def _say_redone(label: str, point: "Point | None", wanted: dict) -> None:
    """One line: why an earlier run's point is not kept (nothing when there was none)."""
    if point is None:
        return
    (key, value), = wanted.items()
    what = ", ".join(changes(point.settings.get(key) or {}, value)) or "its folder is not whole"
    print(f"== {label}: done again, the earlier run's differs: {what}", flush=True)


def _rescore(point: "Point") -> tuple:
    """`_score`'s first arguments for a kept folder scored again."""
    return (Path(point.folder), point.label, point.method, point.kv_heads, dict(point.settings), point.seconds)


def _for_this_run(points: list["Point"], batch: int, source_kv: int) -> None:
    """KV bytes at full context for this run's --batch (kept points were measured at another)."""
    for p in points:
        p.kv_bytes_at_context = p.kv_bytes_per_token * p.settings["context"] * batch
        p.settings.update(batch=batch, source_kv_heads=source_kv)


def _convert_together(args, folder: Path, sweep: SweepFolder, name: str, options: ConversionOptions,
                      outs: dict[int, Path], counts: list[int], conversion: dict, score_s: float) -> dict[int, tuple]:
    """Convert `folder` to every count of `counts` with `options` into its folder, together
    (`convert_counts`: one read of the source, one calibration pass; all folders or none) with the
    sweep's mark; per count, `_score`'s first arguments (folder, label, method, count, settings, seconds)."""
    from uptrain.convert.several import convert_counts

    calibration = options.calibration()
    refine = options.refine_settings()  # its per-layer lines: `progress` below, with the layers left and the time
    began = time.monotonic()
    print(f"== {name} kv{', kv'.join(map(str, counts))}: converting together into {args.out} (one read of the "
          f"source{', one calibration pass' if calibration else ''})", flush=True)
    if calibration is not None and calibration.record.get("warning"):
        print(f"   warning: {calibration.record['warning']}", flush=True)
    convert_counts(str(folder), {n: outs[n] for n in counts}, options.method, seed=options.seed, force=True,
                   calibration=calibration, grouping=options.grouping, refine=refine,
                   group_candidates=options.candidates,
                   on_planned=lambda plans: print_estimate(plans, score_s), extra_files={MARK: sweep.id + "\n"},
                   progress=lambda count, line: print(f"   kv{count}: {line}", flush=True))
    if calibration is not None and calibration.record.get("near_chance"):
        print(f"   warning: {calibration.record['near_chance']}", flush=True)
    if calibration is not None:
        from uptrain.convert.layers.calibrate import shortfall_warning

        if shortfall_warning(calibration.record):
            print(f"   {shortfall_warning(calibration.record)}", flush=True)
    from uptrain.stopping import at_once

    at_once.end_if_pending()  # a signal held while the folders were put in place: they are whole, stop now
    at_once.written(None)  # the sweep goes on (scoring, uptraining): a later stop says the sweep's own line
    seconds = (time.monotonic() - began) / len(counts)  # the conversion's share of each count
    method = options.method + ("+refine" if refine else "")
    settings = {"conversion": conversion, "converted_with": counts}
    return {n: (outs[n], f"{name} kv{n}", method, n, settings, seconds) for n in counts}


def _score(folder: Path, label: str, method: str, kv_heads: int, settings: dict, seconds: float, texts: list[str],
           max_length: int, stride: int, batch: int, reference: Path, greedy, kv_cache: str = "model") -> Point:
    """Score `folder` with uptrain.eval's code (`evaluate_paths`), its K/V cache stored as `kv_cache`,
    against the source `reference` as saved (KL, top-1 and greedy agreement: `uptrain.measure.fidelity`),
    and size its KV cache in that format."""
    from transformers import AutoConfig
    from uptrain.measure.eval import evaluate_paths

    began = time.monotonic()
    (result,) = evaluate_paths([str(folder)], texts, max_length, stride, reference=str(reference), greedy=greedy,
                               kv_cache=kv_cache)
    per_token = result.kv_bytes_per_token
    context = getattr(AutoConfig.from_pretrained(folder).get_text_config(), "max_position_embeddings", None) or max_length
    settings = {**settings, "context": context, "batch": batch, "max_length": max_length, "stride": stride}
    return Point(label, method, kv_heads, result.loss, result.perplexity, per_token, per_token * context * batch,
                 str(folder), settings, round(seconds + time.monotonic() - began, 3), **fidelity_of(result),
                 kv_cache=kv_cache)


def _vocab_size(raw: dict) -> int:
    """The source's vocabulary (chance loss = ln of it), top level or in a multimodal text_config."""
    return raw.get("vocab_size") or (raw.get("text_config") or {}).get("vocab_size")

