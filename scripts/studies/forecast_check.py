"""The budget forecast checked on our curve (issue 61): fit `uptrain.sweep.forecast`'s law to runs of at most
2M tokens, predict the 10M- and 40M-token ends, and compare with the runs.

    python scripts/studies/quality_curve.py --cells recipe-samples-lr5e-4 --tokens 250000 --every 100000 --jobs 1
    # ... the same at 500000, 1000000, 2000000 (records appended to results/quality-curve.jsonl); the 10M and 40M
    # ends: --tokens 10000000 / 40000000 (a 40M run stopped is continued by rerunning its trainer with resume=latest)
    python scripts/studies/forecast_check.py        # the table of results/quality-curve.md's forecast section

The cell: stories260K-mha8 -> 2 K/V heads, the quality-path start, fresh samples of the source, lr 5e-4,
pure distillation (scripts/studies/quality_curve.py). The law is the sweep's: gap(T) = a * T^-alpha,
least squares in log-log axes; each predicted end has the 90% interval of the fit (delta method, t with
n - 2 degrees of freedom). Runs with another seed (`seed=N` among their overrides) are left out.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from uptrain.sweep.forecast import describe, fit_gap_law, gap_at, tokens_to

REPO = Path(__file__).resolve().parents[2]
SOURCE_LOSS = 1.6671  # the source on the README's held-out stories (scripts/studies/quality_curve.py)
CELL, KV = "recipe-samples-lr5e-4", 2
FIT_UP_TO, CHECKS = 2_000_000, (10_000_000, 40_000_000)
TARGET = 1.750  # issue 61's no-data demo target: within 5% of the source


def ends(record: Path, cell: str = CELL) -> dict[int, float]:
    """The cell's final held-out loss per budget (the latest run of each budget)."""
    out = {}
    for line in record.read_text().splitlines():
        r = json.loads(line) if line.strip() else None
        if r and r["cell"] == cell and r["kv_heads"] == KV and not any(o.startswith("seed=") for o in r["overrides"]):
            out[r["tokens"]] = r["final"]["loss"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record", type=Path, default=REPO / "results" / "quality-curve.jsonl")
    p.add_argument("--cell", default=CELL, help=f"the cell whose budgets are fitted (default {CELL})")
    args = p.parse_args()
    measured = ends(args.record, args.cell)
    fitted = sorted(t for t in measured if t <= FIT_UP_TO)
    gaps = [measured[t] - SOURCE_LOSS for t in fitted]
    law = fit_gap_law(fitted, gaps)
    print(f"fitted on {', '.join(f'{t:,}' for t in fitted)} tokens (ends {', '.join(f'{measured[t]:.4f}' for t in fitted)}): "
          f"gap = {math.exp(law.log_a):.4g} x T^-{law.alpha:.4f}")
    print("| tokens | predicted end (90% interval) | measured end | predicted - measured |")
    print("|---|---|---|---|")
    for t in CHECKS:
        gap, low, high = gap_at(law, t)
        got = measured.get(t)
        print(f"| {t:,} | {SOURCE_LOSS + gap:.4f} ({SOURCE_LOSS + low:.4f}-{SOURCE_LOSS + high:.4f}) | "
              f"{'not yet run' if got is None else f'{got:.4f}'} | "
              f"{'—' if got is None else f'{SOURCE_LOSS + gap - got:+.4f}'} |")
    print(describe(tokens_to(law, TARGET - SOURCE_LOSS), f"\n{args.cell} to {TARGET} (the no-data demo's target)"))


if __name__ == "__main__":
    main()
