"""``train_flow``: one training run (one schedule, one seed), followed step by step.

Resolve the config (validated, written with absolute paths as the run's config.yaml),
open the MLflow run, train (a Ray job, thread or process: tasks/jobs.py) while logging
each step of ``metrics.jsonl`` as it lands, and finish with the run's files, its status and
a Prefect summary. A trainer that dies (preempted, killed, a role that kept failing) is
started again ``retries`` times, resuming from the latest checkpoint. A failed run fails
the flow with the trainer's own message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from flows.params import TrainParams
from tasks import tracking
from tasks.progress import progress
from tasks.report import publish_report
from tasks.train import (
    TrainingFailed,
    finish_training,
    open_train_run,
    resolve_train_config,
    run_totals,
    run_training,
)

__all__ = ["TrainingFailed", "config_name", "train_flow"]


def config_name(train_config: str | None, overrides: dict[str, Any]) -> str:
    """The ``name`` of a config (the default study name), validating the config on the way."""
    from thundersync_core.config import load_config  # noqa: PLC0415

    return load_config(Path(train_config) if train_config else None, overrides).name


def _report(params: TrainParams, run: dict[str, Any], totals: dict[str, Any], ui_url: str) -> str:
    url = tracking.run_url(ui_url, run["experiment_id"], run["run_id"])
    lines = [
        f"# Training run `{params.run_name}`",
        "",
        f"MLflow run: [{params.run_name}]({url}) (tracking URI `{run['tracking_uri']}`)",
        f"Run folder: `{run['run_dir']}`",
        "",
        "| field | value |",
        "|---|---|",
    ]
    lines += [f"| {key} | {value} |" for key, value in (totals | run["summary"]).items()]
    return "\n".join(lines) + "\n"


@flow(name="train", log_prints=True)
def train_flow(
    params: TrainParams = TrainParams(),  # noqa: B008 - a frozen default form for the UI
    parent_run_id: str | None = None,
) -> dict[str, Any]:
    """Train one schedule and seed; returns the run folder, MLflow ids and summary."""
    out = Path(params.out).resolve()
    run_dir = out / params.run_name
    if (run_dir / "metrics.jsonl").exists():
        # Its MLflow run (found by run_dir) would be reopened and marked failed.
        raise FileExistsError(f"out: {run_dir} holds a training run already; use a new out")
    overrides = params.overrides | {
        "schedule": params.schedule,
        "seed": params.seed,
        "name": params.run_name,
    }
    study = params.tracking.study or config_name(params.train_config, params.overrides)
    settings = params.tracking.resolved(out, study)
    uri = str(settings.tracking_uri)
    config_path = run_dir / "config.yaml"
    config = resolve_train_config(Path(params.train_config), overrides, config_path)
    run = open_train_run(
        uri,
        study,
        config,
        run_dir,
        parent_run_id=parent_run_id,
        flow_run_id=str(flow_run.id or ""),
    )
    attempt = run_training.with_options(
        retries=params.retries, retry_delay_seconds=params.retry_delay_s
    )(
        params.launcher,
        config_path,
        run_dir,
        tracking_uri=uri,
        run_id=run["run_id"],
        poll_s=params.poll_s,
        ray_address=params.ray_address,
        submission_id=f"{flow_run.name or 'train'}-{params.run_name}",
        return_state=True,
    )
    failure = attempt.data if attempt.is_failed() else None
    error = str(failure) if failure is not None else None
    summary = finish_training(uri, run["run_id"], run_dir, error=error)
    if isinstance(failure, BaseException):
        raise failure
    if error is not None:
        raise TrainingFailed(error, retryable=False)
    result = run | {
        "run_dir": str(run_dir),
        "run_name": params.run_name,
        "schedule": params.schedule,
        "seed": params.seed,
        "tracking_uri": uri,
        "study": study,
        "config": config,
        "summary": summary,
        "totals": run_totals(run_dir),
    }
    progress(f"train {params.run_name}", _done_line(result))
    publish_report(
        f"train-{params.run_name}",
        _report(params, result, result["totals"], settings.ui_url),
        description=f"training run {params.run_name}",
    )
    return result


def _done_line(result: dict[str, Any]) -> str:
    totals, summary = result["totals"], result["summary"]
    line = (
        f"done, {totals.get('steps', 0)} steps, mean step {totals.get('mean_step_wall_s', 0):.1f} s"
    )
    before, after = summary.get("dev_before") or {}, summary.get("dev_after") or {}
    if "pass_rate" in before and "pass_rate" in after:
        line += f"; dev pass {before['pass_rate']:.1%} before, {after['pass_rate']:.1%} after"
    return line
