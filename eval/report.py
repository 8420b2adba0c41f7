"""Comparison outputs: score vs device-hours and step wall-time breakdown plots, tables.

``score_vs_device_hours.png``: one line per run (colour by schedule) of the chosen metric
against device-hours at each checkpoint's publication, with the target and the budget
drawn as dashed lines.

``step_walltime.png``: per schedule, the mean over every step of its runs' metrics.jsonl,
as a stacked bar of the step's named parts (``wall_<part>_s``: generation, grading,
sandbox, optimizer, publication, tail, learner, overhead; see thundersync_core/metrics.py),
which sum to ``step_wall_s``, with ``learner_busy_s`` (all learner work, overlapped or
not) marked as a dot: how much of the step the learner hides under rollout is the gap
between the dot and the tail. A field missing from a run's metrics counts as 0 and the
plot says which were missing.

Matplotlib runs on the Agg backend (files only, no display).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from eval.budget import RunHistory, compare, load_run_history, markdown_table
from eval.io import read_jsonl

__all__ = [
    "STEP_PARTS",
    "WALLTIME_FIELDS",
    "plot_predicted_vs_measured",
    "plot_score_vs_device_hours",
    "plot_walltime_breakdown",
    "walltime_breakdown",
    "write_comparison",
]

#: The named parts of a step, in stacking order (they sum to ``step_wall_s``).
STEP_PARTS = (
    "generation", "grading", "sandbox", "learner", "tail", "optimizer", "publication",
    "overhead",
)  # fmt: skip
WALLTIME_FIELDS = (
    *(f"wall_{part}_s" for part in STEP_PARTS),
    "rollout_busy_s",
    "learner_busy_s",
    "learner_tail_s",
    "step_wall_s",
)


def _pyplot() -> Any:
    import matplotlib  # noqa: PLC0415 - heavy, and only the comparison needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _colours(schedules: Sequence[str]) -> dict[str, Any]:
    plt = _pyplot()
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {s: cycle[i % len(cycle)] for i, s in enumerate(sorted(set(schedules)))}


def plot_score_vs_device_hours(
    runs: Sequence[RunHistory], path: Path, *, metric: str, target: float, budget_dh: float
) -> Path:
    plt = _pyplot()
    colours = _colours([run.schedule for run in runs])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for run in runs:
        ax.plot(
            [p.device_hours for p in run.points],
            [p.score for p in run.points],
            marker="o",
            color=colours[run.schedule],
            label=f"{run.name} ({run.schedule})",
        )
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.axvline(budget_dh, color="black", linestyle=":", linewidth=1, label=f"budget {budget_dh:g}")
    ax.set_xlabel("device-hours at checkpoint publication")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs device-hours")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return _save(fig, path)


def plot_predicted_vs_measured(
    points: Sequence[Mapping[str, Any]], path: Path, *, label: str = "point"
) -> Path:
    """Measured against trace-predicted sync/thundersync speedup, one marker per point.

    ``points`` carry ``predicted_speedup``, ``measured_speedup``, ``balance_rho`` and
    ``value`` (the swept setting, written beside its marker); the diagonal is a perfect
    prediction and the title gives the mean absolute relative error, (predicted -
    measured) / measured as everywhere.
    """
    if not points:
        raise ValueError("plot_predicted_vs_measured: no points")
    plt = _pyplot()
    predicted = [float(p["predicted_speedup"]) for p in points]
    measured = [float(p["measured_speedup"]) for p in points]
    mae = statistics.mean(abs(q - m) / m for m, q in zip(measured, predicted, strict=True))
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    scatter = ax.scatter(predicted, measured, c=[float(p["balance_rho"]) for p in points])
    fig.colorbar(scatter, ax=ax, label="balance rho (learner work / rollout stage)")
    for point, x, y in zip(points, predicted, measured, strict=True):
        ax.annotate(
            f"{label}={point['value']}",
            (x, y),
            fontsize="x-small",
            xytext=(4, 4),
            textcoords="offset points",
        )
    low, high = min(predicted + measured + [1.0]), max(predicted + measured) * 1.05
    ax.plot([low, high], [low, high], color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("predicted speedup (sync's release trace, out of sample)")
    ax.set_ylabel("measured speedup (sync / thundersync step)")
    ax.set_title(f"trace prediction vs measured: MAE {mae:.1%}")
    fig.tight_layout()
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    _pyplot().close(fig)
    return path


def walltime_breakdown(
    metrics_by_schedule: Mapping[str, Sequence[Mapping[str, Any]]],
) -> dict[str, dict[str, Any]]:
    """schedule -> mean of each wall-time field over its steps, and the fields it lacked."""
    breakdown = {}
    for schedule, rows in metrics_by_schedule.items():
        if not rows:
            raise ValueError(f"schedule {schedule}: no metrics.jsonl lines")
        missing = sorted({f for f in WALLTIME_FIELDS for row in rows if f not in row})
        means = {
            f: statistics.fmean(float(row.get(f, 0.0)) for row in rows) for f in WALLTIME_FIELDS
        }
        breakdown[schedule] = {"steps": len(rows), "missing_fields": missing, **means}
    return breakdown


def plot_walltime_breakdown(breakdown: Mapping[str, Mapping[str, Any]], path: Path) -> Path:
    plt = _pyplot()
    schedules = list(breakdown)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    bottoms = [0.0] * len(schedules)
    for part in STEP_PARTS:
        heights = [breakdown[s][f"wall_{part}_s"] for s in schedules]
        colour = "lightgrey" if part == "overhead" else None
        ax.bar(schedules, heights, bottom=bottoms, label=part, color=colour)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    learner = [breakdown[s]["learner_busy_s"] for s in schedules]
    ax.scatter(schedules, learner, color="black", zorder=3, label="learner_busy_s")
    ax.set_ylabel("seconds per step (mean)")
    missing = [
        f"{s}: {', '.join(breakdown[s]['missing_fields'])}"
        for s in schedules
        if breakdown[s]["missing_fields"]
    ]
    note = f"\nmissing, shown as 0: {'; '.join(missing)}" if missing else ""
    ax.set_title("step wall-time breakdown" + note, fontsize="medium")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return _save(fig, path)


def _metrics_by_schedule(
    run_dirs: Sequence[Path], runs: Sequence[RunHistory]
) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = {}
    for run_dir, run in zip(run_dirs, runs, strict=True):
        path = Path(run_dir) / "metrics.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"--runs {run_dir}: no metrics.jsonl")
        grouped.setdefault(run.schedule, []).extend(read_jsonl(path))
    return grouped


def write_comparison(
    run_dirs: Sequence[Path],
    *,
    target: float,
    budget_dh: float,
    metric: str,
    out_dir: Path,
    baseline: str = "sync",
) -> tuple[dict[str, Any], str]:
    """Compare runs; writes table.md, comparison.json and both plots under ``out_dir``."""
    runs = [load_run_history(Path(d), metric) for d in run_dirs]
    comparison = compare(runs, target=target, budget_dh=budget_dh, baseline=baseline, metric=metric)
    breakdown = walltime_breakdown(_metrics_by_schedule(run_dirs, runs))
    comparison["walltime_breakdown"] = breakdown
    out_dir = Path(out_dir)
    comparison["plots"] = {
        "score_vs_device_hours": str(
            plot_score_vs_device_hours(
                runs,
                out_dir / "score_vs_device_hours.png",
                metric=metric,
                target=target,
                budget_dh=budget_dh,
            )
        ),
        "step_walltime": str(plot_walltime_breakdown(breakdown, out_dir / "step_walltime.png")),
    }
    table = markdown_table(comparison)
    (out_dir / "table.md").write_text(table)
    (out_dir / "comparison.json").write_text(json.dumps(comparison, indent=2) + "\n")
    return comparison, table
