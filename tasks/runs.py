"""Generic MLflow tasks: open a stage's run, log files or text to it, close it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from tasks import tracking
from tasks.common import IO_RETRY

__all__ = ["close_run", "find_train_run", "log_files", "log_text", "open_run"]


@task(**IO_RETRY)
def open_run(
    tracking_uri: str,
    study: str,
    *,
    name: str,
    key_tags: dict[str, str],
    tags: dict[str, str] | None = None,
    params: dict[str, Any] | None = None,
    parent_run_id: str | None = None,
) -> dict[str, str]:
    """The run with ``key_tags`` in the study (created if absent); returns its ids."""
    client = tracking.connect(tracking_uri)
    experiment_id = tracking.open_experiment(client, study)
    run_id = tracking.find_or_create_run(
        client, experiment_id, name=name, key_tags=key_tags, tags=tags, parent_run_id=parent_run_id
    )
    if params:
        tracking.log_params(client, run_id, params)
    return {"run_id": run_id, "experiment_id": experiment_id}


@task(**IO_RETRY)
def find_train_run(tracking_uri: str, study: str | None, run_dir: Path) -> dict[str, str]:
    """The training run that logged ``run_dir`` (tag ``run_dir``), in ``study`` or any."""
    client = tracking.connect(tracking_uri)
    if study is None:
        experiments = client.search_experiments()
    else:
        found = client.get_experiment_by_name(study)
        experiments = [found] if found is not None else []
    key = str(Path(run_dir).resolve())
    runs = (
        client.search_runs(
            [e.experiment_id for e in experiments],
            filter_string=f"tags.stage = 'train' and tags.run_dir = '{key}'",
            max_results=2,
        )
        if experiments
        else []
    )
    if len(runs) != 1:
        where = f"study {study!r}" if study else f"MLflow at {tracking_uri}"
        raise ValueError(f"{where}: {len(runs)} training runs carry run_dir={key}, need 1")
    run = runs[0]
    experiment = client.get_experiment(run.info.experiment_id)
    return {
        "run_id": run.info.run_id,
        "experiment_id": experiment.experiment_id,
        "study": experiment.name,
    }


@task(**IO_RETRY)
def log_files(
    tracking_uri: str, run_id: str, paths: list[Path], artifact_path: str | None = None
) -> None:
    client = tracking.connect(tracking_uri)
    for path in paths:
        if Path(path).is_dir():
            client.log_artifacts(run_id, str(path), artifact_path=artifact_path)
        else:
            client.log_artifact(run_id, str(path), artifact_path=artifact_path)


@task(**IO_RETRY)
def log_text(tracking_uri: str, run_id: str, text: str, artifact_file: str) -> None:
    tracking.connect(tracking_uri).log_text(run_id, text, artifact_file)


@task(**IO_RETRY)
def close_run(tracking_uri: str, run_id: str, error: str | None = None) -> None:
    tracking.finish_run(tracking.connect(tracking_uri), run_id, error=error)
