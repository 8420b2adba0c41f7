"""Evaluation tasks: every published checkpoint of a run (eval cadence), then MLflow.

``evaluate_run`` skips checkpoints whose results are already on disk and writes each one
atomically, so a retry redoes only what did not finish.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks import tracking
from tasks.common import IO_RETRY, retry_is_useful, task_logger

__all__ = ["dev_pools", "evaluate_checkpoints", "log_evaluation"]


def dev_pools(
    prep_dir: Path, split: str, families: list[str], limit: int, grade_timeout_s: float
) -> dict[str, list[Any]]:
    """The prep split's pools, terminal tasks restricted to the trained ``families`` (empty:
    all), as the training stage's own dev evaluation does; then the first ``limit`` each."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    from eval.terminal_eval import load_prep_pools  # noqa: PLC0415 - torch import

    pools = load_prep_pools(prep_dir, split, grade_timeout_s=grade_timeout_s)
    if families and "terminal" in pools:
        table = Path(prep_dir) / "terminal" / f"{split}.parquet"
        rows = pq.read_table(table, columns=["task_id", "family"]).to_pylist()
        keep = {r["task_id"] for r in rows if r["family"] in families}
        pools["terminal"] = [t for t in pools["terminal"] if t.task_id in keep]
    pools = {name: tasks[: limit or None] for name, tasks in pools.items() if tasks}
    if not pools:
        raise ValueError(f"tasks.families: no {split} task of {families} in {prep_dir}")
    return pools


@task(retries=1, retry_condition_fn=retry_is_useful, cache_policy=NO_CACHE)
def evaluate_checkpoints(
    run_dir: Path,
    prep_dir: Path,
    settings: dict[str, Any],
    *,
    split: str = "dev",
    families: list[str] | None = None,
    limit: int = 0,
    engine: str = "auto",
) -> list[dict[str, Any]]:
    """pass@1 and pass@k of each checkpoint on the prep split; returns the summary lines."""
    from eval.cadence import evaluate_run  # noqa: PLC0415 - torch import
    from eval.terminal_eval import EvalSettings  # noqa: PLC0415

    eval_settings = EvalSettings(**settings)
    pools = dev_pools(prep_dir, split, families or [], limit, eval_settings.grade_timeout_s)
    result = evaluate_run(run_dir, pools, eval_settings, engine_kind=engine)
    task_logger().info(
        "%s: evaluated checkpoints %s, already done %s",
        run_dir,
        result.evaluated,
        result.skipped,
    )
    return result.summary


@task(**IO_RETRY)
def log_evaluation(
    tracking_uri: str, run_id: str, run_dir: Path, lines: list[dict[str, Any]]
) -> list[int]:
    """Scores by checkpoint step and by device-hours, and eval/summary.jsonl as artifact."""
    client = tracking.connect(tracking_uri)
    steps = tracking.log_eval_summary(client, run_id, lines)
    summary = Path(run_dir) / "eval" / "summary.jsonl"
    if summary.is_file():
        client.log_artifact(run_id, str(summary), "eval")
    return steps
