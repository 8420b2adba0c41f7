"""Analytic step-time model of the sync and overlapped (thundersync) schedules.

Quantities (times in units of the rollout stage R unless a name ends in ``_s``):

    R      rollout stage: step start to the last source release (R = 1 below)
    L      learner work of the batch, L = rho·R (rho is the learner/rollout balance)
    S      suffix after the learner work: reduction, optimizer step, weight publication
    F(t)   fraction of the learner work released by time t (F(R) = 1)
    D      release lag: the largest shortfall of F behind uniform release,
           D = sup_t (t/R - F(t⁻)) clipped to [0, 1], so F(t⁻) >= t/R - D

Assumptions: one learner queue (or ranks of equal share), work-conserving and served in
release order; learner work is divisible at the scale of R (fluid limit) except in the
finite-source section; nothing of step k+1 starts before step k publishes.

Sync. The learner starts after the last release:  T_sync = R + L + S = (1 + rho) R + S.

Overlapped. A work-conserving server that receives work W(t) = L·F(t) empties at

    T_end = sup_{s in [0, R]} ( s + L (1 - F(s⁻)) )          (unrolled Lindley recursion)

and the step is T_ts = T_end + S = R + tail + S with tail = T_end - R.

Lower bound: T_end >= L (all work must be served) and T_end >= R (the last release), so
tail >= [rho - 1]⁺ R; uniform release (D = 0) attains it, since s + rho (R - s) is linear
in s and peaks at an end point.

Upper bound: using F(s⁻) >= max(0, s/R - D), the integrand is at most
s + rho R (1 - max(0, s/R - D)), piecewise linear with its maximum at s = D R or s = R:

    tail <= max(rho·D, rho - 1 + D) R  <=  ([rho - 1]⁺ + rho·D) R

The first form is tight (attained by releasing nothing until D R, then uniformly, and the
last D of the work at R); the second is the looser textbook form and is also reported.

Speedup with S = 0 and D = 0:  T_sync / T_ts = (1 + rho) / max(1, rho), which is 2 at
balance (rho = 1) and 1.5 at rho = 0.5 or 2.

Repeated rollout waves. When the batch's rollout runs as W back-to-back waves of length R/W
(rollout slots fewer than sources), each carrying rho_w R/W of learner work with release
lag D inside the wave (in units of the wave), the batch's release lags uniform by at most
D/W, so the bounds above hold with D_eff = D/W. For identical waves the per-wave balance
rho_w equals the batch's rho. As W grows D_eff -> 0 and the speedup tends to
(1 + rho_w)/max(1, rho_w): to 2 at balance. Full waves (each wave's work released at its
end, D = 1) give exactly tail = max(rho/W, rho - 1 + 1/W) R, so 2W/(W + 1) at balance.

Finite batches of n equal sources (midpoint-quantile approximation). Source i (1..n) is
released at t_i = Q((i - 1/2)/n) R with Q the release quantile function (uniform: Q(u) = u)
and needs rho R/n. For uniform release the FIFO recursion gives, in closed form,

    last release  t_n = (1 - 1/(2n)) R
    tail_n        = T_end - t_n = max(rho/n, rho - 1 + 1/n) R
    speedup_n     = (t_n + rho R + S) / (t_n + tail_n + S)       ((4n - 1)/(2n + 1) at balance)

so the discrete tail exceeds the fluid tail [rho - 1]⁺ R by min(rho, 1) R/n (the fluid
bound with D = 1/n), and the step times differ from the fluid ones by at most R/(2n) + R/n.

Error of the midpoint approximation against i.i.d. release times with CDF G (density at
least g_min/R on its support). By the Dvoretzky-Kiefer-Wolfowitz inequality (Massart's
constant), sup_t |F_n(t) - G(t)| <= eps with probability >= 1 - 2 exp(-2 n eps²). On that
event G(X_(i)) lies in [i/n - eps, (i-1)/n + eps], an interval centred on (i - 1/2)/n of
half-width eps - 1/(2n), so every order statistic satisfies

    |X_(i) - Q((i - 1/2)/n) R| <= (eps - 1/(2n)) R / g_min.

T_end and the last release are maxima of (X_(i) + constant), hence 1-Lipschitz in the
release times: each step time moves by at most that half-width and the tail by at most
twice it. With eps = sqrt(ln(2/delta)/(2n)) the bound holds with probability 1 - delta.
For heavy-tailed releases g_min is 0 in the gaps and the bound is vacuous: the last few
order statistics then carry the tail and should come from a trace or the simulator.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from thundersync_core.perfmodel.fifo import fifo_finish


@dataclass(frozen=True)
class TailBounds:
    """Learner work left after the last release, in units of R."""

    lower_r: float
    upper_r: float
    upper_loose_r: float


@dataclass(frozen=True)
class AnalyticPrediction:
    """Sync and overlapped step times (units of R) and the speedup they imply."""

    rho: float
    waves: int
    release_lag: float
    effective_lag: float
    suffix_r: float
    sync_step_r: float
    overlapped_step_r: float
    overlapped_step_best_r: float
    tail: TailBounds
    speedup: float
    speedup_best: float
    speedup_limit_many_waves: float
    speedup_bound_no_suffix: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check(rho: float, waves: int, suffix_r: float, release_lag: float) -> None:
    if not (math.isfinite(rho) and rho >= 0):
        raise ValueError(f"rho must be a finite number >= 0, got {rho}")
    if waves < 1:
        raise ValueError(f"waves must be >= 1, got {waves}")
    if not (math.isfinite(suffix_r) and suffix_r >= 0):
        raise ValueError(f"suffix must be a finite number >= 0, got {suffix_r}")
    if not 0.0 <= release_lag <= 1.0:
        raise ValueError(f"release_lag must lie in [0, 1], got {release_lag}")


def tail_bounds(rho: float, release_lag: float = 0.0) -> TailBounds:
    """[rho-1]⁺ <= tail <= max(rho D, rho - 1 + D) <= [rho-1]⁺ + rho D (units of R)."""
    _check(rho, 1, 0.0, release_lag)
    lag = release_lag
    return TailBounds(
        lower_r=max(rho - 1.0, 0.0),
        upper_r=max(rho * lag, rho - 1.0 + lag),
        upper_loose_r=max(rho - 1.0, 0.0) + rho * lag,
    )


def speedup_bound(rho: float) -> float:
    """(1 + rho) / max(1, rho): the overlapped schedule's best case with S = 0."""
    _check(rho, 1, 0.0, 0.0)
    return (1.0 + rho) / max(1.0, rho)


