"""Device-hour matched comparison on synthetic run histories, its table, plots and CLI.

Hand-computed: sync reaches pass@1 = 0.5 between 2.0 dh (0.4) and 3.0 dh (0.6), so the
interpolated time is 2.5 dh and the first checkpoint at the target is at 3.0 dh;
thundersync gets there between 1.0 dh (0.3) and 1.5 dh (0.7): 1.0 + 0.2/0.4 * 0.5 = 1.25
dh interpolated, 1.5 dh raw. Speedups 2.5/1.25 = 2.0x and 3.0/1.5 = 2.0x.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from eval.budget import Point, RunHistory, compare, markdown_table, score_at_budget, time_to_target
from eval.report import WALLTIME_FIELDS, walltime_breakdown
from thundersync_core.cli import main

SYNC = [(10, 1.0, 0.2), (20, 2.0, 0.4), (30, 3.0, 0.6), (40, 4.0, 0.7)]
STREAM = [(10, 0.5, 0.1), (20, 1.0, 0.3), (30, 1.5, 0.7), (40, 2.0, 0.8)]


def history(name: str, schedule: str, points) -> RunHistory:
    return RunHistory(name, schedule, tuple(Point(*p) for p in points))


def test_time_to_target_interpolates_and_reports_the_raw_checkpoint():
    sync = history("a", "sync", SYNC).points
    reached = time_to_target(sync, 0.5)
    assert reached.interpolated_dh == pytest.approx(2.5)
    assert reached.first_checkpoint_dh == 3.0
    assert reached.step == 30
    exactly = time_to_target(sync, 0.6)  # reached exactly at a checkpoint: no interpolation
    assert (exactly.interpolated_dh, exactly.first_checkpoint_dh) == (pytest.approx(3.0), 3.0)
    first = time_to_target(sync, 0.1)  # the first checkpoint already reaches it
    assert (first.interpolated_dh, first.first_checkpoint_dh, first.step) == (1.0, 1.0, 10)
    assert time_to_target(sync, 0.9) is None


def test_score_at_budget_takes_the_latest_checkpoint_within_it():
    sync = history("a", "sync", SYNC).points
    assert score_at_budget(sync, 2.9) == Point(20, 2.0, 0.4)
    assert score_at_budget(sync, 3.0) == Point(30, 3.0, 0.6)
    assert score_at_budget(sync, 0.5) is None


def test_histories_must_be_cumulative():
    with pytest.raises(ValueError, match="run bad: device_hours decrease"):
        history("bad", "sync", [(1, 2.0, 0.1), (2, 1.0, 0.2)])
    with pytest.raises(ValueError, match="run bad: checkpoint steps"):
        history("bad", "sync", [(2, 1.0, 0.1), (1, 2.0, 0.2)])


def test_speedups_per_schedule():
    runs = [
        history("sync-0", "sync", SYNC),
        history("stream-0", "thundersync", STREAM),
        history("stream-1", "thundersync", [(10, 0.5, 0.3), (20, 1.0, 0.5)]),
        history("pipe-0", "pipeline", [(10, 1.0, 0.1), (20, 2.0, 0.2)]),
    ]
    result = compare(runs, target=0.5, budget_dh=1.6, metric="pass@1")
    stream = result["schedules"]["thundersync"]
    # stream-1 reaches 0.5 at its second checkpoint, 1.0 dh; the mean is (1.25 + 1.0) / 2.
    assert stream["interpolated_dh"] == pytest.approx((1.25 + 1.0) / 2)
    assert stream["first_checkpoint_dh"] == pytest.approx((1.5 + 1.0) / 2)
    assert stream["speedup_interpolated"] == pytest.approx(2.5 / 1.125)
    assert stream["speedup_first_checkpoint"] == pytest.approx(3.0 / 1.25)
    assert result["schedules"]["sync"]["speedup_interpolated"] == pytest.approx(1.0)
    assert result["schedules"]["pipeline"]["interpolated_dh"] is None  # never reached
    assert result["schedules"]["pipeline"]["speedup_interpolated"] is None
    by_run = {entry["run"]: entry for entry in result["runs"]}
    assert by_run["sync-0"]["score_at_budget"] == {"step": 10, "device_hours": 1.0, "score": 0.2}
    assert by_run["stream-0"]["score_at_budget"]["score"] == 0.7
    table = markdown_table(result)
    assert "| stream-0 | thundersync | 4 | 1.250 | 1.500 | 0.700 | 30 (1.500) |" in table
    assert "| pipe-0 | pipeline | 2 | not reached | not reached | 0.100 | 10 (1.000) |" in table
    assert "| thundersync | 2/2 | 1.125 | 2.22x | 1.250 | 2.40x |" in table
    assert "linear in device-hours" in table


def test_missing_baseline_gives_no_speedup():
    result = compare([history("s", "thundersync", STREAM)], target=0.5, budget_dh=1.0)
    assert not result["baseline_present"]
    assert result["schedules"]["thundersync"]["speedup_interpolated"] is None


def test_walltime_breakdown_counts_missing_fields_as_zero():
    rows = [
        {"step_wall_s": 10.0, "rollout_busy_s": 6.0},
        {"step_wall_s": 12.0, "rollout_busy_s": 8.0},
    ]
    out = walltime_breakdown({"sync": rows})["sync"]
    assert out["step_wall_s"] == 11.0
    assert out["rollout_busy_s"] == 7.0
    assert out["learner_tail_s"] == 0.0
    assert out["missing_fields"] == sorted(
        f for f in WALLTIME_FIELDS if f not in ("step_wall_s", "rollout_busy_s")
    )


# -- the CLI on synthetic run folders -------------------------------------------------------


def write_run(root: Path, name: str, schedule: str, points, walltime: dict) -> Path:
    run = root / name
    (run / "eval").mkdir(parents=True)
    summary = [
        {"run": name, "schedule": schedule, "step": s, "device_hours": dh, "pass@1": v / 2,
         "pass@3": v, "n_tasks": 4, "k": 3}
        for s, dh, v in points
    ]  # fmt: skip
    (run / "eval" / "summary.jsonl").write_text("".join(json.dumps(r) + "\n" for r in summary))
    metrics = [{"step": s, "device_hours": dh, "reward_mean": v, **walltime} for s, dh, v in points]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    return run


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert width > 100
    assert height > 100
    assert len(data) > 5000


PARTS = {"wall_generation_s": 6.0, "wall_sandbox_s": 3.0, "wall_grading_s": 1.0} | {
    f"wall_{part}_s": 0.0 for part in ("learner", "tail", "optimizer", "publication", "overhead")
}


def test_compare_cli_prints_table_and_json_and_writes_plots(tmp_path, capsys):
    sync = write_run(
        tmp_path, "sync-0", "sync", SYNC,
        {"step_wall_s": 20.0, "rollout_busy_s": 10.0, "learner_busy_s": 10.0,
         "learner_tail_s": 10.0, **PARTS, "wall_tail_s": 10.0},
    )  # fmt: skip
    stream = write_run(
        tmp_path, "stream-0", "thundersync", STREAM,
        {"step_wall_s": 11.0, "rollout_busy_s": 10.0, "learner_busy_s": 10.0, **PARTS},
    )  # fmt: skip
    out_dir = tmp_path / "cmp"
    argv = ["eval", "compare", "--runs", str(sync), str(stream), "--target", "0.5"]
    argv += ["--budget", "2.0", "--metric", "pass@3", "--out", str(out_dir)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    table, _, payload = printed.partition("\n{")
    comparison = json.loads("{" + payload)
    assert "| thundersync | 1/1 | 1.250 | 2.00x | 1.500 | 2.00x |" in table
    assert "| sync-0 | sync | 4 | 2.500 | 3.000 | 0.400 | 20 (2.000) |" in table
    assert comparison["metric"] == "pass@3"
    assert comparison["schedules"]["thundersync"]["speedup_interpolated"] == pytest.approx(2.0)
    breakdown = comparison["walltime_breakdown"]
    assert breakdown["thundersync"]["missing_fields"] == ["learner_tail_s"]
    assert set(WALLTIME_FIELDS) <= set(breakdown["sync"])
    for name in ("score_vs_device_hours.png", "step_walltime.png"):
        assert_png(out_dir / name)
    assert (out_dir / "table.md").read_text() == table.rstrip("\n") + "\n"


def test_compare_cli_refuses_a_run_without_evaluations(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    argv = ["eval", "compare", "--runs", str(tmp_path / "run"), "--target", "0.5"]
    assert main([*argv, "--budget", "1", "--out", str(tmp_path / "o")]) == 2
    assert "no eval/summary.jsonl" in capsys.readouterr().err
