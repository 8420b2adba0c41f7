"""Training-stage tasks: resolve the config, open the MLflow run, train, log steps, finish.

``run_training`` launches the trainer and logs each step as it lands. Its retry (a
preempted or killed trainer, a role that kept dying) resumes from the run's latest
checkpoint, so a run that dies at step 15 of 20 finishes from step 15; a refused step or a
refused input is not retried (it would fail the same way). The logging tasks are retried
too, and are idempotent (see tasks/tracking.py).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import yaml
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks import tracking
from tasks.common import IO_RETRY, task_logger
from tasks.jobs import Launcher, TrainingJob, launch
from tasks.progress import eta_line, progress, step_line

__all__ = [
    "TrainingFailed",
    "finish_training",
    "log_steps",
    "open_train_run",
    "read_new_records",
    "resolve_train_config",
    "run_totals",
    "run_training",
    "shared_start",
]


@task(cache_policy=NO_CACHE)
def resolve_train_config(
    train_config: Path | None, overrides: dict[str, Any], out_path: Path
) -> dict[str, Any]:
    """Defaults < file < overrides, validated, written to ``out_path`` with absolute paths."""
    from thundersync_core.config import TrainConfig, dump_config, load_config  # noqa: PLC0415

    data = load_config(train_config, overrides).model_dump(mode="json")
    # The run may start in another working directory (a subprocess, a Ray job).
    data["tasks"]["prep_dir"] = str(Path(data["tasks"]["prep_dir"]).resolve())
    for key in ("path", "teacher_path"):
        if data["policy"][key]:
            data["policy"][key] = str(Path(data["policy"][key]).resolve())
    config = TrainConfig.model_validate(data)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(dump_config(config))
    return config.model_dump(mode="json")


def model_tag(config: dict[str, Any]) -> str:
    policy = config["policy"]
    return str(policy["path"]) if policy.get("path") else f"preset:{policy['preset']}"


@task(**IO_RETRY)
def open_train_run(
    tracking_uri: str,
    study: str,
    config: dict[str, Any],
    run_dir: Path,
    *,
    parent_run_id: str | None = None,
    flow_run_id: str = "",
) -> dict[str, str]:
    """The MLflow run of one training run: tags, flattened config, prep datasets and
    the prep manifest."""
    client = tracking.connect(tracking_uri)
    experiment_id = tracking.open_experiment(client, study)
    prep_dir = Path(config["tasks"]["prep_dir"])
    sha256 = tracking.dataset_digest(prep_dir)
    run_id = tracking.find_or_create_run(
        client,
        experiment_id,
        name=config["name"],
        key_tags={"stage": "train", "run_dir": str(Path(run_dir).resolve())},
        tags={
            "schedule": config["schedule"],
            "seed": str(config["seed"]),
            "objective": config["objective"],
            "model": model_tag(config),
            "dataset_digest": sha256[:32],
            "dataset_sha256": sha256,
            "prep_dir": str(prep_dir),
            "prefect.flow_run_id": flow_run_id,
        },
        parent_run_id=parent_run_id,
    )
    tracking.log_params(client, run_id, config)
    tracking.log_prep_datasets(client, run_id, prep_dir)
    client.log_artifact(run_id, str(prep_dir / "manifest.json"), "prep")
    return {"run_id": run_id, "experiment_id": experiment_id, "dataset_sha256": sha256}


class TrainingFailed(RuntimeError):
    """The training stage stopped; the message is the trainer's own cause. ``retryable``
    says whether a resumed attempt could finish (see ``run_training``)."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def retry_training(_task: Any, _task_run: Any, state: Any) -> bool:
    """Retry ``run_training`` only for a failure a resumed attempt could get past."""
    return bool(getattr(state.data, "retryable", False))


@task(cache_policy=NO_CACHE, retry_condition_fn=retry_training)
def run_training(
    launcher: Launcher,
    config_path: Path,
    run_dir: Path,
    *,
    tracking_uri: str,
    run_id: str,
    poll_s: float = 2.0,
    ray_address: str | None = None,
    submission_id: str = "",
) -> None:
    """One attempt at the training stage, followed to its end with each step logged as it
    lands. An attempt on a run folder that holds steps (an earlier attempt's) resumes from
    its latest checkpoint. Raises ``TrainingFailed`` when the trainer fails."""
    run_dir = Path(run_dir)
    resume = (run_dir / "metrics.jsonl").exists()
    started = time.time()
    # Read before the trainer starts: it writes config.yaml again (resolved) as it begins.
    total_steps = _config_steps(config_path)
    job = launch(
        launcher,
        config_path,
        run_dir,
        ray_address=ray_address,
        submission_id=f"{submission_id}-{time.time_ns()}" if resume else submission_id,
        resume=resume,
    )
    logger = task_logger()
    logger.info("training %s: %s", "resumed" if resume else "started", job.description)
    progress(
        f"train {run_dir.name}", f"{'resumed' if resume else 'started'}, output {job_log(job)}"
    )
    follow(job, tracking_uri, run_id, poll_s, total_steps=total_steps)
    if job.poll() == "failed":
        raise TrainingFailed(
            f"training run {run_dir.name} ({run_dir}) failed: {job.failure()}",
            retryable=job.retryable() and _summary_allows_retry(run_dir, started),
        )


def _summary_allows_retry(run_dir: Path, since: float) -> bool:
    """False when this attempt's summary.json says the run failed in a way a retry would
    meet again (a refused step); a trainer killed outright writes none."""
    path = run_dir / "summary.json"
    if not path.is_file() or path.stat().st_mtime < since:
        return True
    summary = json.loads(path.read_text())
    return not (summary.get("status") == "failed" and summary.get("retryable") is False)


