"""Evaluate every published checkpoint of a training run, keyed by device-hours.

A run folder, as the training stage writes it::

    RUN/checkpoints/step-NNNNNN/model/        a Hugging Face policy folder (model + tokenizer)
    RUN/checkpoints/step-NNNNNN/state.json    {"step", "policy_version", "extra": {
                                                  "device_hours", "wall_s", "run",
                                                  "schedule", "objective"}}
    RUN/metrics.jsonl                         one line per step: step, step_wall_s,
                                              device_hours (cumulative), reward_mean, ...

A checkpoint counts as published once its ``state.json`` exists (the trainer writes the
folder under a temporary name and renames it). Each is evaluated with k attempts per task
on the given pools, and written to ``RUN/eval/step-NNNNNN.jsonl`` (one line per attempt,
tagged with run, schedule, step and device-hours); a checkpoint whose file exists is
skipped, so re-running after new checkpoints appear evaluates only those. The file is
written atomically, so a crash mid-evaluation leaves no file and the checkpoint is redone.

``RUN/eval/summary.jsonl`` (one line per evaluated checkpoint: run, schedule, step,
device_hours, pass@1, pass@k, n_tasks, and the same per pool) is rebuilt from the step
files on every call, so it never disagrees with them.

Device-hours at publication come from ``state.json``'s ``extra.device_hours``; where that is
absent, from the ``metrics.jsonl`` line of the same step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval.io import read_jsonl, write_jsonl
from eval.terminal_eval import EvalSettings, evaluate, summarize
from thundersync_core.rollout.agent import AgentTask
from thundersync_core.rollout.engine import RolloutEngine

__all__ = [
    "CadenceResult",
    "Checkpoint",
    "evaluate_run",
    "list_checkpoints",
    "rebuild_summary",
]

_STEP_DIR = re.compile(r"^step-(\d+)$")
EngineFactory = Callable[[Path], RolloutEngine]


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    policy_version: int
    device_hours: float
    run: str
    schedule: str
    objective: str

    @property
    def model_dir(self) -> Path:
        return self.path / "model"


@dataclass
class CadenceResult:
    evaluated: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)


def _metrics_device_hours(run_dir: Path, step: int) -> float | None:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    for row in read_jsonl(path):
        if row.get("step") == step and isinstance(row.get("device_hours"), int | float):
            return float(row["device_hours"])
    return None


def _read_checkpoint(run_dir: Path, path: Path) -> Checkpoint:
    state_path = path / "state.json"
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{state_path}: not JSON ({exc.msg})") from None
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"{state_path}: field 'step' must be an integer, got {step!r}")
    if step != int(_STEP_DIR.match(path.name).group(1)):  # type: ignore[union-attr]
        raise ValueError(f"{state_path}: step {step} does not match the folder name {path.name}")
    extra = state.get("extra") if isinstance(state.get("extra"), dict) else {}
    device_hours = extra.get("device_hours")
    if not isinstance(device_hours, int | float) or isinstance(device_hours, bool):
        device_hours = _metrics_device_hours(run_dir, step)
    if device_hours is None:
        raise ValueError(
            f"{state_path}: no extra.device_hours, and {run_dir / 'metrics.jsonl'} has no "
            f"device_hours for step {step}"
        )
    return Checkpoint(
        path=path,
        step=step,
        policy_version=int(state.get("policy_version", step)),
        device_hours=float(device_hours),
        run=str(extra.get("run") or run_dir.name),
        schedule=str(extra.get("schedule") or "unknown"),
        objective=str(extra.get("objective") or "unknown"),
    )


def list_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """The published checkpoints of a run (``state.json`` present), by step."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        raise FileNotFoundError(f"--run {run_dir}: no checkpoints/ folder")
    published = [
        path
        for path in root.iterdir()
        if _STEP_DIR.match(path.name) and (path / "state.json").is_file()
    ]
    checkpoints = [_read_checkpoint(Path(run_dir), path) for path in published]
    return sorted(checkpoints, key=lambda c: c.step)