def predict(
    rho: float, *, waves: int = 1, suffix_r: float = 0.0, release_lag: float = 0.0
) -> AnalyticPrediction:
    """Step times of both schedules; the overlapped step uses the tight worst-case tail.

    ``release_lag`` is D inside one wave, in units of the wave; ``suffix_r`` is S / R.
    """
    _check(rho, waves, suffix_r, release_lag)
    effective_lag = release_lag / waves
    tail = tail_bounds(rho, effective_lag)
    sync_step_r = 1.0 + rho + suffix_r
    overlapped_step_r = 1.0 + tail.upper_r + suffix_r
    best_step_r = 1.0 + tail.lower_r + suffix_r
    return AnalyticPrediction(
        rho=rho,
        waves=waves,
        release_lag=release_lag,
        effective_lag=effective_lag,
        suffix_r=suffix_r,
        sync_step_r=sync_step_r,
        overlapped_step_r=overlapped_step_r,
        overlapped_step_best_r=best_step_r,
        tail=tail,
        speedup=sync_step_r / overlapped_step_r,
        speedup_best=sync_step_r / best_step_r,
        speedup_limit_many_waves=sync_step_r / best_step_r,
        speedup_bound_no_suffix=speedup_bound(rho),
    )


def midpoint_release_r(n_sources: int) -> list[float]:
    """Release times (units of R) of n sources under uniform release: (i - 1/2)/n."""
    if n_sources < 1:
        raise ValueError(f"n_sources must be >= 1, got {n_sources}")
    return [(i - 0.5) / n_sources for i in range(1, n_sources + 1)]


def finite_sources(
    rho: float, n_sources: int, *, suffix_r: float = 0.0, delta: float = 0.05
) -> dict[str, Any]:
    """Midpoint-quantile model of n equal sources (uniform release) and its error bounds.

    Step times are computed with the FIFO recursion and returned beside the closed forms
    so a reader can check one against the other.
    """
    _check(rho, 1, suffix_r, 0.0)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    release_r = midpoint_release_r(n_sources)
    service_r = [rho / n_sources] * n_sources
    queue = fifo_finish(release_r, service_r)
    last_release_r = release_r[-1]
    tail_r = queue.last_finish_s - last_release_r
    sync_step_r = last_release_r + rho + suffix_r
    overlapped_step_r = queue.last_finish_s + suffix_r
    eps = math.sqrt(math.log(2.0 / delta) / (2.0 * n_sources))
    halfwidth_r = max(eps - 0.5 / n_sources, 0.0)
    return {
        "n_sources": n_sources,
        "last_release_r": last_release_r,
        "tail_r": tail_r,
        "tail_closed_form_r": max(rho / n_sources, rho - 1.0 + 1.0 / n_sources),
        "tail_minus_fluid_r": tail_r - max(rho - 1.0, 0.0),
        "sync_step_r": sync_step_r,
        "overlapped_step_r": overlapped_step_r,
        "speedup": sync_step_r / overlapped_step_r,
        "error_bounds": {
            "delta": delta,
            "dkw_eps": eps,
            "step_halfwidth_r_per_min_density": halfwidth_r,
            "tail_halfwidth_r_per_min_density": 2.0 * halfwidth_r,
            "statement": (
                "with probability >= 1 - delta, i.i.d. releases with density >= g_min/R "
                "move each step time by at most step_halfwidth/g_min and the tail by at "
                "most tail_halfwidth/g_min from the midpoint model"
            ),
        },
    }


def predict_json(
    rho: float,
    *,
    waves: int = 1,
    suffix_r: float = 0.0,
    release_lag: float = 0.0,
    n_sources: int | None = None,
    rollout_s: float | None = None,
) -> dict[str, Any]:
    """What ``thundersync perfmodel analytic`` prints: times in R, or seconds with R given."""
    prediction = predict(rho, waves=waves, suffix_r=suffix_r, release_lag=release_lag)
    out: dict[str, Any] = {"units": "R", **prediction.to_dict()}
    if n_sources is not None:
        out["finite_sources"] = finite_sources(rho, n_sources, suffix_r=suffix_r)
    if rollout_s is not None:
        if not (math.isfinite(rollout_s) and rollout_s > 0):
            raise ValueError(f"rollout_s must be a positive number, got {rollout_s}")
        out["seconds"] = {
            "rollout_s": rollout_s,
            "sync_step_s": prediction.sync_step_r * rollout_s,
            "overlapped_step_s": prediction.overlapped_step_r * rollout_s,
            "overlapped_step_best_s": prediction.overlapped_step_best_r * rollout_s,
            "tail_lower_s": prediction.tail.lower_r * rollout_s,
            "tail_upper_s": prediction.tail.upper_r * rollout_s,
            "suffix_s": suffix_r * rollout_s,
        }
    return out
