"""What `uptrain.sweep` prints and draws: the table, the warnings, the plots and the recommendation.

Every point is scored against the source (`uptrain.measure.fidelity`): beside the loss, the KL to
the source, top-1 and greedy agreement. The recommendation is the smallest count within
`--max-loss-increase` of the source's loss (and, with `--max-kl`, within that KL); where the loss
cannot choose (the source near chance on the text, or a conversion beating its source beyond the
noise: `fidelity_warnings`), it rests on the KL alone, bounded by `--max-kl` or by default by the
loss bound in nats (max_loss_increase x the source's loss: on text the source models well, a
model's loss increase over its source is about its KL to it).
"""

from __future__ import annotations

from dataclasses import asdict

from uptrain.cli import format_table
from uptrain.sweep.extras import after_uptraining, notes, table_columns
from uptrain.sweep.precision import recommend_pair
from uptrain.sweep.record import RECORDS

PLOTS = {"loss": "sweep.png", "kl_to_source": "sweep-fidelity.png"}


def _fidelity(p) -> str:
    """' (KL 0.0123 nats/token to the source, top-1 97.1%, greedy 88.0%)' or '' (not measured)."""
    if getattr(p, "kl_to_source", None) is None:
        return ""
    greedy = "" if p.greedy_agreement is None else f", greedy {p.greedy_agreement:.1%}"
    return f" (KL {p.kl_to_source:.4f} nats/token to the source, top-1 {p.top1_agreement:.1%}{greedy})"


def _by_fidelity(points: list, source_loss: float, max_increase: float, max_kl: float | None) -> str:
    """The recommendation when the loss cannot choose: the smallest count within the KL bound."""
    bound = max_kl if max_kl is not None else max_increase * source_loss
    why = "--max-kl" if max_kl is not None else f"the loss bound in nats, {max_increase:.1%} x {source_loss:.4f}"
    measured = [p for p in points if p.kl_to_source is not None]
    if not measured:
        return "the loss cannot choose here (see the warnings) and fidelity was not measured: rerun the sweep"
    fitting = [p for p in measured if p.kl_to_source <= bound]
    if not fitting:
        best = min(measured, key=lambda p: p.kl_to_source)
        return (f"the loss cannot choose here (see the warnings); by fidelity none of the counts is within KL "
                f"{bound:.4f} of the source ({why}); the closest is {best.kv_heads} K/V heads{_fidelity(best)}")
    pick = min(fitting, key=lambda p: p.kv_heads)
    return (f"the loss cannot choose here (see the warnings); by fidelity, recommended: {pick.kv_heads} K/V heads, "
            f"the smallest count within KL {bound:.4f} of the source ({why}){_fidelity(pick)}, a KV cache "
            f"{points[0].settings['source_kv_heads'] / pick.kv_heads:g}x smaller")


def recommend(points: list, source_loss: float, max_increase: float, max_kl: float | None = None,
              loss_misleads: bool = False) -> str:
    """The smallest K/V count of the chosen method within `max_increase` of the source's loss (and
    `max_kl` of it, when given); by fidelity alone when `loss_misleads` (module doc)."""
    if loss_misleads:
        return _by_fidelity(points, source_loss, max_increase, max_kl)
    bound = source_loss * (1 + max_increase)
    kl_ok = (lambda p: True) if max_kl is None else (
        lambda p: getattr(p, "kl_to_source", None) is not None and p.kl_to_source <= max_kl)
    within = f"{max_increase:.1%} of the source's loss" + ("" if max_kl is None else f" and KL {max_kl:g} of it")
    fitting = [p for p in points if p.loss <= bound and kl_ok(p)]
    if not fitting:
        best = min(points, key=lambda p: p.loss)
        return (f"none of the counts is within {within} (loss at most {bound:.4f}, the source's {source_loss:.4f}); "
                f"the closest is {best.kv_heads} K/V heads at {best.loss:.4f} ({best.loss / source_loss - 1:+.1%})"
                f"{_fidelity(best)}: uptrain it, or keep more K/V heads")
    pick = min(fitting, key=lambda p: p.kv_heads)
    return (f"recommended: {pick.kv_heads} K/V heads, the smallest count within {within} ({pick.loss:.4f} vs "
            f"{source_loss:.4f}, {pick.loss / source_loss - 1:+.2%}){_fidelity(pick)}, a KV cache "
            f"{points[0].settings['source_kv_heads'] / pick.kv_heads:g}x smaller")


def warnings(points: list, vocab_size: int) -> list[str]:
    """`fidelity_warnings` of the points (the source first), also on the losses after uptraining."""
    from uptrain.measure.fidelity import fidelity_warnings

    rows = [(_name(p), p.loss, p.loss_vs_source, p.loss_vs_source_se) for p in points[1:]]
    return fidelity_warnings(points[0].loss, vocab_size, rows)


def _name(p) -> str:
    name = "source" if p.method == "source" else f"{p.method} kv{p.kv_heads}"
    return name if p.kv_cache == "model" else f"{name} {p.kv_cache}"


