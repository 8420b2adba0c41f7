"""MLflow helpers: what the pipeline records, where, and why a retry never records it twice.

Layout: one MLflow experiment per study; one parent run per ``experiment_flow`` run; one
child run per stage, and for training per (schedule, seed), named ``<schedule>-seed<k>`` and
tagged ``schedule``, ``seed``, ``objective``, ``model``, ``dataset_digest``, so MLflow's
compare view lines schedules up from tags alone. Evaluation scores land in the training
run they evaluate, keyed by the same step.

Idempotence, so Prefect may retry any logging task:

- runs are looked up by their key tags before one is created (``find_or_create_run``);
- params are written once; a second write with a different value is an error, not an
  overwrite, so a run never mixes two configs;
- step metrics use the record's step and a timestamp derived from the record (run start
  + the record's ``wall_s``), and steps already present in the run are skipped, so a
  retried log leaves exactly one point per step and metric;
- datasets are logged with the prep manifest's hash as digest (MLflow keeps one input per
  dataset name and digest); artifacts overwrite files at the same path.

MLflow's metric history is append-only: a step logged once keeps its first value. A resumed
run re-trains the steps after its checkpoint; their new values stay in ``metrics.jsonl``.

Metric names: every numeric field of a ``metrics.jsonl`` record under its own name; the
staleness histogram as ``staleness_lag_<k>`` (tokens sampled k versions behind the
learner); evaluation as ``eval_pass_at_1``/``eval_pass_at_<k>`` by checkpoint step (the
number of optimizer steps taken) and ``eval_pass_at_1_by_device_microhours`` whose MLflow
step is the checkpoint's device-hours times 1e6 (steps are integers).
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from mlflow import MlflowClient
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunStatus

__all__ = [
    "STEP_MARKER",
    "checkpoint_pointers",
    "compare_url",
    "connect",
    "dataset_digest",
    "eval_metrics",
    "find_or_create_run",
    "finish_run",
    "finite",
    "flatten",
    "log_eval_summary",
    "log_params",
    "log_prep_datasets",
    "log_run_folder",
    "log_step_metrics",
    "logged_steps",
    "open_experiment",
    "run_url",
    "step_metrics",
]

#: The metric whose history says which steps a run already holds (every record has it).
STEP_MARKER = "step_wall_s"
EVAL_MARKER = "eval_pass_at_1"
_BATCH = 1000  # MLflow's limit on metrics per log_batch call
_PARAM_BATCH = 100  # and on params


def connect(tracking_uri: str) -> MlflowClient:
    if tracking_uri.startswith("sqlite:///"):
        Path(tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=tracking_uri)


def open_experiment(client: MlflowClient, name: str) -> str:
    """The study's experiment id, created on first use.

    With a SQLite tracking URI the artifacts go next to the database (``mlartifacts/``);
    with a tracking server, wherever the server's artifact root says (MinIO in infra/).
    """
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None
    uri = client.tracking_uri
    if uri.startswith("sqlite:///"):
        database = Path(uri.removeprefix("sqlite:///"))
        location = (database.parent / "mlartifacts" / name).resolve().as_uri()
    # Tells the MLflow UI these are training runs (its runs and charts views, not GenAI's).
    tags = {"mlflow.experimentKind": "custom_model_development"}
    return client.create_experiment(name, artifact_location=location, tags=tags)


def _filter(key_tags: Mapping[str, str]) -> str:
    clauses = []
    for key, value in key_tags.items():
        if "'" in value or "`" in key:
            raise ValueError(f"tag {key}={value!r}: quotes cannot be searched for")
        clauses.append(f"tags.`{key}` = '{value}'")
    return " and ".join(clauses)


def find_or_create_run(
    client: MlflowClient,
    experiment_id: str,
    *,
    name: str,
    key_tags: Mapping[str, str],
    tags: Mapping[str, str] | None = None,
    parent_run_id: str | None = None,
) -> str:
    """The run with these key tags (under ``parent_run_id`` if given), created if absent."""
    lookup = dict(key_tags)
    if parent_run_id is not None:
        lookup["mlflow.parentRunId"] = parent_run_id
    runs = client.search_runs([experiment_id], filter_string=_filter(lookup), max_results=2)
    if len(runs) > 1:
        ids = [r.info.run_id for r in runs]
        raise ValueError(f"MLflow runs {ids} both carry the key tags {lookup}: delete one")
    if runs:
        return runs[0].info.run_id
    run = client.create_run(experiment_id, run_name=name, tags=lookup | dict(tags or {}))
    return run.info.run_id


def flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mapping -> dotted keys with string values (lists as JSON)."""
    flat: dict[str, str] = {}
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{dotted}.")
        elif isinstance(value, list | tuple):
            flat[dotted] = json.dumps(value)
        else:
            flat[dotted] = str(value)
    return flat


