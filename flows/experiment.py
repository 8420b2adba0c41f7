"""``experiment_flow``: prep, then per schedule and seed train and evaluate, then compare.

Every schedule trains from the same config with the same seeds and steps, and for each
seed from the same initial weights (one warm start per seed, shared), one run after
another (runs share the machine; running them side by side would change the wall times
being compared). MLflow: a parent run for this flow run, a child per stage, and per
(schedule, seed) a training run named ``<schedule>-seed<k>``. Prefect: one subflow per
stage and a report artifact linking to MLflow. A failing stage fails the flow with the
stage's own message, and the parent MLflow run is marked failed with it.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from flows.compare import compare_flow
from flows.evaluate import evaluate_flow
from flows.params import (
    CompareFlowParams,
    EvaluateFlowParams,
    ExperimentParams,
    TrackingParams,
    TrainParams,
)
from flows.prep import data_prep_flow
from flows.train import config_name, train_flow
from tasks import tracking
from tasks.progress import progress
from tasks.report import publish_report
from tasks.runs import close_run, log_text, open_run
from tasks.schedules_table import schedule_rows, schedules_markdown
from tasks.train import resolve_train_config, shared_start

__all__ = ["experiment_flow"]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def _ids(run: dict[str, Any]) -> dict[str, str]:
    return {"run_id": run["run_id"], "experiment_id": run["experiment_id"]}


def _run_rows(runs: list[dict[str, Any]], settings: TrackingParams) -> list[dict[str, Any]]:
    return [
        {
            "run": run["run_name"],
            "schedule": run["schedule"],
            "seed": run["seed"],
            **{k: _fmt(v) for k, v in run["totals"].items()},
            "status": run["summary"].get("status", "?"),
            "mlflow": tracking.run_url(settings.ui_url, run["experiment_id"], run["run_id"]),
        }
        for run in runs
    ]


def _report(
    params: ExperimentParams,
    *,
    exp_dir: Path,
    parent: dict[str, str],
    settings: TrackingParams,
    runs: list[dict[str, Any]],
    comparison: dict[str, Any] | None,
) -> str:
    experiment_id, ids = parent["experiment_id"], [r["run_id"] for r in runs]
    links = [
        f"[parent run]({tracking.run_url(settings.ui_url, experiment_id, parent['run_id'])})",
        f"[compare the runs]({tracking.compare_url(settings.ui_url, experiment_id, ids)})",
    ]
    rows = _run_rows(runs, settings)
    header = [k for k in rows[0] if k != "mlflow"]
    lines = [
        f"# Experiment `{settings.study}`: {', '.join(params.schedules)}",
        "",
        f"MLflow ({settings.tracking_uri}): " + " · ".join(links),
        f"Output: `{exp_dir}`",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(str(r[k]) for k in header) + " |" for r in rows]
    baseline = params.compare.baseline
    lines += ["", "## Schedules", "", schedules_markdown(schedule_rows(runs, baseline), baseline)]
    if comparison is not None:
        lines += ["", "## At matched device-hours", "", comparison["table"]]
    else:
        lines += ["", "Evaluation was off: no comparison."]
    return "\n".join(lines) + "\n"


def _shared_dev_before(runs: list[dict[str, Any]], seed: int) -> dict[str, str]:
    """The schedules of a seed start from the same weights: the first run's dev pass rate
    before training is every later one's (training checks that it measured the same)."""
    for run in runs:
        summary = Path(run["run_dir"]) / "summary.json"
        if run["seed"] == seed and "dev_before" in run["summary"] and summary.is_file():
            return {"tasks.dev_before_from": str(summary)}
    return {}