def _fidelity_cells(p) -> list[str]:
    if p.kl_to_source is None:
        return ["-", "-", "-", "-"]
    from uptrain.measure.fidelity import greedy_cell

    greedy = greedy_cell(p.greedy_agreement, p.greedy_agreement_se)
    copy = "-" if getattr(p, "copy_top1", None) is None else (
        f"{p.copy_top1:.1%}" + ("" if p.copy_gain_kept is None else f" ({p.copy_gain_kept:.0%})"))
    return [f"{p.kl_to_source:.4f}", f"{p.top1_agreement:.1%}", greedy, copy]


def report(args, points: list, method: str, vocab_size: int, start_note: str | None = None,
           refused: dict | None = None) -> None:
    """The table, the warnings, the plots and the recommendation (and one after uptraining);
    start_note: what kind of start the counts are when not the quality path's (`ConversionOptions.start_note`);
    refused: the --kv-cache formats left out, with why. With cache formats, a second recommendation over
    K/V heads x cache (`precision.recommend_pair`)."""
    from uptrain.convert.plan import human_bytes
    from uptrain.measure.plots import plot_sweep

    source = points[0]
    rows = [[_name(p), p.kv_heads, p.kv_cache, f"{p.loss:.4f}", f"{p.perplexity:.3f}", f"{p.loss / source.loss - 1:+.2%}",
             *_fidelity_cells(p), f"{p.kv_bytes_per_token:,.4g} B", human_bytes(p.kv_bytes_at_context),
             f"{source.kv_bytes_per_token / p.kv_bytes_per_token:.3g}x"] for p in points]
    extra_headers, extra_cells = table_columns(points, source.loss)  # --bench, --uptrain-tokens
    print(format_table(["model", "K/V heads", "KV cache", "loss", "perplexity", "vs source", "KL to source", "top-1 agr.",
                        "greedy agr.", "copy top-1 (gain kept)", "KV / token", f"KV at {source.settings['context']:,} tokens x {args.batch}",
                        "KV reduction", *extra_headers], [row + extra for row, extra in zip(rows, extra_cells)]))
    if any(p.greedy_agreement_se is not None for p in points):
        from uptrain.measure.fidelity import GREEDY_SE_NOTE

        print(f"greedy agr.: {GREEDY_SE_NOTE}")
    if any(getattr(p, "copy_top1", None) is not None for p in points):
        print("copy top-1 (gain kept): a passage read again after other text, the share of its tokens predicted "
              "exactly, and the share of the source's loss gain on the second reading kept (uptrain.measure.copy_probe)")
    for line in notes(points):
        print(line)
    for p in points:  # --uptrain-tokens A,B,C: the tokens each count needs to the bound (uptrain.sweep.forecast)
        if getattr(p, "forecast", None):
            print(f"forecast: {p.forecast['line']}")
    said = warnings(points, vocab_size)  # the loss cannot be read at face value (they decide what recommends)
    from uptrain.measure.copy_probe import copy_warning

    for line in [*said, *(w for p in points[1:] if (w := copy_warning(_name(p), asdict(p))))]:
        print(line)
    for metric, name in PLOTS.items():
        plot_sweep([asdict(p) for p in points], args.out / name, metric=metric)
    pairs = [p for p in points[1:] if p.label.startswith(method + " ")]
    chosen = [p for p in pairs if p.kv_cache == "model"]
    quantized_source = [p for p in points[1:] if p.method == "source"]
    for name, why in (refused or {}).items():
        print(f"--kv-cache {name}: left out: {why}")
    if start_note:
        print(f"note: these are the numbers of a {start_note}")
    print(recommend(chosen, source.loss, args.max_loss_increase, args.max_kl, loss_misleads=bool(said))
          + (f" ({method} start: see the note)" if start_note else ""))
    if quantized_source:
        print(recommend_pair(pairs + quantized_source, source, args.max_loss_increase, args.max_kl, bool(said)))
    uptrained = after_uptraining(chosen)
    if uptrained:
        later = warnings([source, *uptrained], vocab_size)
        print("after uptraining: " + recommend(uptrained, source.loss, args.max_loss_increase, args.max_kl,
                                               loss_misleads=bool(later)))
        if quantized_source:
            print("after uptraining: " + recommend_pair(after_uptraining(pairs) + quantized_source, source,
                                                        args.max_loss_increase, args.max_kl, bool(later)))
    print(f"wrote {args.out / RECORDS}, {' and '.join(str(args.out / n) for n in PLOTS.values())}")


def print_estimate(plans: dict, score_s: float) -> None:
    """The sweep's plan: what the conversions will take at most (refine's measured step time, as the
    converter's plan states it for one count) and the scoring, from the source's own scoring time."""
    from uptrain.units import human_seconds

    refine = [p.refinement["probe"].get("seconds_at_most") for p in plans.values() if p.refinement]
    parts = []
    if refine and all(s is not None for s in refine):
        parts.append(f"refinement at most {human_seconds(sum(refine))} ({len(refine)} counts, early stopping "
                     f"usually ends sooner)")
    parts.append(f"scoring about {human_seconds(score_s * len(plans))} ({len(plans)} models at the source's "
                 f"{human_seconds(score_s)})")
    print(f"   plan: {'; '.join(parts)}; the calibration stream and the reads once for all", flush=True)

