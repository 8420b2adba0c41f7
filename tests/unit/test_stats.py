"""The bench's paired statistics against their textbook values (and scipy's where present)."""

from __future__ import annotations

import math

import pytest

from thundersync_core.stats import ratio_interval, sign_test, t95


def test_sign_test_counts_and_exact_two_sided_p() -> None:
    out = sign_test([5, 6, 7, 8, 9, 3], [4, 5, 6, 7, 8, 3])
    # Five of five non-tied pairs one way: p = 2 / 2^5.
    assert (out["a_larger"], out["b_larger"], out["ties"]) == (5, 0, 1)
    assert out["p_value"] == pytest.approx(2 / 32)
    assert sign_test([1, 2], [2, 1])["p_value"] == 1.0
    assert sign_test([1.0], [1.0])["p_value"] == 1.0
    with pytest.raises(ValueError, match="differ in length"):
        sign_test([1, 2], [1])


def test_sign_test_matches_scipy_binomial() -> None:
    scipy_stats = pytest.importorskip("scipy.stats")
    for above, below in [(7, 2), (10, 0), (3, 3), (12, 5)]:
        a = [1.0] * above + [0.0] * below
        b = [0.0] * above + [1.0] * below
        expected = scipy_stats.binomtest(min(above, below), above + below, 0.5).pvalue
        assert sign_test(a, b)["p_value"] == pytest.approx(expected)


def test_t_quantiles() -> None:
    assert t95(1) == pytest.approx(12.706, abs=1e-3)
    assert t95(30) == pytest.approx(2.042, abs=1e-3)
    assert t95(500) == 1.96
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in range(1, 31):
        assert t95(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), abs=1e-3)


def test_ratio_interval_is_a_t_interval_over_the_logs() -> None:
    ratios = [1.5, 1.6, 1.7, 1.8]
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    out = ratio_interval(ratios)
    assert out["geometric_mean"] == pytest.approx(math.exp(mean))
    assert out["low"] == pytest.approx(math.exp(mean - 3.182 * sd / 2))
    assert out["high"] == pytest.approx(math.exp(mean + 3.182 * sd / 2))
    single = ratio_interval([2.0])
    assert single == {"geometric_mean": pytest.approx(2.0), "low": None, "high": None}
    with pytest.raises(ValueError, match="positive"):
        ratio_interval([1.0, 0.0])
