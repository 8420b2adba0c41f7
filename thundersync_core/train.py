"""The training stage: set up the roles, run a schedule's driver, record every step.

A run folder holds::

    config.yaml            the resolved config
    metrics.jsonl          one record per step (see ``recording.step_record``)
    batches/step-N.jsonl   the trajectories each step trained on
    traces/step-N.json     the release trace (for ``thundersync perfmodel trace``)
    checkpoints/step-N/    every ``checkpoint_every`` steps (HF weights, optimizer, RNG)
    roles.json             the process ids of the driver, each role and the engine core, and
                           the Ray node of the rollout worker, each engine and learner rank
    summary.json           dev pass rate before and after, status, totals, recoveries

Resume (``resume=True``) starts from the latest complete checkpoint: the learner restores
weights, optimizer and RNG, the engine loads the checkpoint's weights, and the data cursor
is the step number, so sync and thundersync runs continue exactly as if never stopped.
A role that dies mid-run (its process, or the engine in the rollout role) is a resume in
place: every role is restarted from the latest checkpoint and the schedule replays from
there, at most ``max_role_restarts`` times. A refused step (non-finite loss or reward, a
source from the wrong version) stops the run with the step and source named; nothing of
that step is written. SIGTERM stops the run after the step in progress, checkpointed.

The parts live beside it: ``pools`` (train/dev pools, each step's tasks),
``warmstart.cache`` (warm starts made once under a key), ``runtime.roles`` (the role
builders, shared with the bench, and role faults), ``recording`` (step records).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thundersync_core.batch import Trajectory
from thundersync_core.checkpoint import latest_checkpoint
from thundersync_core.config import TrainConfig, dump_config
from thundersync_core.pools import dev_tasks, load_pool, plan_step
from thundersync_core.recording import StepRecorder, steps_recorded, truncate_metrics
from thundersync_core.rollout.weights import publication_dir
from thundersync_core.runtime.roles import (
    first_line,
    named_roles,
    role_fault,
    start_roles,
    stop_roles,
)
from thundersync_core.runtime.rollout_worker import RolloutSpec
from thundersync_core.warmstart.cache import prepare_policies
from thundersync_core.warmstart.frontier import frontier_pool

#: Seconds between the engine watchdog's looks at the engine's processes.
ENGINE_WATCH_S = 1.0


class TrainingError(RuntimeError):
    """The run stopped: the message names the step and the cause."""


class Preempted(TrainingError):
    """SIGTERM arrived: the run stopped after the step in progress, with a checkpoint."""


def _raise_if_preempted(
    stop: threading.Event, steps_done: int, config: TrainConfig, out: Path, summary: dict
) -> None:
    if stop.is_set() and steps_done < config.steps:
        summary |= {"status": "preempted", "steps": steps_done}
        raise Preempted(
            f"SIGTERM: stopped after step {steps_done} of {config.steps}, checkpointed in "
            f"{out / 'checkpoints'}; rerun with --resume to finish"
        )


def _stop_on_sigterm(stop: threading.Event) -> Any:
    """Make SIGTERM set ``stop``; returns the previous handler (None off the main thread,
    where no handler can be installed and SIGTERM keeps its default)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def request_stop(signum: int, _frame: Any) -> None:
        print(f"[preempt] signal {signum}: finishing the step in progress", flush=True)
        stop.set()

    return signal.signal(signal.SIGTERM, request_stop)


# -- the run -------------------------------------------------------------------------------
def evaluate_pass_rate(
    rollout: Any, task_ids: Sequence[str], samples: int, *, version: int | None = None
) -> dict[str, Any]:
    """Pass rate of the engine's policy on ``task_ids`` (``samples`` each), once a queued
    publication is applied; with ``version`` given, the engine must hold that version.

    The trajectory ids, hence the sampling seeds, are the same at every evaluation, so two
    evaluations of a run differ only by the policy (common random numbers).
    """
    import ray  # noqa: PLC0415

    held = ray.get(rollout.settle.remote())
    if version is not None and held != version:
        raise TrainingError(
            f"dev evaluation: the engine holds policy version {held}, the learner {version}"
        )
    specs = [RolloutSpec(t, f"dev-{t}", f"dev-{t}/{i}") for t in task_ids for i in range(samples)]
    stream = rollout.rollout.options(num_returns="streaming").remote(specs)
    trajectories = [t for t in (ray.get(ref) for ref in stream) if isinstance(t, Trajectory)]
    per_task = dict.fromkeys(task_ids, 0)
    for t in trajectories:
        per_task[t.group_id.removeprefix("dev-")] += t.reward >= 1.0
    return {
        "policy_version": held,
        "pass_rate": sum(per_task.values()) / len(trajectories) if trajectories else 0.0,
        "reward_mean": sum(t.reward for t in trajectories) / max(len(trajectories), 1),
        "tasks": len(task_ids),
        "samples": samples,
        # Samples solved per task: two evaluations of a run pair up task by task.
        "solved": per_task,
    }


