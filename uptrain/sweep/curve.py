"""`sweep --uptrain-tokens A,B,C`: a run per budget from each converted folder, and the forecast.

The largest budget is each point's own uptraining (`extras.py`: OUT/kv{K}-uptrained/). Every smaller
budget B is a run of its own from the same converted folder (its own cosine schedule, as a user who
chose B would train), into OUT/kv{K}-uptrained-{B}/, scored as the point was. The point keeps them
in `uptrain_curve`, each kept on a rerun when its settings are the same and its model is there. A
power law of the gap to the source against tokens (`forecast.py`) then gives each count's tokens to
the sweep's bound (`--max-loss-increase` x the source's loss), printed and kept in `forecast`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from uptrain.sweep import forecast as law
from uptrain.sweep.extras import _same, _with_budget, fidelity_of, train_and_score, uptrain_settings


def run_curves(args: argparse.Namespace, source: Path, points: list, texts: list[str], max_length: int,
               stride: int, raw_config: dict, write: Callable[[list], None], mark: Callable[[Path], None]) -> None:
    """Every smaller budget's run for every uptrained point, then each point's forecast (module doc)."""
    for point in points[1:]:
        if point.loss_after_uptraining is None or point.kv_cache != "model":
            continue
        curve = {e["tokens_asked"]: e for e in (point.uptrain_curve or [])}
        for budget in args.uptrain_budgets[:-1]:
            settings = uptrain_settings(_with_budget(args, budget))
            kept = curve.get(budget)
            if kept and _same(kept["settings"], settings) and (Path(kept["folder"]) / "config.json").is_file():
                print(f"== {point.label}: the {budget:,}-token run kept from the earlier run", flush=True)
                continue
            run_dir = args.out / f"{Path(point.folder).name}-uptrained-{budget}"
            result, finished, seconds = train_and_score(_with_budget(args, budget), source, point, run_dir, texts,
                                                        max_length, stride, raw_config, mark)
            curve[budget] = {"tokens_asked": budget, "tokens": finished["tokens"], "loss": result.loss,
                             "kl_to_source": fidelity_of(result)["kl_to_source"], "seconds": seconds,
                             "folder": str(run_dir / "model"), "settings": settings}
            point.uptrain_curve = sorted(curve.values(), key=lambda e: e["tokens"])
            write(points)
        largest = {"tokens_asked": args.uptrain_tokens, "tokens": point.uptrain_tokens,
                   "loss": point.loss_after_uptraining, "folder": point.uptrained_folder,
                   "kl_to_source": (point.fidelity_after_uptraining or {}).get("kl_to_source"),
                   "seconds": point.uptrain_seconds, "settings": point.uptrain_settings}
        curve[args.uptrain_tokens] = largest
        point.uptrain_curve = sorted(curve.values(), key=lambda e: e["tokens"])
        point.forecast = forecast_point(point, points[0].loss, args.max_loss_increase)
        print(f"   forecast: {point.forecast['line']}", flush=True)
        write(points)


def forecast_point(point, source_loss: float, max_increase: float) -> dict:
    """The point's forecast to within `max_increase` of the source's loss, from its curve's budgets."""
    asked = point.uptrain_curve
    tokens, gaps = [e["tokens"] for e in asked], [e["loss"] - source_loss for e in asked]
    target = max_increase * source_loss
    what = f"{point.label} to within {max_increase:.1%} of the source's loss"
    done = [e for e in asked if e["loss"] - source_loss <= target]
    if done:
        line = f"{what}: already at {done[0]['tokens']:,} tokens (the smallest budget that meets it)"
        return {"tokens": done[0]["tokens"], "low": None, "high": None, "line": line, "met_at": done[0]["tokens"]}
    fitted = law.fit_gap_law(tokens, gaps)
    if fitted is None:
        return {"tokens": None, "low": None, "high": None, "line": f"{what}: fewer than two budgets above the source"}
    result = law.tokens_to(fitted, target)
    return {**asdict(result), "alpha": fitted.alpha, "a": fitted.gap(1.0), "budgets": tokens,
            "line": law.describe(result, what)}
