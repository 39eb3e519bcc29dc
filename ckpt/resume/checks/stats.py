"""Robust noise estimates: a loss log's step-to-step jitter, immune to the spikes we are looking for."""

from __future__ import annotations

import math
from collections.abc import Sequence

MAD_TO_SIGMA = 1.4826


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return math.nan
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def robust_sigma(xs: Sequence[float]) -> float:
    """1.4826 * median absolute deviation: the standard deviation for Gaussian data, ignoring outliers."""
    m = median(xs)
    return MAD_TO_SIGMA * median([abs(x - m) for x in xs])


def diff_sigma(values: Sequence[float]) -> float:
    """Robust standard deviation of consecutive differences: the scale of one step's change in the loss, and
    of the difference between two noisy evaluations of the same step.  A slow trend barely moves it."""
    diffs = [b - a for a, b in zip(values, values[1:], strict=False) if math.isfinite(a) and math.isfinite(b)]
    return robust_sigma(diffs) if len(diffs) >= 3 else math.nan


def theil_sen(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(slope, intercept) of the robust line through ``points``: the median pairwise slope, then the median
    intercept.  Up to 29% of the points can be outliers (spikes) without moving it."""
    slopes = [
        (y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :] if x2 != x1
    ]
    slope = median(slopes) if slopes else 0.0
    return slope, median([y - slope * x for x, y in points])
