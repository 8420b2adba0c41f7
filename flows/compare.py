"""``compare_flow``: schedules side by side at matched device-hours.

Writes table.md, comparison.json and the plots (eval/report.py) to the output folder,
logs them with the per-schedule numbers to a ``compare`` MLflow run, and publishes the
table as a Prefect artifact with links to the MLflow compare view.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from flows.params import CompareFlowParams
from tasks import tracking
from tasks.compare import compare_runs, log_comparison
from tasks.report import publish_report
from tasks.runs import close_run, find_train_run, open_run

__all__ = ["compare_flow"]


@flow(name="compare", log_prints=True)
def compare_flow(
    params: CompareFlowParams,
    parent_run_id: str | None = None,
    train_runs: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """Compare; ``train_runs`` (run_id, experiment_id per run folder) skips their lookup."""
    run_dirs = [Path(d).resolve() for d in params.run_dirs]
    out_dir = Path(params.out_dir).resolve()
    settings = params.tracking.resolved(run_dirs[0].parent, params.tracking.study or "")
    uri = str(settings.tracking_uri)
    if train_runs is None:
        train_runs = [find_train_run(uri, params.tracking.study, d) for d in run_dirs]
    study = params.tracking.study or train_runs[0]["study"]
    comparison = compare_runs(
        run_dirs,
        out_dir,
        metric=params.compare.metric,
        target=params.compare.target,
        budget_dh=params.compare.budget_dh,
        baseline=params.compare.baseline,
    )
    run = open_run(
        uri,
        study,
        name="compare",
        key_tags={"stage": "compare", "out_dir": str(out_dir)},
        tags={"prefect.flow_run_id": str(flow_run.id or "")},
        params={
            "compare": params.compare.model_dump(mode="json"),
            "budget_dh_used": comparison["budget_dh"],
        },
        parent_run_id=parent_run_id,
    )
    log_comparison(uri, run["run_id"], comparison)
    close_run(uri, run["run_id"])
    links = {
        "compare view": tracking.compare_url(
            settings.ui_url, run["experiment_id"], [r["run_id"] for r in train_runs]
        ),
        "comparison run": tracking.run_url(settings.ui_url, run["experiment_id"], run["run_id"]),
    }
    comparison |= {"mlflow_run_id": run["run_id"], "links": links}
    publish_report(
        "compare",
        "# Schedules at matched device-hours\n\n"
        + " · ".join(f"[{name}]({url})" for name, url in links.items())
        + f"\n\nFiles: `{out_dir}`\n\n"
        + comparison["table"],
        description="schedule comparison",
    )
    return comparison
