"""Comparison tasks: schedules at matched device-hours (eval/budget.py, eval/report.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks import tracking
from tasks.common import IO_RETRY

__all__ = ["compare_runs", "log_comparison", "matched_budget"]


def matched_budget(run_dirs: list[Path]) -> float:
    """The device-hours every run reached: the smallest of their last evaluated checkpoints."""
    from eval.budget import load_run_history  # noqa: PLC0415

    return min(load_run_history(d).points[-1].device_hours for d in run_dirs)


@task(cache_policy=NO_CACHE)
def compare_runs(
    run_dirs: list[Path],
    out_dir: Path,
    *,
    metric: str,
    target: float,
    budget_dh: float | None,
    baseline: str,
) -> dict[str, Any]:
    """table.md, comparison.json and the plots under ``out_dir``; returns the comparison
    with ``table`` (markdown) added. ``budget_dh`` None: ``matched_budget``."""
    from eval.report import write_comparison  # noqa: PLC0415 - matplotlib

    budget = matched_budget(run_dirs) if budget_dh is None else budget_dh
    comparison, table = write_comparison(
        run_dirs,
        target=target,
        budget_dh=budget,
        metric=metric,
        out_dir=out_dir,
        baseline=baseline,
    )
    return comparison | {"table": table, "out_dir": str(out_dir)}


def comparison_metrics(comparison: dict[str, Any]) -> dict[str, float]:
    """Per schedule: time-to-target, speedups and walltime means, as ``<schedule>/<name>``."""
    metrics = {}
    for schedule, times in comparison["schedules"].items():
        for key, value in times.items():
            if tracking.finite(value):
                metrics[f"{schedule}/{key}"] = float(value)
    for schedule, fields in comparison.get("walltime_breakdown", {}).items():
        for key, value in fields.items():
            if tracking.finite(value):
                metrics[f"{schedule}/mean_{key}"] = float(value)
    return metrics


@task(**IO_RETRY)
def log_comparison(tracking_uri: str, run_id: str, comparison: dict[str, Any]) -> None:
    """The comparison's numbers as metrics and its files (plots, tables) as artifacts."""
    client = tracking.connect(tracking_uri)
    stamp = client.get_run(run_id).info.start_time
    for key, value in comparison_metrics(comparison).items():
        client.log_metric(run_id, key, value, timestamp=stamp, step=0)
    client.log_artifacts(run_id, comparison["out_dir"], artifact_path="comparison")