def log_params(client: MlflowClient, run_id: str, params: Mapping[str, Any]) -> None:
    """Write params once; refuse a different value for a param the run already has."""
    flat = flatten(params)
    existing = client.get_run(run_id).data.params
    changed = sorted(k for k, v in flat.items() if k in existing and existing[k] != v)
    if changed:
        diff = {k: (existing[k], flat[k]) for k in changed[:5]}
        raise ValueError(f"MLflow run {run_id} has other values for params {diff}")
    new = [Param(k, v) for k, v in flat.items() if k not in existing]
    for start in range(0, len(new), _PARAM_BATCH):
        client.log_batch(run_id, params=new[start : start + _PARAM_BATCH])


def step_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric fields of a ``metrics.jsonl`` record, staleness as ``staleness_lag_<k>``."""
    metrics: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool):
            continue
        if key == "staleness_tokens" and isinstance(value, Mapping):
            metrics |= {f"staleness_lag_{lag}": float(n) for lag, n in value.items()}
        elif isinstance(value, int | float):
            metrics[key] = float(value)
    return metrics


def logged_steps(client: MlflowClient, run_id: str, key: str = STEP_MARKER) -> set[int]:
    return {m.step for m in client.get_metric_history(run_id, key)}


def _log_points(client: MlflowClient, run_id: str, points: Sequence[Sequence[Metric]]) -> None:
    """Log groups of metrics, never splitting a group across two calls."""
    batch: list[Metric] = []
    for group in points:
        if len(batch) + len(group) > _BATCH and batch:
            client.log_batch(run_id, metrics=batch)
            batch = []
        batch.extend(group)
    if batch:
        client.log_batch(run_id, metrics=batch)


def log_step_metrics(
    client: MlflowClient, run_id: str, records: Iterable[Mapping[str, Any]]
) -> list[int]:
    """Log the records of steps the run does not hold yet; returns those steps."""
    start_ms = client.get_run(run_id).info.start_time
    done = logged_steps(client, run_id)
    groups, steps = [], []
    for record in records:
        step = int(record["step"])
        if step in done:
            continue
        metrics = step_metrics(record)
        if STEP_MARKER not in metrics:
            raise ValueError(f"metrics record of step {step} has no {STEP_MARKER}")
        stamp = start_ms + int(1000 * float(record.get("wall_s", step)))
        groups.append([Metric(k, v, stamp, step) for k, v in metrics.items()])
        steps.append(step)
        done.add(step)
    _log_points(client, run_id, groups)
    return steps


def eval_metrics(line: Mapping[str, Any]) -> dict[str, float]:
    """An ``eval/summary.jsonl`` line as metrics: pass@k overall and per pool."""
    metrics = {"eval_device_hours": float(line["device_hours"])}
    for key, value in line.items():
        if key.startswith("pass@"):
            metrics[f"eval_pass_at_{key[5:]}"] = float(value)
    for pool, scores in (line.get("pools") or {}).items():
        for key, value in scores.items():
            if key.startswith("pass@"):
                metrics[f"eval_{pool}_pass_at_{key[5:]}"] = float(value)
    return metrics


def log_eval_summary(
    client: MlflowClient, run_id: str, lines: Iterable[Mapping[str, Any]]
) -> list[int]:
    """Log evaluated checkpoints the run does not hold yet; returns their steps."""
    start_ms = client.get_run(run_id).info.start_time
    done = logged_steps(client, run_id, EVAL_MARKER)
    groups, steps = [], []
    for line in lines:
        step = int(line["step"])
        if step in done:
            continue
        metrics = eval_metrics(line)
        stamp = start_ms + step
        group = [Metric(k, v, stamp, step) for k, v in metrics.items()]
        microhours = round(float(line["device_hours"]) * 1e6)
        group.append(
            Metric("eval_pass_at_1_by_device_microhours", float(line["pass@1"]), stamp, microhours)
        )
        groups.append(group)
        steps.append(step)
        done.add(step)
    _log_points(client, run_id, groups)
    return steps


def dataset_digest(prep_dir: Path) -> str:
    """sha256 of the prep manifest (sources, content hashes, parameters, splits)."""
    manifest = Path(prep_dir) / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(
            f"tasks.prep_dir: {manifest} is missing (not a `thundersync prep` output folder)"
        )
    return hashlib.sha256(manifest.read_bytes()).hexdigest()


def log_prep_datasets(client: MlflowClient, run_id: str, prep_dir: Path) -> list[str]:
    """The prep split files as MLflow dataset inputs (context: the split); returns names."""
    import mlflow.data  # noqa: PLC0415 - pandas is only needed here
    import pyarrow.parquet as pq  # noqa: PLC0415

    prep_dir = Path(prep_dir).resolve()
    # MLflow limits digests to 36 characters; the full hash is the run's dataset_sha256 tag.
    digest = dataset_digest(prep_dir)[:32]
    inputs, names = [], []
    for pool in ("terminal", "swe"):
        for split in ("train", "dev"):
            path = prep_dir / pool / f"{split}.parquet"
            if not path.is_file():
                continue
            frame = pq.read_table(path).to_pandas()
            name = f"{prep_dir.name}/{pool}-{split}"
            with warnings.catch_warnings():
                # MLflow registers two local-file source classes that both claim a path.
                warnings.filterwarnings("ignore", "The specified dataset source can be")
                dataset = mlflow.data.from_pandas(frame, source=str(path), name=name, digest=digest)
            tags = [InputTag("mlflow.data.context", split), InputTag("pool", pool)]
            inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags))
            names.append(name)
    if not inputs:
        raise FileNotFoundError(f"tasks.prep_dir: {prep_dir} holds no <pool>/<split>.parquet")
    client.log_inputs(run_id, datasets=inputs)
    return names


def checkpoint_pointers(run_dir: Path) -> dict[str, Any]:
    """Where a run's checkpoints are (paths and step/device-hours), not the weights."""
    run_dir = Path(run_dir).resolve()
    checkpoints = []
    for state in sorted((run_dir / "checkpoints").glob("step-*/state.json")):
        info = json.loads(state.read_text())
        checkpoints.append(
            {
                "step": info.get("step"),
                "path": str(state.parent),
                "model": str(state.parent / "model"),
                "device_hours": (info.get("extra") or {}).get("device_hours"),
            }
        )
    return {"run_dir": str(run_dir), "checkpoints": checkpoints}


