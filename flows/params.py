"""Flow parameters: pydantic models, so the Prefect UI renders each flow's form.

Relative paths are relative to the working directory of the flow run (the repository root
for ``thundersync experiment``, ``make ui`` and the deployments in prefect.yaml); an
experiment YAML (``ExperimentParams.from_yaml``) resolves its own against its folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from thundersync_core.config import Schedule

__all__ = [
    "CompareFlowParams",
    "CompareParams",
    "EvalParams",
    "EvaluateFlowParams",
    "ExperimentParams",
    "PrepParams",
    "TrackingParams",
    "TrainParams",
]

Launcher = Literal["auto", "inprocess", "subprocess", "ray-job"]


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrackingParams(_Params):
    #: MLflow tracking URI; empty: $MLFLOW_TRACKING_URI, else SQLite in the output folder.
    tracking_uri: str | None = None
    #: MLflow experiment (one per study); empty: the training config's name.
    study: str | None = None
    #: Where the MLflow UI is served, for the links in Prefect artifacts.
    ui_url: str = "http://127.0.0.1:5000"

    def resolved(self, out: Path, study: str) -> TrackingParams:
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = f"sqlite:///{(Path(out) / 'mlflow.db').resolve()}"
        return self.model_copy(update={"tracking_uri": uri, "study": self.study or study})


class PrepParams(_Params):
    #: A prep YAML (e.g. configs/prep_embedded.yaml); empty: use tasks.prep_dir as it is.
    config: str | None = None
    #: Prep outputs go to <out_root>/prep-<key of config and data_prep sources> (reused).
    out_root: str = "runs/prep-cache"


class EvalParams(_Params):
    enabled: bool = True
    #: Attempts per task; pass@1 and pass@k are reported.
    k: int = Field(default=2, ge=1)
    split: Literal["dev", "train"] = "dev"
    #: First N tasks of each pool (0: all); terminal tasks are those of the trained families.
    limit: int = Field(default=0, ge=0)
    engine: Literal["auto", "vllm", "hf"] = "auto"
    #: Agent limits; empty: the training config's rollout section.
    max_turns: int | None = Field(default=None, ge=1)
    max_tokens_per_turn: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, gt=0)
    seed: int = 0

    def settings(self, rollout: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments of ``eval.terminal_eval.EvalSettings``."""
        return {
            "k": self.k,
            "max_turns": self.max_turns or rollout["max_turns"],
            "max_tokens_per_turn": self.max_tokens_per_turn or rollout["max_tokens_per_turn"],
            "max_total_tokens": rollout["max_total_tokens"],
            "command_timeout_s": rollout["command_timeout_s"],
            "temperature": self.temperature,
            "seed": self.seed,
            "backend": rollout["backend"],
        }


class CompareParams(_Params):
    #: A field of eval/summary.jsonl: pass@1 or pass@<k>.
    metric: str = "pass@1"
    target: float = Field(default=0.5, ge=0)
    #: Device-hours budget; empty: the smallest final device-hours among the runs.
    budget_dh: float | None = Field(default=None, gt=0)
    baseline: Schedule = "sync"


class CompareFlowParams(_Params):
    """Training run folders (each evaluated) to compare, and where to write the result."""

    run_dirs: list[str] = Field(min_length=1)
    out_dir: str
    compare: CompareParams = Field(default_factory=CompareParams)
    tracking: TrackingParams = Field(default_factory=TrackingParams)


class TrainParams(_Params):
    """One training run: a config file, overrides, the schedule and seed to train with."""

    train_config: str = "configs/train_embedded.yaml"
    #: Dotted keys over the file, e.g. {"steps": 8, "rollout.engine": "hf"}.
    overrides: dict[str, Any] = Field(default_factory=dict)
    schedule: Schedule = "thundersync"
    seed: int = 0
    #: The run folder is <out>/<schedule>-seed<seed>.
    out: str = "runs/train"
    launcher: Launcher = "auto"
    #: Ray job server (http://HEAD:8265); with launcher auto, set means a Ray job.
    ray_address: str | None = None
    #: Seconds between looks at metrics.jsonl.
    poll_s: float = Field(default=2.0, gt=0)
    #: Attempts after a trainer that died (preempted, killed, a role that kept failing);
    #: each resumes from the latest checkpoint. A refused step or input is not retried.
    retries: int = Field(default=2, ge=0)
    retry_delay_s: float = Field(default=10.0, ge=0)
    tracking: TrackingParams = Field(default_factory=TrackingParams)

    @property
    def run_name(self) -> str:
        return f"{self.schedule}-seed{self.seed}"


class EvaluateFlowParams(_Params):
    """Evaluate every checkpoint of one training run folder.

    The scores go to the MLflow run tagged with this ``run_dir``; give the tracking URI the
    run was logged to (default: ``<run_dir>/../mlflow.db``, where ``train_flow`` puts it).
    """

    run_dir: str
    #: Prep folder of the dev tasks; empty: the run's own tasks.prep_dir.
    prep_dir: str | None = None
    eval: EvalParams = Field(default_factory=EvalParams)
    tracking: TrackingParams = Field(default_factory=TrackingParams)


class ExperimentParams(_Params):
    """Schedules trained from one config with the same seeds and steps, then compared."""

    train_config: str = "configs/train_embedded.yaml"
    overrides: dict[str, Any] = Field(default_factory=dict)
    schedules: list[Schedule] = Field(default_factory=lambda: ["sync", "thundersync"], min_length=1)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    #: Steps of every run (the shared budget); empty: the config's steps.
    steps: int | None = Field(default=None, ge=1)
    #: Each flow run writes <out>/<date>-<flow run name>/.
    out: str = "runs/experiment"
    launcher: Launcher = "auto"
    ray_address: str | None = None
    prep: PrepParams = Field(default_factory=PrepParams)
    eval: EvalParams = Field(default_factory=EvalParams)
    compare: CompareParams = Field(default_factory=CompareParams)
    tracking: TrackingParams = Field(default_factory=TrackingParams)

    @classmethod
    def from_yaml(cls, path: Path) -> ExperimentParams:
        """An experiment file; its relative paths are relative to its folder."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--config {path}: no such file")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict) or "train_config" not in data:
            raise ValueError(f"--config {path}: an experiment file needs a train_config key")
        base = path.resolve().parent
        data["train_config"] = str(base / data["train_config"])
        prep = data.get("prep") or {}
        for key in ("config", "out_root"):
            if prep.get(key):
                prep[key] = str((base / prep[key]).resolve())
        return cls.model_validate(data)