def eval_file(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "eval" / f"step-{step:06d}.jsonl"


def _default_engine(kind: str) -> EngineFactory:
    def make(model_dir: Path) -> RolloutEngine:
        from thundersync_core.rollout.cli import make_engine  # noqa: PLC0415 - torch import

        return make_engine(kind, model_dir)

    return make


# A one-file checkpoint's weights, which a running engine can load; sharded ones (large
# models) get an engine of their own.
_WEIGHTS_FILE = "model.safetensors"


class _Engines:
    """One engine for a call's checkpoints: started on the first, then given each next
    checkpoint's weights (``load_weights``, which also drops the prefix cache), since an
    engine start costs far more than a weight load. A checkpoint whose model config differs
    from the running engine's (another architecture) gets an engine of its own."""

    def __init__(self, factory: EngineFactory) -> None:
        self.factory = factory
        self.engine: RolloutEngine | None = None
        self.config: bytes | None = None

    def for_checkpoint(self, checkpoint: Checkpoint) -> RolloutEngine:
        model_dir = checkpoint.model_dir
        config = (model_dir / "config.json").read_bytes()
        weights = model_dir / _WEIGHTS_FILE
        if self.engine is not None and config == self.config and weights.is_file():
            self.engine.load_weights(weights, checkpoint.policy_version)
            return self.engine
        self.close()
        self.engine, self.config = self.factory(model_dir), config
        # It holds that checkpoint's weights: its samples carry the checkpoint's version,
        # as they do after a load.
        self.engine.policy_version = checkpoint.policy_version
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.close()


def _evaluate_checkpoint(
    checkpoint: Checkpoint,
    pools: Mapping[str, Sequence[AgentTask]],
    settings: EvalSettings,
    engines: _Engines,
    tokenizer_dir: Path | None,
) -> list[dict[str, Any]]:
    from thundersync_core.policy.io import load_tokenizer  # noqa: PLC0415 - torch import

    if not (checkpoint.model_dir / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint.path}: model/ holds no config.json")
    tokenizer = load_tokenizer(tokenizer_dir or checkpoint.model_dir)
    engine = engines.for_checkpoint(checkpoint)
    rows = evaluate(engine, tokenizer, pools, settings, model_dir=checkpoint.model_dir)  # type: ignore[arg-type]
    tags = {
        "run": checkpoint.run,
        "schedule": checkpoint.schedule,
        "objective": checkpoint.objective,
        "step": checkpoint.step,
        "checkpoint_policy_version": checkpoint.policy_version,
        "device_hours": checkpoint.device_hours,
        "k": settings.k,
    }
    return [row | tags for row in rows]


def _summary_line(rows: Sequence[Mapping[str, Any]], source: Path) -> dict[str, Any]:
    first = rows[0]
    k = int(first["k"])
    try:
        scores = summarize(rows, sorted({1, k}))
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    scores.pop("per_task")
    head = {key: first[key] for key in ("run", "schedule", "objective", "step", "device_hours")}
    return head | {"k": k} | scores


def rebuild_summary(run_dir: Path) -> list[dict[str, Any]]:
    """Rewrite ``RUN/eval/summary.jsonl`` from the step files; returns its lines."""
    eval_dir = Path(run_dir) / "eval"
    lines = []
    for path in sorted(eval_dir.glob("step-*.jsonl")):
        rows = read_jsonl(path)
        if rows:
            lines.append(_summary_line(rows, path))
    lines.sort(key=lambda line: line["step"])
    write_jsonl(eval_dir / "summary.jsonl", lines)
    return lines


def evaluate_run(
    run_dir: Path,
    pools: Mapping[str, Sequence[AgentTask]],
    settings: EvalSettings,
    *,
    engine_kind: str = "auto",
    engine_factory: EngineFactory | None = None,
    tokenizer_dir: Path | None = None,
) -> CadenceResult:
    """Evaluate every published, not yet evaluated checkpoint; rebuild the summary.

    One engine serves the call's checkpoints of one architecture (see ``_Engines``)."""
    engines = _Engines(engine_factory or _default_engine(engine_kind))
    result = CadenceResult()
    try:
        for checkpoint in list_checkpoints(run_dir):
            out = eval_file(run_dir, checkpoint.step)
            if out.is_file():
                result.skipped.append(checkpoint.step)
                continue
            rows = _evaluate_checkpoint(checkpoint, pools, settings, engines, tokenizer_dir)
            write_jsonl(out, rows)
            result.evaluated.append(checkpoint.step)
    finally:
        engines.close()
    result.summary = rebuild_summary(run_dir)
    return result
