"""How many uptraining tokens a bound will take: a law fitted to short runs (`sweep --uptrain-tokens A,B,C`).

The gap to the source after T tokens of uptraining, gap(T) = loss(T) - source loss, is fitted as a
power law, gap(T) = a * T^-alpha: least squares on log gap = log a - alpha log T (a straight line in
log-log axes). The tokens to reach a bound g* (the sweep's `--max-loss-increase` x the source's loss)
are T* = (a / g*)^(1 / alpha). Its interval is the 90% interval of log T* from the fit's parameter
covariance (the delta method, Student's t with n - 2 degrees of freedom): three budgets give one
degree of freedom and a wide interval, honestly; more budgets narrow it.

Pure math: tensors and files never enter; the sweep (`extras.py`) hands it (tokens, loss) pairs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

MAX_EXTRAPOLATION = 100  # beyond this many times the largest budget fitted, the forecast says it is out of range

# Student's t, two-sided 90% (the 0.95 quantile), by degrees of freedom; beyond the table: the normal's.
_T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812,
        12: 1.782, 15: 1.753, 20: 1.725, 30: 1.697}


def t_quantile_95(dof: int) -> float:
    """The 0.95 quantile of Student's t with `dof` degrees of freedom (the table's next lower entry)."""
    if dof < 1:
        raise ValueError("no degrees of freedom")
    if dof > 30:
        return NormalDist().inv_cdf(0.95)
    return _T95[max(k for k in _T95 if k <= dof)]


@dataclass(frozen=True)
class GapLaw:
    """gap(T) = exp(log_a) * T^-alpha, fitted to n points over tokens [low, high]."""

    log_a: float
    alpha: float
    n: int
    low: float
    high: float
    cov: tuple[tuple[float, float], tuple[float, float]] | None  # of (log_a, alpha); None with n = 2

    def gap(self, tokens: float) -> float:
        return math.exp(self.log_a - self.alpha * math.log(tokens))


@dataclass(frozen=True)
class Forecast:
    """The tokens to a target gap: the estimate, its 90% interval (None without one), and what it rests on."""

    tokens: float | None  # None: the law never reaches the target (the gap does not shrink)
    low: float | None
    high: float | None
    extrapolation: float | None  # tokens / the largest budget fitted (<= 1: inside the fitted range)
    note: str


def fit_gap_law(tokens: Sequence[float], gaps: Sequence[float]) -> GapLaw | None:
    """The power law through (tokens, gap) points with gap > 0 (others are left out: already at or
    below the source); None with fewer than two such points at distinct budgets."""
    pts = [(math.log(t), math.log(g)) for t, g in zip(tokens, gaps) if t > 0 and g > 0]
    xs = [x for x, _ in pts]
    if len(set(xs)) < 2:
        return None
    n = len(pts)
    mx, my = sum(xs) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    intercept = my - slope * mx
    cov = None
    if n > 2:
        s2 = sum((y - intercept - slope * x) ** 2 for x, y in pts) / (n - 2)
        var_b, var_a = s2 / sxx, s2 * (1 / n + mx * mx / sxx)
        cov_ab = -mx * s2 / sxx  # cov(intercept, slope); alpha = -slope
        cov = ((var_a, -cov_ab), (-cov_ab, var_b))
    return GapLaw(intercept, -slope, n, math.exp(min(xs)), math.exp(max(xs)), cov)


def tokens_to(law: GapLaw, target_gap: float) -> Forecast:
    """The tokens at which `law` reaches `target_gap` (> 0), with its 90% interval (module doc)."""
    if target_gap <= 0:
        raise ValueError("the target gap must be positive")
    if law.alpha <= 0:
        return Forecast(None, None, None, None, f"the gap does not shrink with tokens over {law.low:,.0f}-"
                        f"{law.high:,.0f} (fitted exponent {law.alpha:.3f}): no forecast")
    log_t = (law.log_a - math.log(target_gap)) / law.alpha
    tokens = math.exp(log_t)
    low = high = None
    if law.cov is not None:
        grad = (1 / law.alpha, -log_t / law.alpha)  # d log T* / d (log_a, alpha)
        var = sum(grad[i] * law.cov[i][j] * grad[j] for i in range(2) for j in range(2))
        half = t_quantile_95(law.n - 2) * math.sqrt(max(var, 0.0))
        low, high = math.exp(log_t - half), math.exp(log_t + half)
    ratio = tokens / law.high
    if ratio <= 1:
        note = "within the fitted budgets"
    elif ratio <= MAX_EXTRAPOLATION:
        note = f"{ratio:.3g}x the largest budget fitted: an extrapolation"
    else:
        note = (f"out of the fitted range ({ratio:.3g}x the largest budget fitted, {law.high:,.0f} tokens; more than "
                f"{MAX_EXTRAPOLATION}x is not a forecast): give larger budgets")
    if law.cov is None:
        note += "; two budgets: no interval (give three or more)"
    return Forecast(tokens, low, high, ratio, note)


def gap_at(law: GapLaw, tokens: float) -> tuple[float, float, float]:
    """The law's gap after `tokens` with its 90% interval (the delta method on log gap = log_a - alpha
    log T; the estimate itself where the law has no covariance)."""
    log_t = math.log(tokens)
    log_gap = law.log_a - law.alpha * log_t
    if law.cov is None:
        return math.exp(log_gap), math.exp(log_gap), math.exp(log_gap)
    grad = (1.0, -log_t)  # d log gap / d (log_a, alpha)
    var = sum(grad[i] * law.cov[i][j] * grad[j] for i in range(2) for j in range(2))
    half = t_quantile_95(law.n - 2) * math.sqrt(max(var, 0.0))
    return math.exp(log_gap), math.exp(log_gap - half), math.exp(log_gap + half)


def describe(forecast: Forecast, what: str) -> str:
    """One line: `what` needs ~T tokens [low-high] (note)."""
    if forecast.tokens is None:
        return f"{what}: {forecast.note}"
    interval = "" if forecast.low is None else f" (90% interval {forecast.low:,.3g}-{forecast.high:,.3g})"
    return f"{what}: ~{forecast.tokens:,.3g} tokens{interval}; {forecast.note}"