def _train_and_evaluate(
    params: ExperimentParams,
    *,
    overrides: dict[str, Any],
    runs_dir: Path,
    settings: TrackingParams,
    parent_run_id: str,
    prep_dir: str | None,
) -> list[dict[str, Any]]:
    runs = []
    for seed in params.seeds:
        seed_dir = runs_dir.parent / "warmstart" / f"seed{seed}"
        config = resolve_train_config(
            Path(params.train_config), overrides | {"seed": seed}, seed_dir / "config.yaml"
        )
        started = time.monotonic()
        start = shared_start(config, seed_dir)
        progress("warm start", f"seed {seed}: ready in {time.monotonic() - started:.0f} s")
        for schedule in params.schedules:
            run = train_flow(
                TrainParams(
                    train_config=params.train_config,
                    overrides=overrides | start | _shared_dev_before(runs, seed),
                    schedule=schedule,
                    seed=seed,
                    out=str(runs_dir),
                    launcher=params.launcher,
                    ray_address=params.ray_address,
                    tracking=settings,
                ),
                parent_run_id=parent_run_id,
            )
            if params.eval.enabled:
                evaluate_flow(
                    EvaluateFlowParams(
                        run_dir=run["run_dir"],
                        prep_dir=prep_dir,
                        eval=params.eval,
                        tracking=settings,
                    ),
                    mlflow_run=_ids(run),
                )
            runs.append(run)
    return runs


@flow(name="experiment", log_prints=True)
def experiment_flow(params: ExperimentParams = ExperimentParams()) -> dict[str, Any]:  # noqa: B008
    """The whole chain for ``params.schedules`` x ``params.seeds``, ending in the comparison."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    exp_dir = Path(params.out).resolve() / f"{stamp}-{flow_run.name or 'experiment'}"
    overrides = dict(params.overrides) | ({"steps": params.steps} if params.steps else {})
    # A bad config fails here, before anything is trained.
    study = params.tracking.study or config_name(params.train_config, overrides)
    settings = params.tracking.resolved(Path(params.out), study)
    uri = str(settings.tracking_uri)
    parent = open_run(
        uri,
        study,
        name=f"{study}-{flow_run.name or stamp}",
        key_tags={"stage": "experiment", "prefect.flow_run_id": str(flow_run.id or stamp)},
        tags={"schedules": ",".join(params.schedules), "output": str(exp_dir)},
        params=params.model_dump(mode="json"),
    )
    try:
        prep_dir = None
        if params.prep.config:
            prep = data_prep_flow(params.prep, settings, parent_run_id=parent["run_id"])
            prep_dir = prep["prep_dir"]
            overrides["tasks.prep_dir"] = prep_dir
        runs = _train_and_evaluate(
            params,
            overrides=overrides,
            runs_dir=exp_dir / "runs",
            settings=settings,
            parent_run_id=parent["run_id"],
            prep_dir=prep_dir,
        )
        comparison = None
        if params.eval.enabled:
            comparison = compare_flow(
                CompareFlowParams(
                    run_dirs=[r["run_dir"] for r in runs],
                    out_dir=str(exp_dir / "comparison"),
                    compare=params.compare,
                    tracking=settings,
                ),
                parent_run_id=parent["run_id"],
                train_runs=[_ids(r) for r in runs],
            )
        report = _report(
            params,
            exp_dir=exp_dir,
            parent=parent,
            settings=settings,
            runs=runs,
            comparison=comparison,
        )
        log_text(uri, parent["run_id"], report, "report.md")
        publish_report(
            "experiment", report, table=_run_rows(runs, settings), description=f"study {study}"
        )
    except Exception as exc:
        close_run(uri, parent["run_id"], error=f"{type(exc).__name__}: {exc}")
        raise
    close_run(uri, parent["run_id"])
    return {
        "experiment_dir": str(exp_dir),
        "tracking_uri": uri,
        "study": study,
        "experiment_id": parent["experiment_id"],
        "parent_run_id": parent["run_id"],
        "runs": [{k: r[k] for k in ("run_name", "run_dir", "run_id")} for r in runs],
        "comparison_dir": comparison and comparison["out_dir"],
        "report": report,
    }
