"""The bench's sweep summary, its command-line parsing and the predicted-vs-measured plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from thundersync_core.bench import run_sweep, sweep_summary
from thundersync_core.bench_cli import parse_sweep
from thundersync_core.config import load_config


def _point(value: int, predicted: list[float], measured: float, rho: float) -> dict[str, object]:
    return {
        "value": value,
        "balance_rho": rho,
        "median_sync_over_thundersync": measured,
        "perfmodel": [{"predicted": p} for p in predicted],
    }


def test_sweep_summary_takes_the_median_prediction_and_signed_errors() -> None:
    points = [_point(4, [1.0, 2.0, 1.5], 1.2, 0.5), _point(8, [1.6], 2.0, 1.1)]
    report = sweep_summary("rollout.max_live_episodes", points)
    first, second = report["points"]
    # Median of the per-step predictions, error relative to the prediction.
    assert first["predicted_speedup"] == 1.5
    assert first["error"] == pytest.approx((1.2 - 1.5) / 1.5)
    assert second["error"] == pytest.approx(0.25)
    assert report["mean_absolute_error"] == pytest.approx((0.2 + 0.25) / 2)
    assert report["mean_error"] == pytest.approx((-0.2 + 0.25) / 2)
    assert [r["value"] for r in report["points"]] == [4, 8]


def test_parse_sweep_reads_key_and_values_and_names_the_flag_on_errors() -> None:
    assert parse_sweep("rollout.max_live_episodes=4, 8,16") == (
        "rollout.max_live_episodes",
        [4, 8, 16],
    )
    for bad in ["rollout.max_live_episodes", "k=", "k=a,b", "k=-1"]:
        with pytest.raises(ValueError, match="--sweep"):
            parse_sweep(bad)


def test_a_setting_the_roles_read_at_start_cannot_be_swept(tmp_path: Path) -> None:
    config = load_config(None)
    with pytest.raises(ValueError, match="cannot be swept"):
        run_sweep(config, tmp_path, steps=1, key="policy.preset", values=[1])
    assert not any(tmp_path.iterdir()), "nothing is started or written for a refused sweep"


def test_predicted_vs_measured_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from eval.report import plot_predicted_vs_measured  # noqa: PLC0415

    rows = [
        {"value": v, "predicted_speedup": p, "measured_speedup": m, "balance_rho": r}
        for v, p, m, r in [(4, 1.2, 1.1, 0.4), (8, 1.5, 1.45, 0.8), (16, 1.8, 1.7, 1.2)]
    ]
    path = plot_predicted_vs_measured(rows, tmp_path / "sweep.png", label="live")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no points"):
        plot_predicted_vs_measured([], tmp_path / "empty.png")
