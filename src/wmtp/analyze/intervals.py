"""Intervals that hold their stated level at the studies' small n, and the verdict each one supports.

The studies measure a handful of prompts per rung (the Spark study 4–6, the embedded study 3), and every
arm gets the same prompts. So comparisons are made on pairs, one per prompt, and on the log scale where
decode rates vary multiplicatively:

- a speedup is the geometric mean over prompts of arm/none, with a Student-t interval on the mean of the
  paired log ratios (exact for log-normal noise, whatever n ≥ 2);
- the change of a speedup between two rungs (different prompts, so unpaired) is the difference of the two
  speedups with a delta-method standard error and Welch–Satterthwaite degrees of freedom;
- a mean of per-request values (acceptance, tokens per verify) or of paired differences of them uses a
  Student-t interval.

A percentile bootstrap of a median of 3 is [min, max], which covers about 75 %, not 95 %:
tests/test_intervals.py simulates studies of known truth at the studies' own n and checks that each
interval here covers 93–97 % of the time at 95 %. Student-t quantiles are computed here (the regularised
incomplete beta function), so the pipeline needs no statistics package.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

LEVEL = 0.95
RESOLVED = "resolved"
NOT_RESOLVED = "not resolved"


class Interval(NamedTuple):
    value: float
    lo: float
    hi: float
    n: int

    @property
    def finite(self) -> bool:
        return math.isfinite(self.lo) and math.isfinite(self.hi)


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """Lentz's evaluation of the incomplete beta function's continued fraction."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for numerator in (
            m * (b - m) * x / ((a + m2 - 1) * (a + m2)),
            -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularised incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student-t distribution function with ``df`` (possibly fractional) degrees of freedom."""
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on :func:`t_cdf`; 1e-10 accurate)."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0 (got p={p}, df={df})")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10:
            break
    return 0.5 * (lo + hi)


def _clean(values: Sequence[float] | np.ndarray) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    return array[np.isfinite(array)]


def mean_interval(values: Sequence[float] | np.ndarray, level: float = LEVEL) -> Interval:
    """Mean with a Student-t interval; a single value, or values without spread, have no interval.

    Values that do not vary (two arms that accepted the same on every prompt, say) give the t interval zero
    width, which would claim certainty from a handful of prompts: no spread observed is not no uncertainty.
    """
    x = _clean(values)
    n = len(x)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = float(x.mean())
    sd = float(x.std(ddof=1)) if n > 1 else 0.0
    if n < 2 or sd == 0.0:
        return Interval(mean, math.nan, math.nan, n)
    half = t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def paired_difference_interval(
    arm: Sequence[float] | np.ndarray, base: Sequence[float] | np.ndarray, level: float = LEVEL
) -> Interval:
    """Mean of arm − base over pairs (the same prompt in both), with a Student-t interval."""
    a, b = np.asarray(arm, dtype=float), np.asarray(base, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired values differ in count ({a.shape} vs {b.shape})")
    return mean_interval(a - b, level)


def ratio_interval(
    arm: Sequence[float] | np.ndarray, base: Sequence[float] | np.ndarray, level: float = LEVEL
) -> Interval:
    """Geometric mean over pairs of arm/base with the t interval of the mean paired log ratio, mapped back."""
    a, b = np.asarray(arm, dtype=float), np.asarray(base, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired values differ in count ({a.shape} vs {b.shape})")
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log(a) - np.log(b)
    d = mean_interval(logs, level)
    return Interval(math.exp(d.value) if d.n else math.nan, math.exp(d.lo), math.exp(d.hi), d.n)


def ratio_change_interval(
    arm_from: Sequence[float] | np.ndarray,
    base_from: Sequence[float] | np.ndarray,
    arm_to: Sequence[float] | np.ndarray,
    base_to: Sequence[float] | np.ndarray,
    level: float = LEVEL,
) -> Interval:
    """Speedup at ``to`` minus speedup at ``from`` (paired within a rung, independent across rungs).

    Each speedup is exp(mean log ratio); its standard error is speedup × se(mean log ratio) (delta method);
    the degrees of freedom of the difference are Welch–Satterthwaite's.
    """
    parts = []
    for arm, base in ((arm_from, base_from), (arm_to, base_to)):
        a, b = np.asarray(arm, dtype=float), np.asarray(base, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = _clean(np.log(a) - np.log(b))
        n = len(logs)
        if n < 2:
            ratio = math.exp(float(logs.mean())) if n else math.nan
            return Interval(math.nan if n == 0 else ratio, math.nan, math.nan, n)
        ratio = math.exp(float(logs.mean()))
        parts.append((ratio, ratio * float(logs.std(ddof=1)) / math.sqrt(n), n))
    (r_from, se_from, n_from), (r_to, se_to, n_to) = parts
    change = r_to - r_from
    var = se_from**2 + se_to**2
    if var == 0:
        return Interval(change, change, change, n_from + n_to)
    df = var**2 / (se_from**4 / (n_from - 1) + se_to**4 / (n_to - 1))
    half = t_quantile(0.5 + level / 2.0, df) * math.sqrt(var)
    return Interval(change, change - half, change + half, n_from + n_to)


def verdict(interval: Interval, no_effect: float) -> str:
    """``resolved`` when the interval excludes the no-effect value, else ``not resolved``."""
    if not interval.finite:
        return NOT_RESOLVED
    return RESOLVED if interval.lo > no_effect or interval.hi < no_effect else NOT_RESOLVED
