"""Step records: what a run writes per step (metrics line, batch, release trace, the
checkpoint when due) and the records themselves."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thundersync_core.batch import trajectory_to_json
from thundersync_core.checkpoint import due, prune_checkpoints
from thundersync_core.config import TrainConfig
from thundersync_core.metrics import generated_tokens, inflight_swaps, staleness_tokens
from thundersync_core.schedules.base import StepOutcome

__all__ = ["StepRecorder", "release_trace", "step_record", "steps_recorded", "truncate_metrics"]


@dataclass
class StepRecorder:
    """Turns step outcomes into records, files and checkpoints."""

    config: TrainConfig
    out: Path
    devices: int
    learner: Any
    rollout: Any
    wall_offset_s: float
    started_s: float
    on_step: Callable[[dict[str, Any]], None] | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    peak_rollout_bytes: int = 0
    #: Set (by a SIGTERM handler) to stop after the step in progress, checkpointed.
    stop: threading.Event = field(default_factory=threading.Event)

    def __call__(self, outcome: StepOutcome) -> bool:
        import ray  # noqa: PLC0415

        self.peak_rollout_bytes = max(
            self.peak_rollout_bytes, ray.get(self.rollout.memory_bytes.remote())
        )
        record = step_record(self.config, outcome, self.devices, self.peak_rollout_bytes)
        if self.config.resources.rollout.engines > 1:
            # Requests each engine has served so far (the spread over engines).
            record["engine_requests"] = ray.get(self.rollout.engine_requests.remote())
            # The policy versions each engine sampled this step's turns with.
            record["engine_versions"] = ray.get(self.rollout.engine_versions.remote())
        wall_s = self.wall_offset_s + (time.time() - self.started_s)
        record |= {"wall_s": wall_s, "device_hours": self.devices * wall_s / 3600.0}
        self._write(outcome, record)
        step = outcome.step + 1
        stopping = self.stop.is_set()
        if due(step, self.config.checkpoint_every) or step == self.config.steps or stopping:
            extra = {
                "device_hours": record["device_hours"],
                "wall_s": wall_s,
                "run": self.config.name,
                "schedule": self.config.schedule,
                "objective": self.config.objective,
            }
            ray.get(self.learner.save_checkpoint.remote(str(self.out / "checkpoints"), step, extra))
            prune_checkpoints(
                self.out / "checkpoints",
                keep_last=self.config.checkpoint_keep_last,
                keep_every=self.config.checkpoint_keep_every,
            )
        self.records.append(record)
        if self.on_step is not None:
            self.on_step(record)
        print(_progress(record), flush=True)
        return not stopping

    def _write(self, outcome: StepOutcome, record: dict[str, Any]) -> None:
        name = f"step-{outcome.step:06d}"
        (self.out / "batches").mkdir(exist_ok=True)
        (self.out / "batches" / f"{name}.jsonl").write_text(
            "".join(trajectory_to_json(t) + "\n" for t in outcome.trajectories)
        )
        (self.out / "traces").mkdir(exist_ok=True)
        (self.out / "traces" / f"{name}.json").write_text(json.dumps(release_trace(outcome)) + "\n")
        with (self.out / "metrics.jsonl").open("a") as handle:
            handle.write(json.dumps(record) + "\n")


def off_policy_correction(config: TrainConfig) -> str:
    """What the update applies to a stale sample: ``none`` (sync, thundersync: no sample is
    stale), ``truncated_is`` (async, pipeline: each token's term weighted by
    min(pi/mu, is_clip)), ``exact_kl`` (async, pipeline with OPD's teacher top-k: the KL at
    a visited position is taken over the vocabulary, which does not depend on the sampled
    token, so no weight is applied; ``is_weight_mean`` reports what the weights would be)."""
    if config.schedule not in ("async", "pipeline"):
        return "none"
    if config.objective == "opd" and config.opd_teacher_top_k:
        return "exact_kl"
    return "truncated_is"


def step_record(
    config: TrainConfig, outcome: StepOutcome, devices: int, rollout_bytes: int
) -> dict[str, Any]:
    """The metrics record of one step (what orchestration logs, keyed by step)."""
    learner = outcome.learner
    summary = outcome.timeline.summary()
    rewards = [t.reward for t in outcome.trajectories]
    generated = generated_tokens(outcome.trajectories)
    wall = summary["step_wall_s"]
    version = int(learner["trained_version"])
    return {
        "step": outcome.step,
        "schedule": config.schedule,
        "objective": config.objective,
        **summary,
        "mfu": learner["flops"] / (wall * learner["peak_flops"]) if wall > 0 else 0.0,
        "learner_flops": learner["flops"],
        "tokens_per_s": generated / wall if wall > 0 else 0.0,
        "generated_tokens": generated,
        "scored_tokens": learner["n_scored_tokens"],
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else 0.0,
        "loss": learner["loss"],
        "reverse_kl": learner.get("reverse_kl"),
        "grad_norm": learner["grad_norm"],
        "policy_version": learner["policy_version"],
        "staleness_tokens": staleness_tokens(learner["token_versions"], version),
        "inflight_swaps": inflight_swaps(outcome.trajectories),
        "off_policy_correction": off_policy_correction(config),
        "is_weight_mean": (
            learner["is_stats"]["weight_sum"] / learner["is_stats"]["tokens"]
            if learner["is_stats"]["tokens"]
            else None
        ),
        # Packed learners: backwards run over packs, and the trajectories they covered;
        # shared groups: the lockstep ticks that handed trajectories to the ranks.
        **{
            key: int(value)
            for key, value in (learner.get("counters") or {}).items()
            if key in ("pack_backwards", "packed_trajectories", "ticks")
        },
        "peak_memory_learner_bytes": learner["peak_memory_bytes"],
        "peak_memory_rollout_bytes": rollout_bytes,
        "devices": devices,
        # Collective publication: bytes broadcast to the engines (file: the file's size).
        **(
            {"publication_bytes": learner["publication_bytes"]}
            if "publication_bytes" in learner
            else {}
        ),
    }


def release_trace(outcome: StepOutcome) -> dict[str, Any]:
    """The step's release trace for ``thundersync perfmodel trace``: one queue per learner
    rank (a learner group reports each rank's sources), times relative to the step start."""
    start = outcome.timeline.start_s
    learner = outcome.learner
    per_rank = learner.get("rank_services") or [learner["services"]]
    publication = outcome.timeline.publication
    return {
        "step": outcome.step,
        "suffix_s": learner["barrier_s"] + (publication[1] - publication[0]),
        "rollout_start_s": 0.0,
        "ranks": [
            {
                "sources": [
                    {
                        "id": s["id"],
                        **({"group": s["group"]} if "group" in s else {}),
                        "release_s": max(s["release_s"] - start, 0.0),
                        "service_s": s["service_s"],
                    }
                    for s in services
                ]
            }
            for services in per_rank
        ],
        "measured_step_s": outcome.timeline.end_s - start,
    }


def _progress(record: dict[str, Any]) -> str:
    return (
        f"[step {record['step']}] {record['schedule']}/{record['objective']} "
        f"wall {record['step_wall_s']:.2f}s, learner idle {record['learner_idle_fraction']:.0%}, "
        f"tail {record['learner_tail_s']:.2f}s, unnamed {record['wall_overhead_fraction']:.0%}, "
        f"reward {record['reward_mean']:.3f}, "
        f"pass {record['pass_rate']:.0%}, loss {record['loss']:+.4f}, |g| {record['grad_norm']:.3f}"
        + (f", KL to teacher {kl:.4f}" if (kl := record.get("reverse_kl")) is not None else "")
    )


def steps_recorded(path: Path) -> int:
    """Complete step records in a run's metrics.jsonl."""
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def truncate_metrics(path: Path, start_step: int) -> None:
    """On resume, drop records of steps after the checkpoint (they are trained again)."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line and json.loads(line)["step"] < start_step
    ]
    path.write_text("".join(line + "\n" for line in kept))
