"""Simulator: agreement with the analytic model in its limits, exact reductions between
schedules, and the talk's straggler scenario."""

from __future__ import annotations

import pytest

from thundersync_core.perfmodel.analytic import finite_sources, predict
from thundersync_core.perfmodel.config import DurationConfig, SimConfig
from thundersync_core.perfmodel.simulate import (
    TrajectoryPool,
    simulate,
    simulate_schedule,
    talk_straggler_config,
)

ROLLOUT_S = 100.0


def _uniform_config(rho: float, n: int, sampling: str, **kw) -> SimConfig:
    """Everything starts at once, releases uniform on [0, R], equal services, no suffix."""
    fields = {
        "batch_size": n,
        "steps": 2,
        "warmup_steps": 1,
        "rollout_slots": n,
        "durations": DurationConfig(body="uniform", low_s=0.0, high_s=ROLLOUT_S),
        "learner_s_per_source": rho * ROLLOUT_S / n,
        "sampling": sampling,
        "seed": 3,
    }
    return SimConfig.model_validate({**fields, **kw})


@pytest.mark.parametrize("rho", [0.5, 1.0, 2.0])
@pytest.mark.parametrize(("sampling", "n"), [("midpoint", 2000), ("random", 20000)])
def test_many_sources_agree_with_the_analytic_model(rho: float, sampling: str, n: int) -> None:
    # The fluid limit: tail [rho - 1]+ R; the 1% tolerance covers the O(1/sqrt(n))
    # fluctuation of random releases (0.6% at balance with n = 20000) and O(1/n) otherwise.
    out = simulate(_uniform_config(rho, n, sampling), ("sync", "thundersync"))["schedules"]
    analytic = predict(rho)
    assert out["sync"]["steady_step_s"] == pytest.approx(analytic.sync_step_r * ROLLOUT_S, rel=0.01)
    ts_s = out["thundersync"]["steady_step_s"]
    assert ts_s == pytest.approx(analytic.overlapped_step_r * ROLLOUT_S, rel=0.01)
    assert out["thundersync"]["speedup_vs_sync"] == pytest.approx(analytic.speedup, rel=0.01)


@pytest.mark.parametrize("rho", [0.4, 1.0, 3.0])
def test_midpoint_sampling_reproduces_the_finite_source_closed_form(rho: float) -> None:
    n = 16
    run = simulate_schedule(_uniform_config(rho, n, "midpoint"), "thundersync")
    expected = finite_sources(rho, n)
    update = run.updates[1]
    assert update.tail_s == pytest.approx(expected["tail_r"] * ROLLOUT_S, rel=1e-9)
    assert update.step_s == pytest.approx(expected["overlapped_step_r"] * ROLLOUT_S, rel=1e-9)


def test_pipeline_without_staleness_is_thundersync() -> None:
    config = talk_straggler_config(batch_size=64, rollout_slots=48, steps=4, max_staleness=0)
    pipeline = simulate_schedule(config, "pipeline")
    stream = simulate_schedule(config, "thundersync")
    assert [u.end_s for u in pipeline.updates] == pytest.approx([u.end_s for u in stream.updates])
    assert dict(pipeline.samples_by_lag) == {0: 4 * 64}


def test_async_steady_step_is_the_slower_stage() -> None:
    # Midpoint draws give every batch the same durations, so each stage has one length.
    for learner_s in (30.0, 300.0):
        config = _uniform_config(1.0, 50, "midpoint", steps=5, optimizer_s=1.0)
        config = config.model_copy(update={"learner_s_per_source": learner_s / 50})
        run = simulate_schedule(config, "async")
        rollout_s = float(TrajectoryPool(config).block(0).duration_s.max())
        for update in run.updates[2:]:
            assert update.step_s == pytest.approx(max(rollout_s, learner_s + 1.0))
        assert dict(run.samples_by_lag) == {0: 50, 1: 200}


def test_turn_sources_never_finish_later() -> None:
    durations = DurationConfig(median_s=5.0, sigma=0.5, turns=3, tool_latency_s=2.0, tool_sigma=0.5)
    base = SimConfig(
        batch_size=32,
        steps=3,
        rollout_slots=32,
        durations=durations,
        learner_s_per_token=0.25 / 50.0,
        optimizer_s=0.5,
    )
    turn = base.model_copy(update={"source_granularity": "turn"})
    by_trajectory = simulate_schedule(base, "thundersync").updates
    by_turn = simulate_schedule(turn, "thundersync").updates
    assert all(t.end_s <= s.end_s + 1e-9 for t, s in zip(by_turn, by_trajectory, strict=True))
    assert by_turn[-1].end_s < by_trajectory[-1].end_s


def test_seed_controls_the_draws() -> None:
    config = talk_straggler_config(batch_size=32, rollout_slots=32, steps=3)
    first = simulate(config)["schedules"]["sync"]["step_s"]
    assert simulate(config)["schedules"]["sync"]["step_s"] == first
    other = config.model_copy(update={"seed": 1})
    assert simulate(other)["schedules"]["sync"]["step_s"] != first


def test_talk_straggler_scenario() -> None:
    config = talk_straggler_config()
    pool = TrajectoryPool(config)
    durations = sorted(d for b in range(config.steps) for d in pool.block(b).duration_s)
    # The profile: about 1% of samples (binomial count) beyond ~40 s, the last ~80 s more.
    late = sum(d > 41.0 for d in durations) / len(durations)
    assert 0.005 < late < 0.02
    assert durations[-1] > 100.0
    out = simulate(config)["schedules"]
    sync, stream, pipeline = out["sync"], out["thundersync"], out["pipeline"]
    # Sync's learner waits through the whole rollout, stragglers included.
    assert sync["learner_idle_fraction"] > 0.6
    assert stream["learner_idle_fraction"] < sync["learner_idle_fraction"]
    # Streaming hides the body's learner work but still waits for the stragglers.
    assert 1.2 < stream["speedup_vs_sync"] < 2.0
    assert pipeline["speedup_vs_sync"] > stream["speedup_vs_sync"]
    assert pipeline["learner_idle_fraction"] < 0.1
    lags = [int(k) for k in pipeline["staleness"]["samples_by_lag"]]
    assert max(lags) <= config.max_staleness
    assert max(lags) >= 1
    assert set(out["async"]["staleness"]["samples_by_lag"]) == {"0", "1"}
    assert set(stream["staleness"]["tokens_by_lag"]) == {"0"}