def _dev_and_summary(config: TrainConfig) -> tuple[list[str], dict[str, Any]]:
    """The dev task ids a run measures, and the head of its summary."""
    dev_ids, left_out = dev_tasks(
        config.tasks.prep_dir,
        config.tasks.families,
        config.tasks.dev_tasks,
        config.tasks.dev_exclude,
    )
    if left_out:
        print(
            f"[dev] left out {left_out} dev tasks that repeat a tasks.dev_exclude instruction",
            flush=True,
        )
    summary: dict[str, Any] = {
        "run": config.name,
        "schedule": config.schedule,
        "objective": config.objective,
        **({"dev_left_out": left_out} if left_out else {}),
    }
    return dev_ids, summary


def dev_before_key(config: TrainConfig, policy_dir: Path, dev_ids: Sequence[str]) -> str:
    """What the pass rate before training depends on: the starting weights, the sampling
    seed, the rollout settings and the dev tasks and samples (not the schedule)."""
    import hashlib  # noqa: PLC0415

    facts = {
        "policy": str(Path(policy_dir).resolve()),
        "seed": config.seed,
        "rollout": config.rollout.model_dump(mode="json"),
        "dev": list(dev_ids),
        "samples": config.tasks.dev_samples,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def shared_dev_before(path: Path, key: str) -> dict[str, Any]:
    """The ``dev_before`` of the run whose summary is ``path``, if it measured the same
    thing (``key``); a clear error otherwise."""
    where = f"tasks.dev_before_from: {path}"
    try:
        earlier = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: not a readable summary.json ({exc})") from exc
    before = earlier.get("dev_before")
    if not isinstance(before, dict):
        raise ValueError(f"{where}: has no dev_before")
    if before.get("key") != key:
        raise ValueError(
            f"{where}: measured other starting weights, seed, rollout settings or dev tasks "
            f"(key {before.get('key')}, this run's {key})"
        )
    return before | {"shared_from": str(path)}


def _dev_before_source(
    config: TrainConfig, policy_dir: Path, dev_ids: Sequence[str], *, resumed: bool
) -> tuple[str, dict[str, Any] | None]:
    """This run's dev-before key, and the shared measurement if the config names one."""
    key = dev_before_key(config, policy_dir, dev_ids)
    source = config.tasks.dev_before_from
    if source is None or not dev_ids or resumed:
        return key, None
    return key, shared_dev_before(source, key)


def _earlier_dev_before(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        earlier = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}
    return {"dev_before": earlier["dev_before"]} if "dev_before" in earlier else {}


def train(
    config: TrainConfig,
    out: Path,
    *,
    resume: bool = False,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the training stage into ``out``; returns the summary (also ``summary.json``)."""
    import ray  # noqa: PLC0415

    from thundersync_core.runtime.placement import start_ray  # noqa: PLC0415

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = latest_checkpoint(out / "checkpoints") if resume else None
    if not resume and (out / "metrics.jsonl").exists():
        raise FileExistsError(f"--out {out}: holds a run already (use --resume, or a new folder)")
    (out / "config.yaml").write_text(dump_config(config))
    train_pool = load_pool(config.tasks.prep_dir, "train", config.tasks.families)
    dev_pool = load_pool(config.tasks.prep_dir, "dev", config.tasks.families)
    policy_dir, teacher_dir, train_pool = _starting_policies(config, out, train_pool)
    dev_ids, summary = _dev_and_summary(config)
    dev_key, shared = _dev_before_source(config, policy_dir, dev_ids, resumed=bool(checkpoint))
    start_ray(config.resources)
    crew = _Crew(
        config,
        out,
        publish_dir=publication_dir(out.resolve().name),
        policy_dir=policy_dir,
        teacher_dir=teacher_dir,
        pool=train_pool | dev_pool,
    )
    try:
        start_step, state = crew.start(checkpoint)
    except BaseException:
        shutil.rmtree(crew.publish_dir, ignore_errors=True)
        raise
    if checkpoint is not None:
        # A resumed run keeps what the first attempt measured before training.
        summary |= _earlier_dev_before(out / "summary.json")
    stop = threading.Event()
    previous = _stop_on_sigterm(stop)
    try:
        if dev_ids and checkpoint is None:
            summary["dev_before"] = shared or evaluate_pass_rate(
                crew.roles.rollout, dev_ids, config.tasks.dev_samples
            ) | {"key": dev_key}
            print(f"[dev before] {json.dumps(summary['dev_before'])}", flush=True)
        steps = _train_steps(
            crew, train_pool, start_step, state, on_step=on_step, stop=stop, summary=summary
        )
        _raise_if_preempted(stop, steps, config, out, summary)
        if dev_ids:
            summary["dev_after"] = evaluate_pass_rate(
                crew.roles.rollout,
                dev_ids,
                config.tasks.dev_samples,
                version=ray.get(crew.roles.learner.version.remote()),
            )
            print(f"[dev after] {json.dumps(summary['dev_after'])}", flush=True)
        summary |= {"status": "finished", "steps": steps}
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        # A refused step or a bug: a retry from the checkpoint would meet it again.
        error = str(cause).strip().splitlines()[-1]
        summary |= {"status": "failed", "retryable": False, "error": error}
        raise TrainingError(summary["error"]) from None
    except ray.exceptions.RayActorError as exc:
        error = f"a role died: {first_line(exc)}"
        summary |= {"status": "failed", "retryable": True, "error": error}
        raise TrainingError(summary["error"]) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        crew.close(summary)
    return summary


def _starting_policies(
    config: TrainConfig, out: Path, train_pool: dict[str, Path]
) -> tuple[Path, Path | None, dict[str, Path]]:
    """(policy, OPD teacher or None, the train pool cut to ``tasks.frontier`` under that
    policy)."""
    policy_dir, teacher_dir = prepare_policies(config, out, list(train_pool.values()))
    return policy_dir, teacher_dir, frontier_pool(config, policy_dir, train_pool, out)


@dataclass
class _Crew:
    """The run's roles, and how to start them again from the latest checkpoint."""

    config: TrainConfig
    out: Path
    publish_dir: Path
    policy_dir: Path
    teacher_dir: Path | None
    pool: dict[str, Path]
    roles: Any = None
    #: One record per restart after a fault (summary.json ``recoveries``).
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    #: What the engine watchdog saw (it then stopped the rollout role); None if nothing.
    engine_fault: str | None = None
    _watch_stop: threading.Event = field(default_factory=threading.Event)

    def start(self, checkpoint: Path | None) -> tuple[int, dict[str, Any]]:
        """Start every role (from ``checkpoint`` if given); (first step, checkpoint state)."""
        self.roles, step, state = start_roles(
            self.config,
            publish_dir=self.publish_dir,
            policy_dir=self.policy_dir,
            teacher_dir=self.teacher_dir,
            pool=self.pool,
            checkpoint=checkpoint,
        )
        self._write_pids()
        self._watch_engine()
        return step, state

    def _watch_engine(self) -> None:
        """Watch the engine's processes from outside the rollout role: a generation call in
        flight when vLLM's engine core dies may block for good, so once one is gone the
        rollout role is stopped, which the schedule sees as a role fault."""
        import ray  # noqa: PLC0415

        self.engine_fault, self._watch_stop = None, threading.Event()
        rollout, stop = self.roles.rollout, self._watch_stop

        def watch() -> None:
            while not stop.wait(ENGINE_WATCH_S):
                try:
                    dead = ray.get(rollout.dead_engine_processes.remote(), timeout=60)
                except Exception:
                    return
                if dead and not stop.is_set():
                    self.engine_fault = (
                        f"the vLLM engine core process died (pid {dead[0]}, seen by the "
                        "engine watchdog)"
                    )
                    ray.kill(rollout)
                    return

        if ray.get(rollout.engine_pids.remote()):
            threading.Thread(target=watch, name="engine-watchdog", daemon=True).start()

    def recover(self, fault: str, summary: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Restart every role from the latest checkpoint after ``fault``; the schedule then
        replays from that step. Past ``max_role_restarts`` the run stops naming the fault."""
        steps_done = steps_recorded(self.out / "metrics.jsonl")
        checkpoint = latest_checkpoint(self.out / "checkpoints")
        if len(self.recoveries) >= self.config.max_role_restarts:
            summary |= {
                "status": "failed",
                "retryable": True,
                "error": f"step {steps_done}: {fault}; max_role_restarts "
                f"({self.config.max_role_restarts}) used, latest checkpoint {checkpoint}",
            }
            raise TrainingError(summary["error"])
        t0 = time.time()
        self.stop()
        print(
            f"[recover] step {steps_done}: {fault}; restarting the roles from "
            f"{checkpoint or 'the start'}",
            flush=True,
        )
        step, state = self.start(checkpoint)
        self.recoveries.append(
            {
                "fault": fault,
                "step": steps_done,
                "resumed_from_step": step,
                "completed_steps_redone": steps_done - step,
                "restart_s": round(time.time() - t0, 3),
            }
        )
        self._write_pids()
        return step, state

    def close(self, summary: dict[str, Any]) -> None:
        """The run's end, however it ended: summary.json written, roles and weight files gone."""
        from thundersync_core.runtime.placement import device_count  # noqa: PLC0415

        if self.recoveries:
            summary["recoveries"] = self.recoveries
        summary["devices"] = device_count(self.config.resources)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.stop()
        shutil.rmtree(self.publish_dir, ignore_errors=True)

    def stop(self) -> None:
        """Close the rollout role's sandboxes if it still answers, then kill every role and
        give their placement groups back."""
        import ray  # noqa: PLC0415

        self._watch_stop.set()
        with contextlib.suppress(Exception):  # best effort: the role is killed next anyway
            ray.get(self.roles.rollout.close.remote(), timeout=30)
        stop_roles(self.roles)

    def _write_pids(self) -> None:
        """``roles.json``: the driver's and each role's process ids (and the engine core's)."""
        import ray  # noqa: PLC0415

        pids: dict[str, Any] = {"driver": os.getpid(), "restarts": len(self.recoveries)}
        for name, actor in named_roles(self.roles):
            pids[name] = ray.get(actor.pid.remote())
        pids["engine"] = ray.get(self.roles.rollout.engine_pids.remote())
        # Where they run: the Ray node of the rollout worker, each engine and each learner rank.
        pids["nodes"] = ray.get(self.roles.rollout.node_ids.remote()) | {
            "learner": ray.get(self.roles.learner.node_ids.remote())
        }
        (self.out / "roles.json").write_text(json.dumps(pids, indent=2) + "\n")


def _train_steps(
    crew: _Crew,
    train_pool: dict[str, Path],
    start_step: int,
    state: dict[str, Any],
    *,
    on_step: Callable[[dict[str, Any]], None] | None,
    stop: threading.Event,
    summary: dict[str, Any],
) -> int:
    """Run the schedule to the end (or a stop), restarting the roles after a role fault;
    returns the number of steps done."""
    while True:
        try:
            recorder = _run_schedule(
                crew.config,
                crew.out,
                roles=crew.roles,
                train_pool=train_pool,
                start_step=start_step,
                state=state,
                on_step=on_step,
                stop=stop,
            )
        except Exception as exc:
            fault = role_fault(exc, crew.roles, crew.engine_fault)
            if fault is None:
                raise
            start_step, state = crew.recover(fault, summary)
        else:
            return start_step + len(recorder.records)


def _run_schedule(
    config: TrainConfig,
    out: Path,
    *,
    roles: Any,
    train_pool: dict[str, Path],
    start_step: int,
    state: dict[str, Any],
    on_step: Callable[[dict[str, Any]], None] | None,
    stop: threading.Event,
) -> StepRecorder:

    from thundersync_core.runtime.placement import device_count  # noqa: PLC0415
    from thundersync_core.schedules import DRIVERS, RunContext  # noqa: PLC0415
    from thundersync_core.schedules.base import group_lookup  # noqa: PLC0415

    task_ids = list(train_pool)
    groups = group_lookup(roles.rollout, with_members=config.learner_chunks > 1)

    if start_step == 0:
        (out / "metrics.jsonl").unlink(missing_ok=True)
    else:
        truncate_metrics(out / "metrics.jsonl", start_step)
    recorder = StepRecorder(
        config=config,
        out=out,
        devices=device_count(config.resources),
        learner=roles.learner,
        rollout=roles.rollout,
        wall_offset_s=float(state.get("extra", {}).get("wall_s", 0.0)),
        started_s=time.time(),
        on_step=on_step,
        stop=stop,
    )
    ctx = RunContext(
        config, roles, lambda step: plan_step(config, task_ids, step), groups, recorder
    )
    DRIVERS[config.schedule](ctx, start_step, config.steps)
    return recorder
