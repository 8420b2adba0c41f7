"""Evaluate a policy with the bash agent: k attempts per task, one JSONL line per attempt.

Pools are lists of agent tasks: ``terminal`` (Harbor-format task folders, graded by their
verifier) and ``swe`` (SWE-smith-schema records on repository snapshots, graded by
``grade_swe``; see swe_tasks.py). Each task gets k trajectories with ids ``task/attempt``;
the agent seeds every request from (base seed, task, trajectory id, turn), so the k
attempts sample independently and a rerun with the same seed samples the same tokens.

An attempt's line holds ``task_id``, ``attempt``, ``success`` (reward >= the success
threshold, 1.0 by default: full marks), ``reward``, ``reward_reason``, ``finish_reason``,
``turns``, ``pool`` and a few more fields; ``eval/passk.py`` reads it. Attempts run in
batches of ``episodes_per_batch`` concurrent episodes so memory and sandbox count stay
bounded whatever the pool size.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval.passk import AttemptResult, pass_at_k_by_task, score, task_counts
from thundersync_core.rollout.agent import Agent, AgentConfig, AgentTask, EpisodeSpec, Tokenizer
from thundersync_core.rollout.chat import chat_format, sampling_config
from thundersync_core.rollout.engine import RolloutEngine
from thundersync_core.rollout.sandbox import SandboxLimits, open_sandbox
from thundersync_core.rollout.tasks import load_terminal_task, load_terminal_tasks

__all__ = [
    "EvalSettings",
    "evaluate",
    "load_pools",
    "load_prep_pools",
    "run_eval",
    "summarize",
]

TERMINAL, SWE = "terminal", "swe"


@dataclass(frozen=True)
class EvalSettings:
    k: int = 3
    max_turns: int = 4
    max_tokens_per_turn: int = 64
    max_total_tokens: int = 1024
    max_context_tokens: int = 4096
    command_timeout_s: float = 10.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    #: The conversation format (``rollout/chat.py``): as the policy was trained.
    action_format: str = "bash_block"
    tool_call_format: str = "auto"
    enable_thinking: bool | None = None
    template_check: bool = True
    seed: int = 0
    backend: str = "local"
    docker_image: str | None = None
    episodes_per_batch: int = 32
    success_threshold: float = 1.0
    grade_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"--k must be >= 1, got {self.k}")
        if self.episodes_per_batch < 1:
            raise ValueError(f"episodes_per_batch must be >= 1, got {self.episodes_per_batch}")

    @property
    def ks(self) -> list[int]:
        """The k values reported: pass@1 and pass@k."""
        return sorted({1, self.k})


# -- pools ----------------------------------------------------------------------------------


def _check_unique(pools: Mapping[str, Sequence[AgentTask]]) -> None:
    seen: dict[str, str] = {}
    for pool, tasks in pools.items():
        for task in tasks:
            if task.task_id in seen:
                raise ValueError(
                    f"task id {task.task_id!r} appears in pools {seen[task.task_id]!r} and "
                    f"{pool!r}; pass@k keys results by task id"
                )
            seen[task.task_id] = pool


def load_pools(
    tasks_dir: Path | None = None,
    swe_parquet: Path | None = None,
    repos: Path | None = None,
    *,
    limit: int = 0,
    grade_timeout_s: float = 120.0,
) -> dict[str, list[AgentTask]]:
    """Pools from a folder of terminal tasks and/or a SWE parquet; ``limit`` caps each pool."""
    from eval.swe_tasks import load_swe_tasks  # noqa: PLC0415 - pyarrow only when needed

    pools: dict[str, list[AgentTask]] = {}
    if tasks_dir is not None:
        pools[TERMINAL] = list(load_terminal_tasks(tasks_dir))
    if swe_parquet is not None:
        pools[SWE] = list(load_swe_tasks(swe_parquet, repos, grade_timeout_s=grade_timeout_s))
    return _finish_pools(pools, limit)


def load_prep_pools(
    prep_dir: Path, split: str = "dev", *, limit: int = 0, grade_timeout_s: float = 120.0
) -> dict[str, list[AgentTask]]:
    """The ``split`` of a prep output folder: terminal and SWE pools, empty ones left out."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    from eval.swe_tasks import load_swe_tasks  # noqa: PLC0415

    prep_dir = Path(prep_dir)
    terminal_parquet = prep_dir / TERMINAL / f"{split}.parquet"
    swe_parquet = prep_dir / SWE / f"{split}.parquet"
    for path in (terminal_parquet, swe_parquet):
        if not path.is_file():
            raise FileNotFoundError(f"--prep {prep_dir}: no {path.relative_to(prep_dir)}")
    rows = pq.read_table(terminal_parquet).to_pylist()
    pools: dict[str, list[AgentTask]] = {
        TERMINAL: [load_terminal_task(prep_dir / row["path"]) for row in rows],
        SWE: list(load_swe_tasks(swe_parquet, prep_dir / "repos", grade_timeout_s=grade_timeout_s)),
    }
    pools = {name: tasks for name, tasks in pools.items() if tasks}
    if not pools:
        raise ValueError(f"--prep {prep_dir}: the {split!r} split has no terminal or SWE tasks")
    return _finish_pools(pools, limit)


