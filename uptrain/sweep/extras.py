"""`uptrain.sweep`'s measurements after the conversions: `--bench` and `--uptrain-tokens N`.

`--bench`: each folder of the sweep (and the source) timed by `uptrain.bench`'s own code: greedy
`generate` of `--bench-new-tokens` tokens after a `--bench-context`-token prompt at batch 1, one
warm-up and `--bench-repeats` timed runs, the median decode tokens/s (`bench_model` /
`decode_throughput`); `--runtime llama.cpp` times the same folders in llama.cpp instead
(`run_llama_bench`, needs llama-cpp-python and llama.cpp's converter, as `uptrain.bench` does).

`--uptrain-tokens N`: each converted folder uptrained for N tokens with the project's one recipe
(`uptrain/train/recipe.py`, the demo's too: peak lr 3e-4, no warm-up, cosine, pure distillation from
the source; on the frame of `configs/paper/uptrain.yaml`: its blocks and batch) through the trainer's Python API, into OUT/kv{K}-uptrained/ (the run:
metrics, loss.png, model/), then scored with `uptrain.eval`'s code on the same held-out text.
Training text: `--train-data`, else the `--calib` text; never `--data` (the text it is scored on).

Both continue like the conversions: a rerun keeps a count's decode speed / uptraining when its
record holds the same settings (and the uptrained model/ is there), and redoes it otherwise (a
changed `--uptrain-tokens`, recipe, override or training text is a fresh run of that count's
uptraining, replacing its run folder; the conversion is kept). An uptraining stopped part-way
restarts from its converted model (the recipe saves no intermediate checkpoints).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

from uptrain.stopping import at_once
from uptrain.cli import positive_int
from uptrain.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "paper" / "uptrain.yaml"  # the frame (blocks, batch); its optim/distill: uptrain/train/recipe.py
RUNTIMES = ("transformers", "llama.cpp")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
# What the sweep sets on top of the recipe for each count (before the user's --uptrain-set): the
# converted folder, its run folder, the texts and the budget; no step-0 validation (the converted
# model was just scored), no tracker (metrics.jsonl and loss.png are written in any case).
_FIXED_KEYS = ("model", "run_dir", "overwrite", "data.train.files", "data.val.files", "budget.tokens",
               "budget.fraction", "budget.pretrain_tokens", "distill.teacher", "threads")


FIDELITY = ("kl_to_source", "top1_agreement", "greedy_agreement", "greedy_prefix", "loss_vs_source",
            "loss_vs_source_se", "greedy_agreement_se", "copy_first_loss", "copy_second_loss", "copy_top1",
            "copy_gain_kept", "source_copy_top1")  # a sweep point's fields against the source (uptrain.measure.fidelity)


def fidelity_of(result) -> dict:
    """A sweep point's fidelity fields from an EvalResult scored against the source."""
    return {k: getattr(result, k) for k in FIDELITY}


def add_extra_args(p: argparse.ArgumentParser) -> None:
    """The sweep's `--bench` and `--uptrain-tokens` options."""
    b = p.add_argument_group("decode speed per count (--bench; uptrain.bench's timer)")
    b.add_argument("--bench", action="store_true", help="time decoding of the source and every converted folder")
    b.add_argument("--runtime", choices=RUNTIMES, default="transformers", help="transformers (generate) or "
                   "llama.cpp (llama-cpp-python, installed separately; folders converted to GGUF on the fly)")
    b.add_argument("--bench-context", type=positive_int, default=128, help="prompt tokens before decoding")
    b.add_argument("--bench-new-tokens", type=positive_int, default=32, help="tokens decoded per timed run")
    b.add_argument("--bench-repeats", type=positive_int, default=3, help="timed runs; the median is recorded")
    b.add_argument("--llama-cpp", metavar="DIR", help="--runtime llama.cpp: llama.cpp checkout holding "
                   "convert_hf_to_gguf.py (default $LLAMA_CPP_DIR)")
    b.add_argument("--outtype", choices=GGUF_TYPES, default="f16", help="--runtime llama.cpp: GGUF weight type")
    u = p.add_argument_group("uptraining per count (--uptrain-tokens)")
    u.add_argument("--uptrain-tokens", type=_token_list, metavar="N[,N...]", help="uptrain every converted folder for N "
                   "tokens with the project's recipe, then score it again; several budgets (A,B,C: one run each) "
                   "also fit a loss-versus-tokens law per count and forecast the tokens to the bound")
    u.add_argument("--train-data", type=Path, help="training text of the uptraining (default: the --calib text; "
                   "never --data)")
    u.add_argument("--uptrain-config", type=Path, default=RECIPE, help="the recipe (a uptrain.train YAML)")
    u.add_argument("--uptrain-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the recipe, e.g. optim.lr=1e-3 (repeatable)")


