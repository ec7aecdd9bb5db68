"""The budget forecast (uptrain.sweep.forecast) against known laws: exact on an exact law, unbiased and
with its 90% interval covering the truth about 90% of the time on noisy ones, over many random laws
and budgets."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from uptrain.sweep.forecast import fit_gap_law, gap_at, t_quantile_95, tokens_to


def test_an_exact_power_law_is_recovered_over_many_laws_and_budgets():
    rng = random.Random(0)
    for _ in range(500):
        a, alpha = math.exp(rng.uniform(-2, 6)), rng.uniform(0.05, 1.5)
        budgets = sorted(rng.sample(range(10_000, 5_000_000), rng.randint(2, 6)))
        law = fit_gap_law(budgets, [a * t ** -alpha for t in budgets])
        assert law.alpha == pytest.approx(alpha, rel=1e-9) and law.gap(budgets[0]) == pytest.approx(a * budgets[0] ** -alpha)
        target = a * (budgets[-1] * rng.uniform(0.5, 20)) ** -alpha
        got = tokens_to(law, target)
        assert got.tokens == pytest.approx((a / target) ** (1 / alpha), rel=1e-7)
        if got.low is not None:  # a perfect fit: no spread
            assert got.low == pytest.approx(got.tokens, rel=1e-6) and got.high == pytest.approx(got.tokens, rel=1e-6)


def test_the_interval_covers_the_truth_about_ninety_percent_of_the_time():
    """Noisy laws (multiplicative noise on the gap, 5 budgets): the forecast's 90% interval holds the
    true tokens in 85-95% of 2,000 draws (the delta method is an approximation; a wrong t quantile or a
    forgotten covariance term falls outside)."""
    rng = random.Random(1)
    hits, draws = 0, 2000
    for _ in range(draws):
        a, alpha = rng.uniform(0.5, 50), rng.uniform(0.2, 0.8)
        budgets = [250_000 * 2 ** k for k in range(5)]
        gaps = [a * t ** -alpha * math.exp(rng.gauss(0, 0.05)) for t in budgets]
        target = a * (budgets[-1] * 1.5) ** -alpha
        got = tokens_to(fit_gap_law(budgets, gaps), target)
        truth = (a / target) ** (1 / alpha)
        hits += got.low <= truth <= got.high
    assert 0.85 <= hits / draws <= 0.95, hits / draws


def test_the_gap_at_a_budget_is_the_law_s_and_its_interval_covers_the_truth():
    """`gap_at` (the predicted end of a larger run, scripts/studies/forecast_check.py): exact on exact laws;
    on noisy ones (4 budgets up to 2M, predicting 10M and 40M) its 90% interval holds the true gap in
    85-95% of 2,000 draws."""
    rng = random.Random(2)
    for _ in range(50):
        a, alpha = rng.uniform(0.05, 5), rng.uniform(0.05, 0.9)
        budgets = [rng.uniform(1e4, 1e7) for _ in range(rng.randint(2, 6))]
        law = fit_gap_law(budgets, [a * t ** -alpha for t in budgets])
        for t in (1e5, 4e7):
            assert gap_at(law, t)[0] == pytest.approx(a * t ** -alpha, rel=1e-9)
    for far in (10_000_000, 40_000_000):
        hits, draws = 0, 2000
        for _ in range(draws):
            a, alpha = rng.uniform(0.5, 5), rng.uniform(0.05, 0.5)
            budgets = [250_000 * 2 ** k for k in range(4)]
            law = fit_gap_law(budgets, [a * t ** -alpha * math.exp(rng.gauss(0, 0.03)) for t in budgets])
            _, low, high = gap_at(law, far)
            hits += low <= a * far ** -alpha <= high
        assert 0.85 <= hits / draws <= 0.95, (far, hits / draws)


def test_what_cannot_be_forecast_says_so():
    assert fit_gap_law([1e5, 1e5], [0.2, 0.1]) is None  # one budget
    assert fit_gap_law([1e5, 2e5, 4e5], [0.2, -0.01, 0.0]) is None  # one point above the source
    flat = tokens_to(fit_gap_law([1e5, 2e5, 4e5], [0.1, 0.11, 0.12]), 0.05)
    assert flat.tokens is None and "does not shrink" in flat.note
    two = tokens_to(fit_gap_law([1e5, 4e5], [0.2, 0.1]), 0.05)
    assert two.tokens == pytest.approx(1.6e6) and two.low is None and "no interval" in two.note
    assert "4x the largest budget fitted: an extrapolation" in two.note and two.extrapolation == pytest.approx(4.0)
    far = tokens_to(fit_gap_law([1e5, 2e5, 4e5], [0.2, 0.19, 0.18]), 0.01)
    assert "out of the fitted range" in far.note and far.extrapolation > 100
    assert t_quantile_95(1) == 6.314 and t_quantile_95(11) == 1.812 and t_quantile_95(1000) == pytest.approx(1.645, abs=1e-3)


def test_the_sweep_runs_each_budget_and_prints_each_counts_forecast(tmp_path):
    """`--uptrain-tokens A,B,C`: a run per budget from the converted folder, a law per count fitted to
    them (checked here against numpy's own least squares), its forecast printed and kept; a rerun
    keeps every run."""
    import json
    import os
    import subprocess
    import sys

    import numpy as np

    from conftest import EXAMPLE_MHA8, REPO, TRAIN_TXT, VALID_TXT

    out = tmp_path / "sweep"
    command = [sys.executable, "-m", "uptrain.sweep", str(EXAMPLE_MHA8), "--data", str(VALID_TXT), "--stories", "2",
               "--kv-heads", "2", "--out", str(out), "--uptrain-tokens", "4096,8192,16384", "--train-data",
               str(TRAIN_TXT), "--threads", "1", "--max-loss-increase", "0.001"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (point,) = [p for p in json.loads((out / "sweep.json").read_text())["points"] if p["kv_heads"] == 2]
    source = json.loads((out / "sweep.json").read_text())["points"][0]
    curve = point["uptrain_curve"]
    assert [e["tokens_asked"] for e in curve] == [4096, 8192, 16384]
    assert [Path(e["folder"]).parent.name for e in curve] == ["kv2-uptrained-4096", "kv2-uptrained-8192", "kv2-uptrained"]
    gaps = [e["loss"] - source["loss"] for e in curve]
    assert all(g > 0 for g in gaps)
    slope, intercept = np.polyfit(np.log([e["tokens"] for e in curve]), np.log(gaps), 1)
    assert point["forecast"]["alpha"] == pytest.approx(-slope, rel=1e-6)
    if slope < 0:
        want = math.exp((intercept - math.log(0.001 * source["loss"])) / -slope)
        assert point["forecast"]["tokens"] == pytest.approx(want, rel=1e-6)
    assert f"forecast: {point['forecast']['line']}" in done.stdout
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0 and again.stdout.count("run kept from the earlier run") == 2, again.stdout[-3000:]
    assert "uptraining kept from the earlier run" in again.stdout