def job_log(job: TrainingJob) -> str:
    """Where the job's own output goes (engine, Ray and trainer lines)."""
    path = getattr(job, "log_path", None)
    return str(path) if path is not None else "in the flow's log"


def _config_steps(config_path: Path) -> int | None:
    with contextlib.suppress(OSError, yaml.YAMLError, AttributeError):
        steps = (yaml.safe_load(Path(config_path).read_text()) or {}).get("steps")
        return int(steps) if steps is not None else None
    return None


def follow(
    job: TrainingJob,
    tracking_uri: str,
    run_id: str,
    poll_s: float,
    *,
    total_steps: int | None = None,
) -> None:
    """Log every step of ``job`` as its line lands in metrics.jsonl, until the job ends;
    a progress line per step (with an ETA when ``total_steps`` is known)."""
    metrics = Path(job.run_dir) / "metrics.jsonl"
    offset, seen, first_seen = 0, 0, None
    while True:
        # Status first: a job seen finished has written its last line already.
        finished = job.poll() != "running"
        records, offset = read_new_records(metrics, offset)
        if records:
            log_steps(tracking_uri, run_id, records)
        for record in records:
            seen += 1
            now = time.time()
            first_seen = first_seen or now - float(record.get("step_wall_s", 0.0))
            done = int(record["step"]) + 1
            pace = (now - first_seen) / seen
            count = eta_line(done, total_steps, pace) if total_steps else str(done)
            progress(f"train {Path(job.run_dir).name}", f"{count}: {step_line(record)}")
        if finished:
            return
        time.sleep(poll_s)


@task(cache_policy=NO_CACHE)
def shared_start(config: dict[str, Any], out: Path) -> dict[str, str]:
    """Warm-start once for every schedule of a seed; returns the policy (and OPD teacher)
    folders as overrides, so all schedules start from the same weights. Nothing to do (no
    overrides) when the config names both folders already."""
    from thundersync_core.config import TrainConfig  # noqa: PLC0415
    from thundersync_core.pools import load_pool  # noqa: PLC0415
    from thundersync_core.warmstart.cache import prepare_policies  # noqa: PLC0415
    from thundersync_core.warmstart.frontier import frontier_pool  # noqa: PLC0415

    resolved = TrainConfig.model_validate(config)
    needs_teacher = resolved.objective == "opd" and resolved.policy.teacher_path is None
    if resolved.policy.path is not None and not needs_teacher:
        return {}
    pool = load_pool(resolved.tasks.prep_dir, "train", resolved.tasks.families)
    policy, teacher = prepare_policies(resolved, Path(out), list(pool.values()))
    # Scored once here (kept in the warm-start cache), not by each schedule's run.
    frontier_pool(resolved, policy, pool, Path(out), report=lambda line: progress("frontier", line))
    overrides = {"policy.path": str(policy)}
    if teacher is not None:
        overrides["policy.teacher_path"] = str(teacher)
    return overrides


def read_new_records(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Complete lines of ``metrics.jsonl`` from byte ``offset``; returns them and the new
    offset (a line still being written is left for the next read)."""
    if not path.is_file():
        return [], offset
    with path.open("rb") as handle:
        handle.seek(offset)
        data = handle.read()
    end = data.rfind(b"\n") + 1
    lines = data[:end].decode().splitlines()
    return [json.loads(line) for line in lines if line.strip()], offset + end


@task(**IO_RETRY)
def log_steps(tracking_uri: str, run_id: str, records: list[dict[str, Any]]) -> list[int]:
    """Log step records to the run; steps it already holds are skipped."""
    logged = tracking.log_step_metrics(tracking.connect(tracking_uri), run_id, records)
    logger = task_logger()
    for record in records:
        if int(record["step"]) in logged:
            logger.info(
                "step %s: wall %.2f s, learner idle %.0f%%, reward %.3f, loss %+.4f",
                record["step"],
                record.get("step_wall_s", float("nan")),
                100 * record.get("learner_idle_fraction", float("nan")),
                record.get("reward_mean", float("nan")),
                record.get("loss", float("nan")),
            )
    return logged


@task(**IO_RETRY)
def finish_training(
    tracking_uri: str, run_id: str, run_dir: Path, *, error: str | None = None
) -> dict[str, Any]:
    """Artifacts, the dev pass rates and the run status; returns summary.json (or {})."""
    client = tracking.connect(tracking_uri)
    tracking.log_run_folder(client, run_id, run_dir)
    summary_path = Path(run_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    stamp = client.get_run(run_id).info.start_time
    for when in ("dev_before", "dev_after"):
        for key, value in (summary.get(when) or {}).items():
            if tracking.finite(value):
                client.log_metric(run_id, f"{when}_{key}", float(value), stamp, step=0)
    tracking.finish_run(client, run_id, error=error)
    return summary


def run_totals(run_dir: Path) -> dict[str, Any]:
    """A run's headline numbers from metrics.jsonl: steps, means, final device-hours."""
    records, _ = read_new_records(Path(run_dir) / "metrics.jsonl", 0)
    if not records:
        return {"steps": 0}

    def mean(key: str) -> float:
        values = [r[key] for r in records if tracking.finite(r.get(key))]
        return sum(values) / len(values) if values else float("nan")

    return {
        "steps": len(records),
        "mean_step_wall_s": mean("step_wall_s"),
        "mean_learner_idle_fraction": mean("learner_idle_fraction"),
        "mean_reward": mean("reward_mean"),
        "device_hours": records[-1].get("device_hours"),
    }