def log_run_folder(client: MlflowClient, run_id: str, run_dir: Path) -> list[str]:
    """config.yaml, summary.json, traces/ and a checkpoint pointer file; returns paths."""
    run_dir = Path(run_dir)
    logged = []
    for name in ("config.yaml", "summary.json"):
        if (run_dir / name).is_file():
            client.log_artifact(run_id, str(run_dir / name))
            logged.append(name)
    if (run_dir / "traces").is_dir():
        client.log_artifacts(run_id, str(run_dir / "traces"), artifact_path="traces")
        logged.append("traces/")
    with tempfile.TemporaryDirectory() as scratch:
        pointer = Path(scratch) / "checkpoints.json"
        pointer.write_text(json.dumps(checkpoint_pointers(run_dir), indent=2) + "\n")
        client.log_artifact(run_id, str(pointer))
    logged.append("checkpoints.json")
    return logged


def finish_run(client: MlflowClient, run_id: str, *, error: str | None = None) -> None:
    if error is not None:
        client.set_tag(run_id, "error", error[:8000])
    status = RunStatus.to_string(RunStatus.FAILED if error else RunStatus.FINISHED)
    client.set_terminated(run_id, status=status)


def finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def run_url(ui_url: str, experiment_id: str, run_id: str) -> str:
    return f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def compare_url(ui_url: str, experiment_id: str, run_ids: Sequence[str]) -> str:
    runs = quote(json.dumps(list(run_ids)), safe="")
    experiments = quote(json.dumps([experiment_id]), safe="")
    return f"{ui_url.rstrip('/')}/#/compare-runs?runs={runs}&experiments={experiments}"
