"""scripts/lr_sweep.py: short runs at several peak learning rates, the lowest validation loss wins."""

from __future__ import annotations

import json
import math
import random
import re
import sys

import pytest

from conftest import REPO, built_gqa4

sys.path.insert(0, str(REPO / "scripts"))
import lr_sweep  # noqa: E402
from uptrain.errors import UsageError  # noqa: E402


def test_best_lr_is_the_lowest_finite_loss_and_flags_the_ends_of_the_grid():
    rng = random.Random(0)
    for trial in range(500):
        lrs = sorted(rng.sample([1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3], rng.randint(1, 8)))
        losses = {lr: (math.nan if rng.random() < 0.2 else round(rng.uniform(1, 5), rng.choice([1, 4])))
                  for lr in lrs}
        if all(math.isnan(v) for v in losses.values()):
            with pytest.raises(UsageError, match="diverged"):
                lr_sweep.best_lr(losses)
            continue
        best, at_edge = lr_sweep.best_lr(losses)
        finite = {lr: v for lr, v in losses.items() if not math.isnan(v)}
        assert finite[best] == min(finite.values())
        assert best == min(lr for lr, v in finite.items() if v == finite[best])  # ties: the smaller rate
        assert at_edge == (len(lrs) > 1 and best in (lrs[0], lrs[-1]))
    # structured: a valley in the middle is not at an edge; a loss that keeps falling is
    assert lr_sweep.best_lr({1e-5: 3.0, 3e-5: 2.5, 1e-4: 2.7}) == (3e-5, False)
    assert lr_sweep.best_lr({1e-5: 3.0, 3e-5: 2.5, 1e-4: 2.2}) == (1e-4, True)


def test_rates_within_the_tie_of_the_lowest_loss_are_a_tie():
    """Before: "best" was named over a difference of 7e-6 nats."""
    rng = random.Random(1)
    for trial in range(500):
        lrs = sorted(rng.sample([1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3], rng.randint(1, 8)))
        losses = {lr: math.nan if rng.random() < 0.1 else rng.choice([2.0, 2.0 + rng.uniform(0, 0.02)])
                  for lr in lrs}
        if all(math.isnan(v) for v in losses.values()):
            continue
        best, _ = lr_sweep.best_lr(losses)
        close = lr_sweep.tied(losses, best)
        assert best in close and close == sorted(close)
        for lr, loss in losses.items():
            inside = loss == loss and loss <= losses[best] * (1 + lr_sweep.TIE)
            assert (lr in close) == inside, (losses, close)
    assert lr_sweep.tied({1e-4: 2.000007, 3e-4: 2.0}, 3e-4) == [1e-4, 3e-4]
    assert lr_sweep.tied({1e-4: 2.1, 3e-4: 2.0}, 3e-4) == [3e-4]


def test_sweep_on_the_tiny_model_runs_each_rate_and_names_the_best(tmp_path, capsys, one_torch_thread):
    model = built_gqa4()
    out = tmp_path / "sweep"
    rc = lr_sweep.main([str(REPO / "configs" / "demo-cpu.yaml"), f"model={model}", "optim.warmup_steps=0",
                        "log.progress_bar=false", "log.log_with=[]", "eval.every=0", "checkpoint.every=0",
                        "--lrs", "1e-5", "3e-3", "--tokens", "4096", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    table = dict(re.findall(r"\| (1e-05|0\.003) +\| ([0-9.]+)", printed))
    assert set(table) == {"1e-05", "0.003"}
    # each row is its run's own final validation loss, at its own peak lr
    for lr, shown in table.items():
        final = json.loads((out / f"lr{float(lr):g}" / "metrics.jsonl").read_text().splitlines()[-1])
        assert final["val_loss"] == pytest.approx(float(shown), abs=5e-5)
    best = min(table, key=lambda lr: float(table[lr]))
    assert f"best: optim.lr={float(best):g} (at the end of the range" in printed


def test_bad_rates_are_one_line(capsys):
    assert lr_sweep.main([str(REPO / "configs" / "demo-cpu.yaml"), "--lrs", "1e-4", "-1"]) == 2
    assert capsys.readouterr().err.startswith("error: --lrs must be distinct positive numbers")
