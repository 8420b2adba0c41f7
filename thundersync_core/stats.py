"""Small paired statistics for benches: an exact sign test and a ratio's 95% interval.

A bench measures the same batches under two schedules, so its numbers come in pairs (step
k of each). ``sign_test`` asks whether one side is larger more often than chance allows;
``ratio_interval`` gives the geometric mean of per-step ratios with a 95% Student-t
interval over their logarithms (a ratio's noise is multiplicative).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

# Two-sided 95% quantiles of Student's t, degrees of freedom 1..30; 1.96 beyond.
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T95[df - 1] if df <= len(_T95) else 1.96


def sign_test(a: Sequence[float], b: Sequence[float]) -> dict[str, float | int]:
    """Exact two-sided sign test of paired ``a`` against ``b`` (ties left out): how many
    pairs have a > b, a < b, and the probability of a split at least this uneven if either
    side were as likely to be the larger."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} and {len(b)}")
    above = sum(x > y for x, y in zip(a, b, strict=True))
    below = sum(x < y for x, y in zip(a, b, strict=True))
    n, k = above + below, min(above, below)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
    return {"a_larger": above, "b_larger": below, "ties": len(a) - n, "p_value": p}


def ratio_interval(ratios: Sequence[float]) -> dict[str, float | None]:
    """Geometric mean of positive ``ratios`` and its 95% interval (t over the logs); the
    interval is None with a single ratio."""
    if not ratios or any(not r > 0 for r in ratios):
        raise ValueError(f"ratios must be positive and at least one, got {list(ratios)}")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return {"geometric_mean": math.exp(mean), "low": None, "high": None}
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return {
        "geometric_mean": math.exp(mean),
        "low": math.exp(mean - half),
        "high": math.exp(mean + half),
    }