def _token_list(text: str) -> list[int]:
    """argparse type: one or more comma-separated budgets (`_tokens` each), sorted, each once."""
    return sorted({_tokens(part) for part in text.split(",") if part.strip()}) or [_tokens(text)]


def split_budgets(args: argparse.Namespace) -> None:
    """args.uptrain_budgets: every budget asked for (ascending); args.uptrain_tokens: the largest, the one
    each point's own uptraining and the table use (None without --uptrain-tokens)."""
    budgets = args.uptrain_tokens if isinstance(args.uptrain_tokens, list) else (
        [] if args.uptrain_tokens is None else [args.uptrain_tokens])
    args.uptrain_budgets, args.uptrain_tokens = budgets, (budgets[-1] if budgets else None)


def _tokens(text: str) -> int:
    """argparse type: a whole number of tokens (200000, 200_000, 2e5); positivity is checked later."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of tokens: {text!r}") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number of tokens: {text!r}")
    return int(value)


def check_extras(args: argparse.Namespace, source: Path, raw_config: dict) -> None:
    """Every refusal of --bench / --uptrain-tokens, before the sweep writes anything (UsageError)."""
    given = [f"--{k.replace('_', '-')}" for k in ("train_data", "uptrain_set") if getattr(args, k)]
    given += ["--uptrain-config"] if args.uptrain_config != RECIPE else []
    if args.uptrain_tokens is None and given:
        raise UsageError(f"{', '.join(given)} {_apply(given)} only with --uptrain-tokens N")
    bench_given = [f"--{k.replace('_', '-')}" for k, default in (("runtime", "transformers"), ("bench_context", 128),
                   ("bench_new_tokens", 32), ("bench_repeats", 3), ("llama_cpp", None), ("outtype", "f16"))
                   if getattr(args, k) != default]
    if not args.bench and bench_given:
        raise UsageError(f"{', '.join(bench_given)} {_apply(bench_given)} only with --bench")
    if args.bench:
        _check_bench(args, raw_config)
    if args.uptrain_tokens is not None:
        for budget in dict.fromkeys([args.uptrain_tokens, *getattr(args, "uptrain_budgets", [])]):  # refusals only
            uptrain_config(_with_budget(args, budget), source, source, args.out / "check", raw_config)


def _with_budget(args: argparse.Namespace, budget: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "uptrain_tokens": budget})


def _apply(names: list[str]) -> str:
    return "applies" if len(names) == 1 else "apply"


def _check_bench(args: argparse.Namespace, raw_config: dict) -> None:
    if args.bench_new_tokens < 2:
        raise UsageError("--bench-new-tokens must be at least 2 to time decoding (the first new token pays the prompt)")
    context = raw_config.get("max_position_embeddings")
    if context and args.bench_context + args.bench_new_tokens > context:
        raise UsageError(f"--bench-context {args.bench_context} + --bench-new-tokens {args.bench_new_tokens} exceed "
                         f"the model's {context} positions; choose a shorter --bench-context")
    if args.runtime == "llama.cpp":
        from uptrain.measure import gguf

        gguf.require_llama_cpp()  # one line saying how to install it
        gguf.find_converter(args.llama_cpp)  # the sweep's models are folders: they need the converter


def training_text(args: argparse.Namespace) -> Path:
    """--train-data, else the --calib text; one-line refusal when there is none or it is --data."""
    text = args.train_data or args.calib
    if text is None:
        raise UsageError("--uptrain-tokens needs training text: --train-data FILE (or --calib FILE, used when "
                         "--train-data is not given); --data is the held-out text it is scored on, not trained on")
    if text.resolve() == args.data.resolve():
        raise UsageError(f"--train-data and --data are the same file ({args.data}): the uptrained models would be "
                         "scored on their own training text; give held-out text to --data")
    if not text.exists():
        raise UsageError(f"{'--train-data' if args.train_data else '--calib'} {text} not found (the uptraining's text)")
    return text


def uptrain_overrides(args: argparse.Namespace, source: Path, converted: Path, run_dir: Path,
                      adapted: list[str] = ()) -> list[str]:
    """The key=value overrides of the recipe for one count (the user's --uptrain-set last)."""
    fixed = [f"model={converted}", f"run_dir={run_dir}", "overwrite=true",
             f"data.train.files=[{json.dumps(str(training_text(args).resolve()))}]",
             f"data.val.files=[{json.dumps(str(args.data.resolve()))}]",
             f"budget.tokens={args.uptrain_tokens}", "budget.fraction=null", "budget.pretrain_tokens=null",
             f"distill.teacher={source}", "eval.at_start=false", "log.log_with=[]", "log.progress_bar=false",
             f"threads={args.threads if args.threads else 'null'}"]
    return fixed + _recipe(args, source) + list(adapted) + list(args.uptrain_set)


def _recipe(args: argparse.Namespace, source: Path | None) -> list[str]:
    """The one recipe's overrides (uptrain/train/recipe.py, the demo's too) on the default frame, the
    teacher `source` (None: the recipe's settings alone, as a rerun's record compares them); none on a
    config of the user's (--uptrain-config: theirs is the recipe)."""
    from uptrain.train.recipe import RECIPE as ONE_RECIPE, recipe_overrides

    if args.uptrain_config != RECIPE:
        return []
    return recipe_overrides(str(source)) if source is not None else [f"{k}={v}" for k, v in ONE_RECIPE.items()]


def _sets(args: argparse.Namespace, key: str) -> bool:
    return any(item.partition("=")[0] == key for item in args.uptrain_set)


def uptrain_config(args: argparse.Namespace, source: Path, converted: Path, run_dir: Path, raw_config: dict):
    """The TrainConfig of one count's uptraining, checked (budget of at least one step included)."""
    from uptrain.train.config import load_config
    from uptrain.train.setup import plan_run

    if args.uptrain_tokens is not None and args.uptrain_tokens < 1:
        raise UsageError(f"--uptrain-tokens must be a positive number of tokens, got {args.uptrain_tokens}")
    for item in args.uptrain_set:
        if item.partition("=")[0] in _FIXED_KEYS:
            raise UsageError(f"--uptrain-set {item}: the sweep sets {item.partition('=')[0]} itself "
                             "(--uptrain-tokens, --train-data, --data, --threads, the converted folder)")
    context = raw_config.get("max_position_embeddings")
    config = load_config(args.uptrain_config, uptrain_overrides(args, source, converted, run_dir))
    if context and config.data.seq_len > context and not _sets(args, "data.seq_len"):
        # blocks no longer than the model's positions (the recipe's 256 is the reference model's context)
        config = load_config(args.uptrain_config, uptrain_overrides(args, source, converted, run_dir,
                                                                     [f"data.seq_len={context}"]))
    try:
        plan_run(config, 1)
    except UsageError as err:
        raise UsageError(f"--uptrain-tokens {args.uptrain_tokens:,}: {err}") from None
    return config


def uptrain_settings(args: argparse.Namespace) -> dict:
    """What one count's uptraining is made with: a rerun keeps it only when these are the same."""
    recipe = args.uptrain_config.resolve()
    return {"tokens": args.uptrain_tokens, "recipe": str(recipe), "recipe_overrides": _recipe(args, None),
            "recipe_sha1": hashlib.sha1(recipe.read_bytes()).hexdigest(),
            "train_data": str(training_text(args).resolve()), "overrides": list(args.uptrain_set),
            "scored_on": str(args.data.resolve()), "stories": args.stories}


def bench_settings(args: argparse.Namespace) -> dict:
    return {"runtime": args.runtime, "context": args.bench_context, "new_tokens": args.bench_new_tokens,
            "batch": 1, "repeats": args.bench_repeats} | ({"outtype": args.outtype} if args.runtime == "llama.cpp" else {})


def run_extras(args: argparse.Namespace, source: Path, points: list, texts: list[str], max_length: int,
               stride: int, raw_config: dict, write: Callable[[list], None],
               mark: Callable[[Path], None] = lambda folder: None) -> None:
    """--bench on every point, then --uptrain-tokens on every converted one; `write(points)` after each;
    `mark(run_dir)` before an uptraining fills its run folder (the sweep's ownership mark)."""
    if args.bench:
        wanted = bench_settings(args)
        for point in points:
            if point.decode_tokens_per_s is not None and _same(point.bench, wanted):
                print(f"== {point.label}: decode speed kept from the earlier run", flush=True)
                continue
            print(f"== {point.label}: decode speed ({args.runtime}, {args.bench_context}-token prompt, "
                  f"{args.bench_new_tokens} new tokens, median of {args.bench_repeats})", flush=True)
            point.decode_tokens_per_s, point.bench = _bench(args, Path(point.folder), wanted)
            write(points)
    if args.uptrain_tokens is not None:
        wanted = uptrain_settings(args)
        for point in points[1:]:
            done = point.uptrained_folder and (Path(point.uptrained_folder) / "config.json").is_file()
            if point.loss_after_uptraining is not None and done and _same(point.uptrain_settings, wanted):
                print(f"== {point.label}: uptraining kept from the earlier run ({point.uptrained_folder})", flush=True)
                continue
            _uptrain_and_score(args, source, point, texts, max_length, stride, raw_config, wanted, mark)
            write(points)


def _same(recorded: dict | None, wanted: dict) -> bool:
    return recorded is not None and all(recorded.get(k) == v for k, v in wanted.items())


def _bench(args: argparse.Namespace, folder: Path, settings: dict) -> tuple[float, dict]:
    """(median decode tokens/s, the bench record) of one folder, timed by uptrain.bench's code."""
    if args.runtime == "llama.cpp":
        from uptrain.measure.bench_llama import run_llama_bench

        ns = argparse.Namespace(models=[str(folder)], context=[args.bench_context], new_tokens=args.bench_new_tokens,
                                repeats=args.bench_repeats, warmup=1, llama_cpp=args.llama_cpp, outtype=args.outtype)
        (result,) = run_llama_bench(ns)
        (d,) = result.decode
        return d.median, {**settings, "tokens_per_s": d.tokens_per_s, "threads": result.threads,
                          "gguf_bytes": result.gguf_bytes, "note": d.note}
    from uptrain.measure.bench import bench_model

    result = bench_model(str(folder), [args.bench_context], [1], args.bench_new_tokens, repeats=args.bench_repeats)
    (d,) = result.decode
    low, high = d.decode_range
    return d.decode_tokens_per_s, {**settings, "range": [low, high], "decode_times_s": d.decode_times_s,
                                   "threads": result.threads, "dtype": result.dtype, "note": d.unreliable}


def _uptrain_and_score(args: argparse.Namespace, source: Path, point, texts: list[str], max_length: int, stride: int,
                       raw_config: dict, settings: dict, mark: Callable[[Path], None]) -> None:
    """Uptrain `point`'s folder into OUT/<its folder>-uptrained/ and score model/ there; fills the point."""
    run_dir = args.out / f"{Path(point.folder).name}-uptrained"
    result, finished, seconds = train_and_score(args, source, point, run_dir, texts, max_length, stride, raw_config,
                                                mark)
    point.loss_after_uptraining, point.perplexity_after_uptraining = result.loss, result.perplexity
    point.fidelity_after_uptraining = fidelity_of(result)
    point.uptrain_tokens, point.uptrain_steps = finished["tokens"], finished["steps"]
    point.uptrain_seconds = seconds
    point.uptrained_folder, point.uptrain_settings = str(run_dir / "model"), settings


def train_and_score(args: argparse.Namespace, source: Path, point, run_dir: Path, texts: list[str], max_length: int,
                    stride: int, raw_config: dict, mark: Callable[[Path], None]):
    """Uptrain `point`'s converted folder for args.uptrain_tokens into `run_dir`, then score run_dir/model
    as the point was scored: (EvalResult, finished.json, seconds)."""
    from uptrain.measure.eval import evaluate_paths
    from uptrain.measure.fidelity import GreedySettings
    from uptrain.train import train
    from uptrain.train.recipe import describe

    config = uptrain_config(args, source, Path(point.folder), run_dir, raw_config)
    print(f"== {point.label}: uptrain {args.uptrain_tokens:,} tokens with {_shown(args.uptrain_config)} into "
          f"{run_dir} (training text {_shown(training_text(args))})", flush=True)
    print(f"   {describe() if args.uptrain_config == RECIPE else 'recipe: ' + _shown(args.uptrain_config)}", flush=True)
    began = time.monotonic()
    mark(run_dir)
    try:
        train(config)
    except BaseException as err:  # train() handles stop signals itself while it runs: its stop ends the sweep
        at_once.end_after_training_stop(err)
        raise
    finished = json.loads((run_dir / "finished.json").read_text())
    greedy = GreedySettings(**point.settings["scoring"]["fidelity"])  # as the point itself was scored
    (result,) = evaluate_paths([str(run_dir / "model")], texts, max_length, stride, reference=str(source),
                               greedy=greedy)
    seconds = round(time.monotonic() - began, 3)
    print(f"   {point.label} after {finished['tokens']:,} tokens: loss {point.loss:.4f} -> {result.loss:.4f} "
          f"({seconds:.0f} s)", flush=True)
    return result, finished, seconds


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def table_columns(points: list, source_loss: float) -> tuple[list[str], list[list[str]]]:
    """Extra table columns (headers, a row of cells per point) for what the points hold."""
    headers, cells = [], [[] for _ in points]
    if any(p.decode_tokens_per_s is not None for p in points):
        headers.append("decode tok/s")
        for row, p in zip(cells, points):
            note = " (noisy)" if p.bench and p.bench.get("note") else ""
            row.append("-" if p.decode_tokens_per_s is None else f"{p.decode_tokens_per_s:,.1f}{note}")
    if any(p.loss_after_uptraining is not None for p in points):
        tokens = sorted({p.uptrain_tokens for p in points if p.uptrain_tokens is not None})
        headers += [f"loss after uptraining ({' / '.join(f'{t:,}' for t in tokens)} tokens)", "vs source",
                    "KL to source after"]
        for row, p in zip(cells, points):
            after, kl = p.loss_after_uptraining, (p.fidelity_after_uptraining or {}).get("kl_to_source")
            row += ["-", "", "-"] if after is None else [f"{after:.4f}", f"{after / source_loss - 1:+.2%}",
                                                         "-" if kl is None else f"{kl:.4f}"]
    return headers, cells


def notes(points: list) -> list[str]:
    """Lines printed under the table: why a decode speed is not a number to quote."""
    return [f"{p.label}: decode speed {p.bench['note']}" for p in points if p.bench and p.bench.get("note")]


def after_uptraining(points: list) -> list:
    """Copies of the points that were uptrained, their loss and fidelity those after uptraining (for `recommend`)."""
    import dataclasses

    return [dataclasses.replace(p, loss=p.loss_after_uptraining, **(p.fidelity_after_uptraining or {}))
            for p in points if p.loss_after_uptraining is not None]
