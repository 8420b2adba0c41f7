"""The analytic schedule model against its closed forms and against the FIFO recursion.

The closed forms are derived in the module docstring; the FIFO checks recompute the same
quantities by brute force so an algebra slip in either place shows up as a mismatch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from thundersync_core.perfmodel.analytic import (
    finite_sources,
    midpoint_release_r,
    predict,
    predict_json,
    speedup_bound,
    tail_bounds,
)
from thundersync_core.perfmodel.fifo import fifo_finish


@pytest.mark.parametrize(("rho", "speedup"), [(1.0, 2.0), (0.5, 1.5), (2.0, 1.5), (4.0, 1.25)])
def test_speedup_closed_form(rho: float, speedup: float) -> None:
    prediction = predict(rho)
    assert prediction.speedup == pytest.approx(speedup, rel=1e-12)
    assert speedup_bound(rho) == pytest.approx(speedup, rel=1e-12)
    assert prediction.sync_step_r == pytest.approx(1.0 + rho)


def test_suffix_lowers_the_speedup() -> None:
    # (1 + rho + S) / (1 + S) at balance: S = 0.5 gives 2.5 / 1.5.
    assert predict(1.0, suffix_r=0.5).speedup == pytest.approx(2.5 / 1.5)


@pytest.mark.parametrize(
    ("rho", "lag", "lower", "upper", "loose"),
    [
        (0.5, 0.2, 0.0, 0.1, 0.1),
        (1.0, 0.3, 0.0, 0.3, 0.3),
        (2.0, 0.2, 1.0, 1.2, 1.4),
        (2.0, 0.0, 1.0, 1.0, 1.0),
    ],
)
def test_tail_bounds_closed_form(
    rho: float, lag: float, lower: float, upper: float, loose: float
) -> None:
    bounds = tail_bounds(rho, lag)
    assert (bounds.lower_r, bounds.upper_r, bounds.upper_loose_r) == pytest.approx(
        (lower, upper, loose)
    )


def _extremal_release(lag: float, n: int) -> list[float]:
    """Released work tracks t - lag (one source per 1/n), the last `lag` of it at R = 1.

    The discretisation lags by at most one more source (1/n), hence the 2/n tolerance.
    """
    n_late = round(lag * n)
    return [lag + i / n for i in range(1, n - n_late + 1)] + [1.0] * n_late


@pytest.mark.parametrize(("rho", "lag"), [(0.5, 0.3), (1.0, 0.25), (1.8, 0.4)])
def test_tight_upper_bound_is_attained(rho: float, lag: float) -> None:
    n = 4000
    release_r = _extremal_release(lag, n)
    queue = fifo_finish(release_r, [rho / n] * n)
    assert queue.last_finish_s - 1.0 == pytest.approx(tail_bounds(rho, lag).upper_r, abs=2.0 / n)


@pytest.mark.parametrize("waves", [1, 2, 3, 8])
@pytest.mark.parametrize("rho", [0.5, 1.0, 2.0])
def test_full_waves_match_fifo(waves: int, rho: float) -> None:
    # Each wave's work is released at its end: W lumps of rho/W at k/W.
    release_r = [k / waves for k in range(1, waves + 1)]
    queue = fifo_finish(release_r, [rho / waves] * waves)
    prediction = predict(rho, waves=waves, release_lag=1.0)
    assert queue.last_finish_s == pytest.approx(prediction.overlapped_step_r)


def test_wave_limits() -> None:
    assert predict(1.0, waves=1, release_lag=1.0).speedup == pytest.approx(1.0)
    assert predict(1.0, waves=3, release_lag=1.0).speedup == pytest.approx(1.5)
    speedups = [predict(1.0, waves=w, release_lag=1.0).speedup for w in (1, 4, 16, 256, 4096)]
    assert speedups == sorted(speedups)
    assert speedups[-1] == pytest.approx(2.0, abs=1e-3)
    for rho in (0.5, 3.0):
        far = predict(rho, waves=4096, release_lag=1.0).speedup
        assert far == pytest.approx((1 + rho) / max(1.0, rho), abs=1e-3)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000])
@pytest.mark.parametrize("rho", [0.3, 1.0, 2.5])
def test_finite_sources_closed_form(n: int, rho: float) -> None:
    result = finite_sources(rho, n)
    assert result["tail_r"] == pytest.approx(result["tail_closed_form_r"], abs=1e-12)
    assert result["last_release_r"] == pytest.approx(1.0 - 0.5 / n)
    assert result["tail_minus_fluid_r"] == pytest.approx(min(rho, 1.0) / n, abs=1e-12)


def test_finite_sources_speedup_at_balance() -> None:
    for n in (1, 4, 100):
        assert finite_sources(1.0, n)["speedup"] == pytest.approx((4 * n - 1) / (2 * n + 1))


def test_midpoint_error_bound_holds_for_iid_releases() -> None:
    """DKW: with probability >= 1 - delta every step moves by at most the half-width."""
    n, rho, trials, delta = 40, 1.0, 400, 0.05
    bound_r = finite_sources(rho, n, delta=delta)["error_bounds"]
    halfwidth = bound_r["step_halfwidth_r_per_min_density"]
    assert 0.0 < halfwidth < 0.3
    midpoint_end = fifo_finish(midpoint_release_r(n), [rho / n] * n).last_finish_s
    rng = np.random.default_rng(11)
    misses = 0
    for _ in range(trials):
        release_r = np.sort(rng.uniform(0.0, 1.0, n)).tolist()
        end = fifo_finish(release_r, [rho / n] * n).last_finish_s
        misses += abs(end - midpoint_end) > halfwidth
    assert misses / trials <= delta


def test_predict_json_seconds() -> None:
    out = predict_json(2.0, suffix_r=0.1, rollout_s=50.0)
    assert out["seconds"]["sync_step_s"] == pytest.approx(50.0 * 3.1)
    assert out["seconds"]["overlapped_step_s"] == pytest.approx(50.0 * 2.1)
    assert out["tail"]["lower_r"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rho": -1.0}, "rho"),
        ({"rho": math.nan}, "rho"),
        ({"rho": 1.0, "waves": 0}, "waves"),
        ({"rho": 1.0, "release_lag": 1.5}, "release_lag"),
        ({"rho": 1.0, "suffix_r": -0.1}, "suffix"),
    ],
)
def test_bad_inputs_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        predict(**kwargs)
