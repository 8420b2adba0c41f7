"""Compare schedules at matched device-hours: time-to-target, score-at-budget, speedups.

Device-hours are the devices allocated to a run times its wall time (CPU cores on the
embedded default, GPUs on a cluster); the training stage records them cumulatively, and
each evaluated checkpoint carries the value at its publication.

For one run (checkpoints ordered by step, device-hours non-decreasing):

- time-to-target: the device-hours of the first checkpoint whose score reaches the target
  (``first_checkpoint_dh``, no interpolation), and a linear interpolation between the last
  checkpoint below the target and that first one at or above it (``interpolated_dh``):
  ``dh_a + (target - s_a) * (dh_b - dh_a) / (s_b - s_a)``. When the very first checkpoint
  already reaches the target there is nothing to interpolate from and both values are its
  device-hours. A run that never reaches the target has none (reported as not reached).
- score-at-budget: the score of the latest checkpoint published within the budget
  (device-hours <= budget); none when no checkpoint was published by then.

Per schedule, the time-to-target is the mean over its runs, and only defined when every
run of that schedule reached the target (a mean over the runs that happened to get there
would flatter the schedule). The speedup of a schedule is baseline time / its time (above
1: it reaches the target in fewer device-hours), for both the interpolated and the
first-checkpoint times.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eval.io import read_jsonl

__all__ = [
    "Point",
    "RunHistory",
    "TimeToTarget",
    "compare",
    "load_run_history",
    "markdown_table",
    "score_at_budget",
    "time_to_target",
]

INTERPOLATION = (
    "linear in device-hours between the last checkpoint below the target and the first at "
    "or above it; first_checkpoint_dh is that first checkpoint's device-hours"
)


@dataclass(frozen=True)
class Point:
    step: int
    device_hours: float
    score: float


@dataclass(frozen=True)
class RunHistory:
    name: str
    schedule: str
    points: tuple[Point, ...]

    def __post_init__(self) -> None:
        steps = [p.step for p in self.points]
        if steps != sorted(steps) or len(set(steps)) != len(steps):
            raise ValueError(f"run {self.name}: checkpoint steps must be distinct and ascending")
        hours = [p.device_hours for p in self.points]
        if any(b < a for a, b in itertools.pairwise(hours)):
            raise ValueError(
                f"run {self.name}: device_hours decrease between checkpoints ({hours}); "
                "they must be cumulative"
            )


@dataclass(frozen=True)
class TimeToTarget:
    interpolated_dh: float
    first_checkpoint_dh: float
    step: int  # the first checkpoint at or above the target


def time_to_target(points: Sequence[Point], target: float) -> TimeToTarget | None:
    """Device-hours to reach ``target`` (both forms), or None if never reached."""
    for index, point in enumerate(points):
        if point.score < target:
            continue
        if index == 0:
            return TimeToTarget(point.device_hours, point.device_hours, point.step)
        below = points[index - 1]
        fraction = (target - below.score) / (point.score - below.score)
        interpolated = below.device_hours + fraction * (point.device_hours - below.device_hours)
        return TimeToTarget(interpolated, point.device_hours, point.step)
    return None


def score_at_budget(points: Sequence[Point], budget_dh: float) -> Point | None:
    """The latest checkpoint published within ``budget_dh`` device-hours, if any."""
    within = [point for point in points if point.device_hours <= budget_dh]
    return within[-1] if within else None


def _run_entry(run: RunHistory, target: float, budget_dh: float) -> dict[str, Any]:
    reached = time_to_target(run.points, target)
    at_budget = score_at_budget(run.points, budget_dh)
    return {
        "run": run.name,
        "schedule": run.schedule,
        "checkpoints": len(run.points),
        "time_to_target": asdict(reached) if reached else None,
        "score_at_budget": asdict(at_budget) if at_budget else None,
    }


def _schedule_times(entries: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    by_schedule: dict[str, list[Mapping[str, Any]]] = {}
    for entry in entries:
        by_schedule.setdefault(entry["schedule"], []).append(entry)
    times = {}
    for schedule, members in by_schedule.items():
        reached = [m["time_to_target"] for m in members if m["time_to_target"]]
        complete = len(reached) == len(members)
        times[schedule] = {
            "runs": len(members),
            "reached": len(reached),
            "interpolated_dh": statistics.fmean(r["interpolated_dh"] for r in reached)
            if complete
            else None,
            "first_checkpoint_dh": statistics.fmean(r["first_checkpoint_dh"] for r in reached)
            if complete
            else None,
        }
    return times


def _ratio(baseline: float | None, other: float | None) -> float | None:
    if baseline is None or other is None or other <= 0:
        return None
    return baseline / other


def compare(
    runs: Sequence[RunHistory],
    *,
    target: float,
    budget_dh: float,
    baseline: str = "sync",
    metric: str = "pass@1",
) -> dict[str, Any]:
    """Per-run and per-schedule results with speedups vs the ``baseline`` schedule."""
    if not runs:
        raise ValueError("compare: no runs given")
    entries = [_run_entry(run, target, budget_dh) for run in runs]
    schedules = _schedule_times(entries)
    base = schedules.get(baseline)
    for times in schedules.values():
        times["speedup_interpolated"] = _ratio(
            base["interpolated_dh"] if base else None, times["interpolated_dh"]
        )
        times["speedup_first_checkpoint"] = _ratio(
            base["first_checkpoint_dh"] if base else None, times["first_checkpoint_dh"]
        )
    return {
        "metric": metric,
        "target": target,
        "budget_dh": budget_dh,
        "baseline": baseline,
        "baseline_present": base is not None,
        "interpolation": INTERPOLATION,
        "runs": entries,
        "schedules": schedules,
    }


def _fmt(value: float | None, digits: int = 3) -> str:
    return "not reached" if value is None else f"{value:.{digits}f}"


def _speed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _at_score(at: Mapping[str, Any] | None) -> str:
    return "none" if at is None else f"{at['score']:.3f}"


def _at_where(at: Mapping[str, Any] | None) -> str:
    return "-" if at is None else f"{at['step']} ({at['device_hours']:.3f})"


def markdown_table(comparison: Mapping[str, Any]) -> str:
    """Two markdown tables: per run, then per schedule with speedups."""
    metric, target = comparison["metric"], comparison["target"]
    lines = [
        f"{metric} target {target:g}, budget {comparison['budget_dh']:g} device-hours, "
        f"speedup vs {comparison['baseline']}",
        "",
        "| run | schedule | checkpoints | time-to-target dh (interp.) | time-to-target dh "
        f"(first ckpt) | {metric} at budget | at step (dh) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for entry in comparison["runs"]:
        reached, at = entry["time_to_target"], entry["score_at_budget"]
        lines.append(
            f"| {entry['run']} | {entry['schedule']} | {entry['checkpoints']} | "
            f"{_fmt(reached and reached['interpolated_dh'])} | "
            f"{_fmt(reached and reached['first_checkpoint_dh'])} | "
            f"{_at_score(at)} | {_at_where(at)} |"
        )
    lines += [
        "",
        "| schedule | runs reaching target | time-to-target dh (interp.) | speedup (interp.) | "
        "time-to-target dh (first ckpt) | speedup (first ckpt) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for schedule, times in comparison["schedules"].items():
        lines.append(
            f"| {schedule} | {times['reached']}/{times['runs']} | "
            f"{_fmt(times['interpolated_dh'])} | {_speed(times['speedup_interpolated'])} | "
            f"{_fmt(times['first_checkpoint_dh'])} | {_speed(times['speedup_first_checkpoint'])} |"
        )
    lines += ["", f"Interpolation: {comparison['interpolation']}."]
    return "\n".join(lines) + "\n"


def load_run_history(run_dir: Path, metric: str = "pass@1") -> RunHistory:
    """A run's scores from ``RUN/eval/summary.jsonl`` (written by ``eval cadence``)."""
    path = Path(run_dir) / "eval" / "summary.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"--runs {run_dir}: no eval/summary.jsonl; run `thundersync eval cadence --run "
            f"{run_dir}` first"
        )
    lines = read_jsonl(path)
    if not lines:
        raise ValueError(f"{path}: no evaluated checkpoints")
    for number, line in enumerate(lines, 1):
        if metric not in line:
            raise ValueError(f"{path} line {number}: no {metric!r} (have {sorted(line)})")
    points = tuple(
        Point(int(line["step"]), float(line["device_hours"]), float(line[metric]))
        for line in sorted(lines, key=lambda line: line["step"])
    )
    return RunHistory(str(lines[0]["run"]), str(lines[0]["schedule"]), points)
