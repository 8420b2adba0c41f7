"""``evaluate_flow``: the checkpoint cadence of one training run, logged to its MLflow run.

Every published checkpoint not evaluated yet gets k attempts per dev task; the scores go
to the training run's MLflow run by checkpoint step and by device-hours, and to a Prefect
table. Re-running after more checkpoints appear evaluates only the new ones.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml
from prefect import flow

from flows.params import EvaluateFlowParams
from tasks import tracking
from tasks.evaluate import evaluate_checkpoints, log_evaluation
from tasks.progress import progress
from tasks.report import publish_report
from tasks.runs import find_train_run

__all__ = ["evaluate_flow"]


def _rows(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in line.items() if k != "pools"}
        | {f"{pool}/{k}": v for pool, s in (line.get("pools") or {}).items() for k, v in s.items()}
        for line in lines
    ]


def _eval_line(lines: list[dict[str, Any]], seconds: float) -> str:
    scores = ", ".join(
        f"step {line.get('step')} pass@1 {line['pass@1']:.1%}"
        for line in lines
        if isinstance(line.get("pass@1"), int | float)
    )
    return f"{len(lines)} checkpoints in {seconds:.0f} s" + (f": {scores}" if scores else "")


@flow(name="evaluate", log_prints=True)
def evaluate_flow(
    params: EvaluateFlowParams, mlflow_run: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Evaluate the run's checkpoints; ``mlflow_run`` (run_id, experiment_id) skips the
    lookup of the training run by its ``run_dir`` tag."""
    run_dir = Path(params.run_dir).resolve()
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise FileNotFoundError(f"run_dir: {config_path} is missing (not a training run)")
    config = yaml.safe_load(config_path.read_text())
    prep_dir = Path(params.prep_dir or config["tasks"]["prep_dir"])
    settings = params.tracking.resolved(run_dir.parent, params.tracking.study or "")
    uri = str(settings.tracking_uri)
    if mlflow_run is None:
        mlflow_run = find_train_run(uri, params.tracking.study, run_dir)
    started = time.monotonic()
    lines = evaluate_checkpoints(
        run_dir,
        prep_dir,
        params.eval.settings(config["rollout"]),
        split=params.eval.split,
        families=list(config["tasks"]["families"]),
        limit=params.eval.limit,
        engine=params.eval.engine,
    )
    log_evaluation(uri, mlflow_run["run_id"], run_dir, lines)
    progress(f"eval {run_dir.name}", _eval_line(lines, time.monotonic() - started))
    url = tracking.run_url(settings.ui_url, mlflow_run["experiment_id"], mlflow_run["run_id"])
    publish_report(
        f"evaluate-{run_dir.name}".lower(),
        f"# Checkpoints of `{run_dir.name}`\n\n{len(lines)} evaluated checkpoints on the "
        f"{params.eval.split} split of `{prep_dir}`, k={params.eval.k}; "
        f"MLflow run: [{run_dir.name}]({url}).\n",
        table=_rows(lines),
        description=f"checkpoint evaluation of {run_dir}",
    )
    return lines
