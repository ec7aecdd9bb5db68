"""The trainer's ETA: a moving window of recent step times after the warm-up steps."""

from __future__ import annotations

import itertools
import random

import pytest

from uptrain.train.report.eta import SKIP_STEPS, EtaTracker, eta_seconds, format_eta


def _ends(durations, start=100.0):
    return list(itertools.accumulate(durations, initial=start))[1:]


def test_issue_22_run_slow_first_steps_then_steady():
    """A run whose first steps are 10x slower than the rest (issue 22: 32.1 min printed, 3:47 actual)."""
    steps, steady = 200, 1.0
    durations = [10.0, 10.0, 10.0] + [steady] * 10
    eta = eta_seconds(_ends(durations), steps - len(durations))
    assert eta == pytest.approx((steps - len(durations)) * steady)
    cumulative = sum(durations) / len(durations) * (steps - len(durations))  # what the old line printed
    assert cumulative > 2.5 * eta


def _cases():
    rng = random.Random(0)
    for n in (1, 2, 3, 4, 5, 6, 10, 32, 40, 64, 500):  # structured lengths
        yield [1.0] * n, n * 3
    for _ in range(300):
        n = rng.randint(1, 300)
        yield [rng.uniform(0.01, 5.0) for _ in range(n)], rng.randint(0, 5000)


def test_eta_properties():
    for durations, remaining in _cases():  # ~300 random step-time series and structured ones
        _check_eta(durations, remaining)


def _check_eta(durations, remaining):
    ends = _ends(durations)
    eta = eta_seconds(ends, remaining)
    timed = len(ends) - 1 - SKIP_STEPS
    if remaining == 0:
        assert eta == 0.0
        return
    if timed < 2:
        assert eta is None
        return
    after = durations[1 + SKIP_STEPS:]
    # between the fastest and slowest step after the warm-up, times the steps left
    assert min(after) * remaining * (1 - 1e-9) <= eta <= max(after) * remaining * (1 + 1e-9)
    # the warm-up steps do not count: making them 100x slower changes nothing
    slow = [d * 100 for d in durations[:1 + SKIP_STEPS]] + durations[1 + SKIP_STEPS:]
    assert eta_seconds(_ends(slow), remaining) == pytest.approx(eta)
    # a clock that runs twice as slow doubles it; twice the steps left doubles it
    assert eta_seconds(_ends([2 * d for d in durations]), remaining) == pytest.approx(2 * eta)
    assert eta_seconds(ends, 2 * remaining) == pytest.approx(2 * eta)


def test_a_recent_slowdown_shows_in_the_estimate():
    """The machine gets busy: the later steps are 3x slower, and the ETA follows them."""
    ends = _ends([1.0] * 60 + [3.0] * 60)
    assert eta_seconds(ends, 100) == pytest.approx(300.0)


def test_tracker_prints_when_known_then_only_on_a_real_change():
    t, printed, now = EtaTracker(), [], 0.0
    for step in range(200):
        now += 1.0 if step < 100 else 2.0
        eta = t.update(now, 300 - step - 1)
        if eta is not None:
            printed.append((step, eta))
    assert printed[0][0] == SKIP_STEPS + 2  # first ETA as soon as 2 steps after the warm-up are timed
    assert printed[0][1] == pytest.approx(300 - (SKIP_STEPS + 2) - 1)  # 1 s a step
    assert 2 <= len(printed) <= 4  # re-printed after the slowdown, not at every step
    assert printed[-1][0] > 100


def test_format_eta():
    assert format_eta(227) == "3:47" and format_eta(3723) == "1:02:03" and format_eta(0) == "0:00"
