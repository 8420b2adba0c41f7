"""Pydantic models for the simulator and the allocation planner (no heavy imports).

One YAML file holds one planner scenario (``PlanConfig``) or one simulated run
(``SimConfig``); the loaders name the file and the field when something is wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ModelT = TypeVar("ModelT", bound=BaseModel)
Schedule = Literal["sync", "thundersync", "async", "pipeline"]
SCHEDULES: tuple[Schedule, ...] = ("sync", "thundersync", "async", "pipeline")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DurationConfig(_Strict):
    """Trajectory time: ``turns`` turns of generation then tool call, plus stragglers.

    Per turn, generation time is drawn from the body (lognormal with ``median_s`` and
    ``sigma``, or uniform on [``low_s``, ``high_s``]); the tool call that follows takes a
    lognormal time with median ``tool_latency_s``. A trajectory is a straggler with
    probability ``straggler_prob``; its last turn then generates ``straggler_extra_s`` longer.
    Tokens are generation time times ``decode_tokens_per_s`` (per sequence).
    """

    body: Literal["lognormal", "uniform"] = "lognormal"
    median_s: float = Field(default=20.0, gt=0)
    sigma: float = Field(default=0.3, ge=0)
    low_s: float = Field(default=0.0, ge=0)
    high_s: float = Field(default=40.0, gt=0)
    turns: int = Field(default=1, ge=1)
    tool_latency_s: float = Field(default=0.0, ge=0)
    tool_sigma: float = Field(default=0.0, ge=0)
    straggler_prob: float = Field(default=0.0, ge=0, le=1)
    straggler_extra_s: float = Field(default=0.0, ge=0)
    decode_tokens_per_s: float = Field(default=50.0, gt=0)

    @model_validator(mode="after")
    def _uniform_range(self) -> DurationConfig:
        if self.body == "uniform" and self.low_s >= self.high_s:
            raise ValueError(f"low_s ({self.low_s}) must be below high_s ({self.high_s})")
        return self


class SimConfig(_Strict):
    """One simulated run: the same trajectory draws feed every schedule (common numbers)."""

    batch_size: int = Field(default=256, ge=1)
    steps: int = Field(default=8, ge=1)
    warmup_steps: int = Field(default=1, ge=0)
    rollout_slots: int = Field(default=256, ge=1)
    durations: DurationConfig = DurationConfig()
    learner_s_per_token: float = Field(default=0.0, ge=0)
    learner_s_per_source: float = Field(default=0.0, ge=0)
    optimizer_s: float = Field(default=0.0, ge=0)
    publish_s: float = Field(default=0.0, ge=0)
    max_staleness: int = Field(default=1, ge=0)
    source_granularity: Literal["trajectory", "turn"] = "trajectory"
    sampling: Literal["random", "midpoint"] = "random"
    seed: int = 0

    @model_validator(mode="after")
    def _warmup_below_steps(self) -> SimConfig:
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below steps")
        return self

    @property
    def suffix_s(self) -> float:
        return self.optimizer_s + self.publish_s


class RooflineConfig(_Strict):
    """Per-engine decode step latency: max(floor, compute per sequence * batch).

    Small batches are memory-bound (every step reads all weights: ``floor_s_per_token``);
    large ones compute-bound (``compute_s_per_seq`` per sequence in the batch).
    """

    devices_per_engine: int = Field(default=1, ge=1)
    floor_s_per_token: float = Field(default=0.02, gt=0)
    compute_s_per_seq: float = Field(default=1e-4, gt=0)
    max_concurrency: int = Field(default=256, ge=1)

    def step_latency_s(self, batch: int) -> float:
        return max(self.floor_s_per_token, self.compute_s_per_seq * batch)


class ResponseConfig(_Strict):
    """Response length: lognormal body in tokens plus a straggler share with extra tokens."""

    median_tokens: float = Field(default=1000.0, gt=0)
    sigma: float = Field(default=0.3, ge=0)
    straggler_prob: float = Field(default=0.0, ge=0, le=1)
    straggler_extra_tokens: float = Field(default=0.0, ge=0)
    prompt_tokens: float = Field(default=0.0, ge=0)


class LearnerConfig(_Strict):
    tokens_per_s_per_device: float = Field(gt=0)
    optimizer_s: float = Field(default=0.0, ge=0)
    publish_s: float = Field(default=0.0, ge=0)


class TeacherConfig(_Strict):
    """OPD teacher scoring; ``devices`` fixes its share, otherwise the planner sweeps it."""

    tokens_per_s_per_device: float = Field(gt=0)
    devices: int | None = Field(default=None, ge=1)


class PlanConfig(_Strict):
    """An allocation-planner scenario (one YAML file)."""

    devices: int = Field(ge=2)
    batch_size: int = Field(ge=1)
    max_staleness: int = Field(default=1, ge=0)
    rate_tolerance: float = Field(default=0.25, ge=0, lt=1)
    schedules: tuple[Schedule, ...] = SCHEDULES
    sampling: RooflineConfig = RooflineConfig()
    learner: LearnerConfig
    responses: ResponseConfig = ResponseConfig()
    teacher: TeacherConfig | None = None
    seed: int = 0

    @model_validator(mode="after")
    def _fits(self) -> PlanConfig:
        needed = self.sampling.devices_per_engine + 1 + (1 if self.teacher else 0)
        if self.devices < needed:
            raise ValueError(f"devices ({self.devices}) cannot hold one engine and a learner")
        if self.teacher and self.teacher.devices and self.teacher.devices >= self.devices - 1:
            raise ValueError(f"teacher.devices ({self.teacher.devices}) leaves no room")
        return self


def _load_yaml_model(path: Path, model: type[ModelT]) -> ModelT:
    """Parse a YAML file into ``model``; errors name the file and the offending field."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a mapping of {model.__name__} fields")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ValueError(f"{path}: {problems}") from exc


def load_plan_config(path: Path) -> PlanConfig:
    """Parse a planner YAML file (``PlanConfig``)."""
    return _load_yaml_model(path, PlanConfig)


def load_sim_config(path: Path) -> SimConfig:
    """Parse a simulator YAML file (``SimConfig``)."""
    return _load_yaml_model(path, SimConfig)
