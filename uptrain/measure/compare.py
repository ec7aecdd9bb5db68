"""The whole trade in one table: a source MHA model against its GQA conversions.

`python -m uptrain.compare SOURCE_MHA GQA [GQA ...] --data FILE... [bench options] [--kv-cache NAME]`

For every model: KV-cache bytes per token (measured) and the reduction against the source,
median decode tokens/s and the speed-up against the source, loss and perplexity on the
data and the perplexity change, and its fidelity to the source (the reference: KL to source, top-1
and greedy agreement, uptrain.measure.fidelity). Reuses `uptrain.eval` and `uptrain.bench`.
`--kv-cache NAME`: every model (the source too) scored and sized with its K/V cache stored in that
format (uptrain.measure.kv_cache), against the source as saved; the KV reduction is against the
source's cache as saved, so the source's own row shows what the cache format alone gives.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from uptrain.measure.bench import BenchResult, add_bench_args, bench_from_args, write_outputs
from uptrain.errors import exit_on_usage_error
from uptrain.cli import ArgParser, distinct_names, format_table, prog_name
from uptrain.threads import announce_threads, start_threads
from uptrain.measure.eval import (EvalResult, add_data_args, evaluate_paths, fidelity_records, print_fidelity_warnings,
                                  read_cli_documents, window_args)
from uptrain.measure.fidelity import add_fidelity_args, greedy_from_args
from uptrain.measure.kv_cache import add_kv_cache_arg, check_paths, kv_format


@dataclass
class Comparison:
    """One model against the source (the source itself has ratios of 1)."""

    model: str
    kv_heads: int
    kv_reduction: float  # the source's KV bytes as saved / this model's KV bytes in `kv_cache`
    decode_speedup: dict[str, float]  # "batch x context" -> this tok/s / source tok/s
    decode_unreliable: dict[str, str]  # "batch x context" -> why that speed-up is not a number to quote
    loss: float
    perplexity: float
    perplexity_change_pct: float
    eval: EvalResult
    bench: BenchResult
    kl_to_source: float | None = None  # fidelity to the source (eval's fields; None when not measured)
    top1_agreement: float | None = None
    greedy_agreement: float | None = None
    greedy_agreement_se: float | None = None
    kv_cache: str = "model"  # the K/V cache format it was scored and sized in
    kv_bytes_per_token: float | None = None  # in that format, block scales counted


def compare(evals: Sequence[EvalResult], benches: Sequence[BenchResult]) -> list[Comparison]:
    """Ratios of every model against the first (the source); inputs are in the same order."""
    src_e, src_b = evals[0], benches[0]
    src_bytes = src_b.kv_bytes_per_token_stored or src_b.kv_bytes_per_token  # as saved, whatever format is scored
    src_speed = {(d.batch, d.context): d.decode_tokens_per_s for d in src_b.decode}
    rows = []
    for e, b in zip(evals, benches):
        speedup = {f"{d.batch}x{d.context}": d.decode_tokens_per_s / src_speed[(d.batch, d.context)]
                   for d in b.decode if (d.batch, d.context) in src_speed}
        # a ratio is only as good as both timings behind it
        unreliable = {f"{d.batch}x{d.context}": why for d in (*src_b.decode, *b.decode)
                      if (why := d.unreliable) is not None}
        rows.append(Comparison(
            model=e.model, kv_heads=b.kv_heads, kv_reduction=src_bytes / b.kv_bytes_per_token,
            decode_speedup=speedup, decode_unreliable=unreliable, loss=e.loss, perplexity=e.perplexity,
            perplexity_change_pct=100.0 * (e.perplexity / src_e.perplexity - 1.0), eval=e, bench=b,
            kl_to_source=e.kl_to_source, top1_agreement=e.top1_agreement, greedy_agreement=e.greedy_agreement,
            greedy_agreement_se=e.greedy_agreement_se, kv_cache=b.kv_cache, kv_bytes_per_token=b.kv_bytes_per_token,
        ))
    return rows


def _geo_mean(row: Comparison, reliable: list[float]) -> str:
    """Geometric-mean speed-up over the settings whose timings can be quoted."""
    if reliable:
        return f"{statistics.geometric_mean(reliable):.2f}x"
    return "not measurable (see below)" if row.decode_speedup else "-"


def _speed_cell(row: Comparison, speed: dict[str, float], setting: str) -> str:
    """'tok/s (speed-up)' or, when either timing is unreliable, the reason instead of a ratio."""
    if setting not in speed:
        return "-"
    if setting in row.decode_unreliable:
        return f"{speed[setting]:.1f} ({row.decode_unreliable[setting]})"
    return f"{speed[setting]:.1f} ({row.decode_speedup[setting]:.2f}x)"


def _fidelity_cells(row: Comparison) -> list[str]:
    """KL to source, top-1 and greedy agreement ("-" where not measured)."""
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    from uptrain.measure.fidelity import greedy_cell

    kl = "-" if row.kl_to_source is None else f"{row.kl_to_source:.4f}"
    return [kl, pct(row.top1_agreement), greedy_cell(row.greedy_agreement, row.greedy_agreement_se)]


def comparison_table(rows: Sequence[Comparison]) -> str:
    """Markdown: a summary line per model, then decode tok/s (speed-up) per batch x context."""
    speedups = [[v for k, v in r.decode_speedup.items() if k not in r.decode_unreliable] for r in rows]
    fidelity = any(r.kl_to_source is not None for r in rows)  # columns only where measured
    summary = format_table(
        ["model", "kv heads", "KV cache", "KV B/token", "KV reduction", "loss", "perplexity", "ppl change",
         *(["KL to source", "top-1 agr.", "greedy agr."] if fidelity else []), "decode speed-up (geo-mean)"],
        [[r.model, r.kv_heads, r.kv_cache, f"{r.bench.kv_bytes_per_token:g}", f"{r.kv_reduction:.2f}x", f"{r.loss:.4f}",
          f"{r.perplexity:.3f}", f"{r.perplexity_change_pct:+.2f}%", *(_fidelity_cells(r) if fidelity else []),
          _geo_mean(r, s)] for r, s in zip(rows, speedups)],
    )
    if any(r.greedy_agreement_se is not None for r in rows):
        from uptrain.measure.fidelity import GREEDY_SE_NOTE

        summary += f"\ngreedy agr.: {GREEDY_SE_NOTE}"
    speed = [{f"{d.batch}x{d.context}": d.decode_tokens_per_s for d in r.bench.decode} for r in rows]
    settings = list(rows[0].decode_speedup)
    if not settings:
        return summary
    names = distinct_names([r.model for r in rows])
    detail = format_table(
        ["batch x context"] + [f"{n} tok/s (speed-up)" for n in names],
        [[s] + [_speed_cell(r, sp, s) for r, sp in zip(rows, speed)] for s in settings],
    )
    return summary + "\n\n" + detail


@exit_on_usage_error
def main(argv: Sequence[str] | None = None) -> int:
    """CLI: evaluate and benchmark the source and each GQA model, print the comparison."""
    parser = ArgParser(prog=prog_name("uptrain.compare"), description=__doc__.splitlines()[0])
    parser.add_argument("source", metavar="SOURCE_MHA", help="the original model folder")
    parser.add_argument("gqa", nargs="+", metavar="GQA", help="converted / uptrained model folders")
    add_data_args(parser)
    add_bench_args(parser)
    add_fidelity_args(parser, reference=False)  # the source is the reference
    add_kv_cache_arg(parser)
    parser.add_argument("--json", metavar="PATH", help="also write results as JSON (- for stdout)")
    from uptrain.measure import tasks as lm_tasks

    lm_tasks.add_task_args(parser)
    args = parser.parse_args(argv)
    start_threads(args.threads)  # before the evaluation: the one setting covers all the work
    paths = [args.source, *args.gqa]
    task_names, manager = lm_tasks.tasks_from_args(args)  # refuse bad --tasks before any scoring
    check_paths(kv_format(args.kv_cache), paths)  # a format a model cannot take: refused before any work
    max_length, stride = window_args(args, paths)
    greedy = greedy_from_args(args, max_length, args.source)
    texts = read_cli_documents(args)
    announce_threads()
    evals = evaluate_paths(paths, texts, max_length, stride, args.dtype, args.device, args.source, greedy,
                           args.kv_cache)
    benches = bench_from_args(args, paths)
    rows = compare(evals, benches)
    out = sys.stderr if args.json == "-" else sys.stdout
    print(f"perplexity: max_length {max_length}, stride {stride}, {evals[0].documents} documents; "
          f"decode: {args.new_tokens} new tokens, median of {args.repeats}; settings are batch x context", file=out)
    print(f"fidelity to the source: KL(source || model) nats/token and top-1 agreement over the {evals[0].tokens:,} "
          f"scored tokens; greedy agreement over {evals[0].greedy_prompts} prompts of {evals[0].prompt_tokens} tokens, "
          f"{evals[0].continuation_tokens} continued", file=out)
    print(comparison_table(rows), file=out)
    print_fidelity_warnings(evals, out=out)
    records = [asdict(r) | {"warnings": w} for r, w in zip(rows, fidelity_records(evals))]
    if task_names:  # accuracy (± standard error) of every model on lm-eval tasks
        scores = lm_tasks.score_paths(paths, task_names, manager, max_length, args.task_limit, args.dtype, args.device)
        lm_tasks.print_task_scores(args, paths, scores, max_length, out)
        records = [r | {"tasks": lm_tasks.scores_json(s)} for r, s in zip(records, scores)]
    write_outputs(args, records, [asdict(b) for b in benches])
    return 0


if __name__ == "__main__":
    sys.exit(main())
