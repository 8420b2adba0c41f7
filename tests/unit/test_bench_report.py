"""The bench's sweep summary, its command-line parsing and the predicted-vs-measured plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thundersync_core.bench import run_sweep, sweep_summary
from thundersync_core.bench_cli import parse_sweep
from thundersync_core.config import load_config
from thundersync_core.perfmodel import predict_from_trace
from thundersync_core.perfmodel.trace import predict_files


def _point(value: int, predicted: list[float], measured: float, rho: float) -> dict[str, object]:
    return {
        "value": value,
        "balance_rho": rho,
        "median_sync_over_thundersync": measured,
        "contention": {"learner_slowdown": 1.1, "rollout_slowdown": 1.0},
        # Without contention the model predicts 10% higher here.
        "perfmodel": [{"predicted": p, "predicted_without_contention": 1.1 * p} for p in predicted],
    }


def test_sweep_summary_takes_the_median_prediction_and_signed_errors() -> None:
    points = [_point(4, [1.0, 2.0, 1.5], 1.2, 0.5), _point(8, [1.6], 2.0, 1.1)]
    report = sweep_summary("rollout.max_live_episodes", points)
    first, second = report["points"]
    # Median of the per-step predictions; error (predicted - measured) / measured.
    assert first["predicted_speedup"] == 1.5
    assert first["error"] == pytest.approx((1.5 - 1.2) / 1.2)
    assert second["error"] == pytest.approx(-0.2)
    assert report["mean_absolute_error"] == pytest.approx((0.25 + 0.2) / 2)
    assert report["mean_error"] == pytest.approx((0.25 - 0.2) / 2)
    assert [r["value"] for r in report["points"]] == [4, 8]
    assert first["error_without_contention"] == pytest.approx((1.65 - 1.2) / 1.2)
    assert report["mean_absolute_error_without_contention"] == pytest.approx(
        ((1.65 - 1.2) / 1.2 + (2.0 - 1.76) / 2.0) / 2
    )


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


def _outcome(step: int, releases: list[float], learner: list[tuple[float, float]], wall: float):
    from thundersync_core.metrics import StepTimeline  # noqa: PLC0415
    from thundersync_core.schedules.base import StepOutcome  # noqa: PLC0415

    done = wall - 0.1
    timeline = StepTimeline(
        step=step,
        start_s=100.0,
        end_s=100.0 + wall,
        learner_done_s=100.0 + done,
        releases_s=[100.0 + r for r in releases],
        learner=[(100.0 + a, 100.0 + b) for a, b in learner],
        rollout=[(100.0, 100.0 + max(releases))],
        publication=(100.0 + done, 100.0 + wall),
    )
    services = [
        {"id": f"g/{i}", "group": "g", "release_s": 100.0 + r, "service_s": b - a}
        for i, (r, (a, b)) in enumerate(zip(releases, learner, strict=True))
    ]
    return StepOutcome(step, timeline, {"services": services, "barrier_s": 0.5})


def test_bench_report_predicts_from_sync_alone_and_tests_the_rollout_stages(
    tmp_path: Path,
) -> None:
    """Sync: four 1 s sources released at 1..4 s, run after the last, barrier 0.5 s and
    publication 0.1 s (8.6 s). Thundersync on the same batch: its last reward at 4.4 s
    (rollout stage 10% longer), work as it lands (6.0 s)."""
    from thundersync_core.bench import bench_report  # noqa: PLC0415

    sync = [_outcome(k, [1, 2, 3, 4], [(4, 5), (5, 6), (6, 7), (7, 8)], 8.6) for k in range(2)]
    stream = [
        _outcome(k, [1, 2, 3, 4.4], [(1, 2), (2, 3), (3, 4), (4.4, 5.4)], 6.0) for k in range(2)
    ]
    config = load_config(None, {"learner_pack_tokens": 4096, "learner_order": "fixed"})
    report = bench_report(config, {"sync": sync, "thundersync": stream})
    # The baseline is named: which sync learner the speedup is against.
    assert report["learners"] == dict.fromkeys(
        ("sync", "thundersync"), "per-source, packs <= 4096 tokens, id order"
    )
    assert bench_report(load_config(None, {"sync_learner": "batched"}), {
        "sync": sync, "thundersync": stream,
    })["learners"] == {"sync": "batched", "thundersync": "per-source"}  # fmt: skip
    measured = 8.6 / 6.0
    assert report["step_time_ratio"] == pytest.approx([measured, measured])
    assert report["speedup"]["geometric_mean"] == pytest.approx(measured)
    # Thundersync given sync's 4.0 s rollout stage: 6.0 - 4.4 + 4.0 = 5.6 s.
    assert report["schedule_attributable_speedup"]["geometric_mean"] == pytest.approx(8.6 / 5.6)
    check = report["rollout_stage_sync_vs_thundersync"]
    assert (check["sync_longer"], check["thundersync_longer"]) == (0, 2)
    assert check["sign_test_p"] == pytest.approx(0.5)
    assert check["median_sync_over_thundersync"] == pytest.approx(4.0 / 4.4)
    # The model sees sync's trace only: FIFO over releases 1..4 of 1 s each ends at 5, plus
    # the 0.6 s suffix; sync's own step 4 + 4 + 0.6. Measured thundersync does not enter.
    [first, _] = report["perfmodel"]
    assert first["thundersync_step_predicted_s"] == pytest.approx(5.6)
    assert first["predicted"] == pytest.approx(8.6 / 5.6)
    assert first["error"] == pytest.approx((8.6 / 5.6 - measured) / measured)
    assert first["thundersync_step_error"] == pytest.approx((5.6 - 6.0) / 6.0)
    assert first["predicted_without_contention"] == first["predicted"]

    # With contention measured (the learner twice as slow beside the rollout; the rollout's
    # 10% is recorded, not applied), by hand: the sources finish at 3 (1 s at half speed
    # from 1), 4.5 (from 3: 1 s of work is half done at the last release, 4), 5.5, 6.5;
    # plus the 0.6 s suffix.
    contention = {"learner_slowdown": 2.0, "rollout_slowdown": 1.1, "step": 9}
    report = bench_report(load_config(None), {"sync": sync, "thundersync": stream}, contention)
    [first, _] = report["perfmodel"]
    assert first["thundersync_step_predicted_s"] == pytest.approx(7.1)
    assert first["predicted"] == pytest.approx(8.6 / 7.1)
    assert first["predicted_without_contention"] == pytest.approx(8.6 / 5.6)
    assert first["error_without_contention"] == pytest.approx((8.6 / 5.6 - measured) / measured)
    assert report["contention"] == contention
    # What the predictions read is in the report, and predicts the same again.
    trace = report["sync_release_traces"][0]
    assert trace["max_open_groups"] == load_config(None).max_open_groups
    assert predict_from_trace(trace)["predicted_speedup"] == pytest.approx(first["predicted"])
    assert predict_from_trace(trace)["measured"]["speedup"] == pytest.approx(measured)
    # `thundersync perfmodel trace --trace bench.json` reads them out of the report, and a
    # sweep's report the same way.
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(report))
    again = predict_files([bench])
    assert sorted(again["files"]) == [f"{bench}#step 0", f"{bench}#step 1"]
    assert again["mean_abs_speedup_relative_error"] == pytest.approx(abs(first["error"]))
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"key": "k", "benches": [{"value": 4, **report}]}))
    assert f"{sweep}#k=4/step 1" in predict_files([sweep])["files"]


def test_same_samples_compares_action_tokens_by_trajectory_id() -> None:
    from thundersync_core.batch import Segment, Trajectory  # noqa: PLC0415
    from thundersync_core.bench import _same_samples  # noqa: PLC0415

    def traj(tid: str, tokens: list[int]) -> Trajectory:
        segments = (Segment.action(tokens), Segment.observation([9, 9]))
        return Trajectory("g", tid, (1,), segments, 0.0)

    a = [traj("g/0", [1, 2]), traj("g/1", [3]), traj("g/2", [4])]
    b = [traj("g/2", [4]), traj("g/0", [1, 2]), traj("g/1", [3, 5])]
    assert _same_samples(a, b) == pytest.approx(2 / 3)
    assert _same_samples([], b) is None