def _finish_pools(pools: dict[str, list[AgentTask]], limit: int) -> dict[str, list[AgentTask]]:
    if limit < 0:
        raise ValueError(f"--limit must be >= 0, got {limit}")
    if limit:
        pools = {name: tasks[:limit] for name, tasks in pools.items()}
    if not any(pools.values()):
        raise ValueError("no tasks to evaluate: give --tasks and/or --swe (or --prep)")
    _check_unique(pools)
    return pools


# -- running --------------------------------------------------------------------------------


def _row(trajectory: Any, pool: str, attempt: int, threshold: float) -> dict[str, Any]:
    meta = trajectory.metadata or {}
    events = meta.get("events") or []
    wall_s = events[-1]["time"] - events[0]["time"] if len(events) > 1 else 0.0
    return {
        "pool": pool,
        "task_id": meta["task_id"],
        "attempt": attempt,
        "trajectory_id": trajectory.trajectory_id,
        "success": trajectory.reward >= threshold,
        "reward": trajectory.reward,
        "reward_reason": meta.get("reward_reason"),
        "finish_reason": meta.get("finish_reason"),
        "turns": len(meta.get("turn_versions") or []),
        "action_tokens": sum(len(s.ids) for s in trajectory.segments if s.kind == "action"),
        "policy_version": trajectory.policy_version,
        "wall_s": round(wall_s, 3),
    }


def _specs(pools: Mapping[str, Sequence[AgentTask]], k: int) -> list[tuple[str, int, EpisodeSpec]]:
    return [
        (pool, attempt, EpisodeSpec(task, task.task_id, f"{task.task_id}/{attempt}"))
        for pool, tasks in pools.items()
        for task in tasks
        for attempt in range(k)
    ]


def evaluate(
    engine: RolloutEngine,
    tokenizer: Tokenizer,
    pools: Mapping[str, Sequence[AgentTask]],
    settings: EvalSettings,
    *,
    model_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """Run k attempts of every task of every pool; one result row per attempt, in order.
    ``model_dir``: the checkpoint folder whose generation config names the stop tokens."""
    config = AgentConfig(
        max_turns=settings.max_turns,
        max_tokens_per_turn=settings.max_tokens_per_turn,
        max_total_tokens=settings.max_total_tokens,
        max_context_tokens=settings.max_context_tokens,
        command_timeout_s=settings.command_timeout_s,
    )
    # The grader's pytest run shares these limits: its CPU limit must outlast its timeout.
    limits = SandboxLimits(
        timeout_s=settings.command_timeout_s,
        memory_mb=2048,
        cpu_s=int(max(settings.grade_timeout_s, settings.command_timeout_s)) + 1,
    )
    chat = chat_format(tokenizer, model_dir, settings)
    agent = Agent(
        engine,
        tokenizer,
        lambda: open_sandbox(
            settings.backend,  # type: ignore[arg-type]
            limits=limits,
            image=settings.docker_image if settings.backend == "docker" else None,
        ),
        config=config,
        sampling=sampling_config(settings, chat.stop_token_ids),
        base_seed=settings.seed,
        chat=chat,
    )
    planned = _specs(pools, settings.k)
    rows: list[dict[str, Any]] = []
    try:
        for start in range(0, len(planned), settings.episodes_per_batch):
            batch = planned[start : start + settings.episodes_per_batch]
            trajectories = agent.run([spec for _, _, spec in batch])
            for (pool, attempt, _), trajectory in zip(batch, trajectories, strict=True):
                rows.append(_row(trajectory, pool, attempt, settings.success_threshold))
    finally:
        agent.close()
    return rows


# -- results --------------------------------------------------------------------------------


def _attempts(rows: Sequence[Mapping[str, Any]]) -> list[AttemptResult]:
    return [AttemptResult(r["task_id"], r["attempt"], bool(r["success"])) for r in rows]


def summarize(rows: Sequence[Mapping[str, Any]], ks: Sequence[int]) -> dict[str, Any]:
    """pass@k over all tasks (each weighs the same), per pool, and per task."""
    if not rows:
        raise ValueError("no attempts to summarize")
    summary = score(_attempts(rows), ks)
    pools: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        pools.setdefault(str(row.get("pool", "all")), []).append(row)
    summary["pools"] = {name: score(_attempts(members), ks) for name, members in pools.items()}
    counts = task_counts(_attempts(rows))
    per_k = {k: pass_at_k_by_task(counts, k) for k in ks}
    pool_of = {row["task_id"]: row.get("pool") for row in rows}
    summary["per_task"] = {
        task: {"pool": pool_of[task], "n": n, "successes": c}
        | {f"pass@{k}": per_k[k][task] for k in ks}
        for task, (n, c) in counts.items()
    }
    return summary


def run_eval(
    model_dir: Path,
    pools: Mapping[str, Sequence[AgentTask]],
    settings: EvalSettings,
    *,
    engine_kind: str = "auto",
    tokenizer_dir: Path | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Load the policy into an engine, evaluate, close; returns (rows, run info)."""
    from thundersync_core.policy.io import load_tokenizer  # noqa: PLC0415 - torch import
    from thundersync_core.rollout.cli import make_engine  # noqa: PLC0415

    tokenizer = load_tokenizer(tokenizer_dir or model_dir)
    started = time.perf_counter()
    engine = make_engine(engine_kind, Path(model_dir))
    try:
        rows = evaluate(engine, tokenizer, pools, settings, model_dir=Path(model_dir))  # type: ignore[arg-type]
    finally:
        engine.close()
    info = {"engine": type(engine).__name__, "wall_s": round(time.perf_counter() - started, 2)}
    return rows, info
