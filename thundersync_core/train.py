"""The training stage: set up the roles, run a schedule's driver, record every step.

A run folder holds::

    config.yaml            the resolved config
    metrics.jsonl          one record per step (see ``step_record``)
    batches/step-N.jsonl   the trajectories each step trained on
    traces/step-N.json     the release trace (for ``thundersync perfmodel trace``)
    checkpoints/step-N/    every ``checkpoint_every`` steps (HF weights, optimizer, RNG)
    summary.json           dev pass rate before and after, status, totals

Resume (``resume=True``) starts from the latest complete checkpoint: the learner restores
weights, optimizer and RNG, the engine loads the checkpoint's weights, and the data cursor
is the step number, so sync and thundersync runs continue exactly as if never stopped.
A refused step (non-finite loss or reward, a source from the wrong version) stops the run
with the step and source named; nothing of that step is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thundersync_core.batch import Trajectory, trajectory_to_json
from thundersync_core.checkpoint import due, latest_checkpoint
from thundersync_core.config import TrainConfig, dump_config
from thundersync_core.metrics import staleness_tokens
from thundersync_core.rollout.weights import process_alive, publication_dir
from thundersync_core.runtime.rollout_worker import RolloutSpec
from thundersync_core.schedules.base import StepOutcome


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


# -- data ----------------------------------------------------------------------------------
def _split_table(prep_dir: Path, split: str) -> Path:
    path = Path(prep_dir) / "terminal" / f"{split}.parquet"
    if not path.is_file():
        raise FileNotFoundError(
            f"tasks.prep_dir: {path} is missing (run `thundersync prep` or `make prep` first)"
        )
    return path


def load_pool(prep_dir: Path, split: str, families: Sequence[str] = ()) -> dict[str, Path]:
    """task id -> task folder for one split of the prepared terminal pool."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    path = _split_table(prep_dir, split)
    rows = pq.read_table(path, columns=["task_id", "family", "path"]).to_pylist()
    # Task folders are stored relative to the prep folder.
    pool = {
        r["task_id"]: (Path(prep_dir) / r["path"]).resolve()
        for r in rows
        if not families or r["family"] in families
    }
    if not pool and split == "train":
        raise ValueError(f"tasks.families: no {split} task in {path} is of families {families}")
    return dict(sorted(pool.items()))


def dev_tasks(
    prep_dir: Path, families: Sequence[str], n: int, exclude: Sequence[Path] = ()
) -> tuple[list[str], int]:
    """(up to ``n`` dev task ids, how many dev tasks ``exclude`` left out).

    The ids take the families in turn (each family's tasks in id order), so a subset covers
    every family. ``exclude`` holds task sources as ``thundersync warm-start --tasks`` takes
    them; a dev task whose instruction repeats one of theirs is left out.
    """
    import pyarrow.parquet as pq  # noqa: PLC0415

    path = _split_table(prep_dir, "dev")
    if n == 0:
        return [], 0
    columns = ["task_id", "family", *(["instruction"] if exclude else [])]
    rows = pq.read_table(path, columns=columns).to_pylist()
    seen = {_normalise(text) for source in exclude for text in _instructions(Path(source))}
    by_family: dict[str, list[str]] = {}
    left_out = 0
    for r in sorted(rows, key=lambda r: r["task_id"]):
        if families and r["family"] not in families:
            continue
        if seen and _normalise(r["instruction"]) in seen:
            left_out += 1
            continue
        by_family.setdefault(r["family"], []).append(r["task_id"])
    lists = [by_family[f] for f in sorted(by_family)]
    order = [
        ids[i] for i in range(max(map(len, lists), default=0)) for ids in lists if i < len(ids)
    ]
    return order[:n], left_out


def _normalise(text: str) -> str:
    # As data_prep.filters.normalise_instruction: case and runs of white space do not count.
    return " ".join(text.lower().split())


def _instructions(source: Path) -> list[str]:
    """The instructions of one warm-start task source (a task folder, a folder of them, or a
    prep ``terminal/*.parquet``)."""
    from thundersync_core.warmstart.tasks import collect_tasks  # noqa: PLC0415

    if not source.exists():
        raise FileNotFoundError(f"tasks.dev_exclude: {source} is neither a task table nor a folder")
    try:
        return [task.instruction for task in collect_tasks([source])]
    except (ValueError, OSError) as exc:
        raise ValueError(
            f"tasks.dev_exclude: {source} is not a task table or task folder ({exc})"
        ) from exc


def plan_step(config: TrainConfig, task_ids: Sequence[str], step: int) -> list[RolloutSpec]:
    """The step's groups: a seeded pass over the pool per epoch; the cursor is the step."""
    per_epoch = max(len(task_ids) // config.groups_per_step, 1)
    epoch, slot = divmod(step, per_epoch)
    order = random.Random(config.seed * 100_003 + epoch).sample(list(task_ids), len(task_ids))
    chosen = [
        order[(slot * config.groups_per_step + g) % len(order)]
        for g in range(config.groups_per_step)
    ]
    return [
        RolloutSpec(task, f"s{step:05d}-g{g}-{task}", f"s{step:05d}-g{g}-{task}/{i}", batch=step)
        for g, task in enumerate(chosen)
        for i in range(config.group_size)
    ]


# -- policies ------------------------------------------------------------------------------
def prepare_policies(
    config: TrainConfig, out: Path, train_roots: Sequence[Path]
) -> tuple[Path, Path | None]:
    """(policy folder, teacher folder or None): given, or warm-started once per run folder.

    The warm start sees ``train_roots`` and, with ``tasks.warm_start_pool``, the prep run's
    warm-start-only tasks (generated apart from every train, dev and evaluation task).
    """
    extra = Path(config.tasks.prep_dir) / "terminal" / "warmstart.parquet"
    if config.tasks.warm_start_pool and extra.is_file():
        train_roots = [*train_roots, extra]
    policy = config.policy.path or _warm(
        config, out / "warmstart" / "policy", train_roots, config.warm_start.steps
    )
    if config.objective != "opd":
        return Path(policy), None
    from_policy = config.warm_start.teacher_init == "policy"
    teacher = config.policy.teacher_path or _warm(
        config,
        out / "warmstart" / "teacher",
        train_roots,
        config.warm_start.teacher_steps,
        init_from=Path(policy) if from_policy else None,
    )
    return Path(policy), Path(teacher)


def _warm(
    config: TrainConfig,
    target: Path,
    roots: Sequence[Path],
    steps: int,
    init_from: Path | None = None,
) -> Path:
    if config.warm_start.cache_dir is not None:
        key = warm_start_key(config, roots, steps, init_from)
        target = Path(config.warm_start.cache_dir) / f"{target.name}-{key[:16]}"
    if (target / "config.json").is_file():
        if config.warm_start.cache_dir is not None:
            print(f"[warm start] reusing {target}", flush=True)
        return target
    # Written beside the target and renamed into place: a folder at the target is complete.
    _remove_abandoned_scratch(target)
    scratch = target.with_name(f"{_scratch_prefix(target)}{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    if not config.warm_start.enabled:
        from thundersync_core.policy import build_model, build_tokenizer, save_policy  # noqa: PLC0415

        model = build_model(config.policy.preset, seed=config.seed)
        save_policy(model, build_tokenizer(vocab_size=model.config.vocab_size), scratch)
    else:
        from thundersync_core.warmstart import warm_start  # noqa: PLC0415
        from thundersync_core.warmstart.sft import SUMMARY_FILE  # noqa: PLC0415

        summary = warm_start(
            list(roots),
            scratch,
            preset=config.policy.preset,
            steps=steps,
            lr=config.warm_start.lr,
            seed=config.seed,
            families=config.tasks.families or None,
            init_from=init_from,
        )
        summary["out_dir"] = str(target)
        (scratch / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"[warm start] {json.dumps(summary)}", flush=True)
    if target.exists() and not (target / "config.json").is_file():
        shutil.rmtree(target)  # incomplete: written in place by an older version, then stopped
    try:
        scratch.rename(target)
    except OSError:
        # Another run with the same key finished first: its folder is the same warm start.
        if not (target / "config.json").is_file():
            raise
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def warm_start_key(
    config: TrainConfig, roots: Sequence[Path], steps: int, init_from: Path | None = None
) -> str:
    """sha256 over what a warm start depends on: its settings, the starting weights (a
    preset, or the files of ``init_from``), every file of every task it trains on, and the
    warm-start, policy and agent code."""
    from thundersync_core.warmstart.tasks import collect_tasks  # noqa: PLC0415

    families = config.tasks.families or None
    settings = {
        "enabled": config.warm_start.enabled,
        "preset": config.policy.preset if init_from is None else None,
        "steps": steps,
        "lr": config.warm_start.lr,
        "seed": config.seed,
        "families": sorted(families or []),
    }
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    if init_from is not None:
        _digest_files(digest, Path(init_from), "init_from")
    if config.warm_start.enabled:
        for task in collect_tasks(list(roots), families=families):
            _digest_files(digest, task.root, task.task_id)
    package = Path(__file__).resolve().parent
    for code in ("warmstart", "policy", "rollout"):
        _digest_files(digest, package / code, code, pattern="*.py")
    return digest.hexdigest()


def _scratch_prefix(target: Path) -> str:
    # The host is in the name: a cache on a shared file system sees other hosts' pids.
    return f".{target.name}.partial-{socket.gethostname()}-"


def _remove_abandoned_scratch(target: Path) -> None:
    """Removes this host's scratch folders of warm starts into ``target`` whose process is
    gone (killed mid-way); a live process's scratch, or another host's, is left alone."""
    prefix = _scratch_prefix(target)
    for scratch in target.parent.glob(f"{prefix}*"):
        pid = scratch.name[len(prefix) :]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(scratch, ignore_errors=True)


def _digest_files(digest: Any, root: Path, label: str, pattern: str = "*") -> None:
    for path in sorted(p for p in root.rglob(pattern) if p.is_file()):
        digest.update(f"{label}/{path.relative_to(root).as_posix()}".encode())
        digest.update(path.read_bytes())


# -- the run -------------------------------------------------------------------------------
@dataclass
class _Recorder:
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


def step_record(
    config: TrainConfig, outcome: StepOutcome, devices: int, rollout_bytes: int
) -> dict[str, Any]:
    """The metrics record of one step (what orchestration logs, keyed by step)."""
    learner = outcome.learner
    summary = outcome.timeline.summary()
    rewards = [t.reward for t in outcome.trajectories]
    generated = sum(
        len(s.ids) for t in outcome.trajectories for s in t.segments if s.kind == "action"
    )
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
        "is_weight_mean": (
            learner["is_stats"]["weight_sum"] / learner["is_stats"]["tokens"]
            if learner["is_stats"]["tokens"]
            else None
        ),
        "peak_memory_learner_bytes": learner["peak_memory_bytes"],
        "peak_memory_rollout_bytes": rollout_bytes,
        "devices": devices,
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
        f"tail {record['learner_tail_s']:.2f}s, reward {record['reward_mean']:.3f}, "
        f"pass {record['pass_rate']:.0%}, loss {record['loss']:+.4f}, |g| {record['grad_norm']:.3f}"
        + (f", KL to teacher {kl:.4f}" if (kl := record.get("reverse_kl")) is not None else "")
    )


def evaluate_pass_rate(rollout: Any, task_ids: Sequence[str], samples: int) -> dict[str, Any]:
    """Pass rate of the engine's current policy on ``task_ids`` (``samples`` each).

    The trajectory ids, hence the sampling seeds, are the same at every evaluation, so two
    evaluations of a run differ only by the policy (common random numbers).
    """
    import ray  # noqa: PLC0415

    specs = [RolloutSpec(t, f"dev-{t}", f"dev-{t}/{i}") for t in task_ids for i in range(samples)]
    stream = rollout.rollout.options(num_returns="streaming").remote(specs)
    trajectories = [t for t in (ray.get(ref) for ref in stream) if isinstance(t, Trajectory)]
    per_task = dict.fromkeys(task_ids, 0)
    for t in trajectories:
        per_task[t.group_id.removeprefix("dev-")] += t.reward >= 1.0
    return {
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
    policy_dir, teacher_dir = prepare_policies(config, out, list(train_pool.values()))
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
    dev_ids, summary = _dev_and_summary(config)
    if checkpoint is not None:
        # A resumed run keeps what the first attempt measured before training.
        summary |= _earlier_dev_before(out / "summary.json")
    stop = threading.Event()
    previous = _stop_on_sigterm(stop)
    try:
        if dev_ids and checkpoint is None:
            summary["dev_before"] = evaluate_pass_rate(
                crew.roles.rollout, dev_ids, config.tasks.dev_samples
            )
            print(f"[dev before] {json.dumps(summary['dev_before'])}", flush=True)
        steps = _train_steps(
            crew, train_pool, start_step, state, on_step=on_step, stop=stop, summary=summary
        )
        _raise_if_preempted(stop, steps, config, out, summary)
        if dev_ids:
            summary["dev_after"] = evaluate_pass_rate(
                crew.roles.rollout, dev_ids, config.tasks.dev_samples
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
        error = f"a role died: {_first_line(exc)}"
        summary |= {"status": "failed", "retryable": True, "error": error}
        raise TrainingError(summary["error"]) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        crew.close(summary)
    return summary


# -- faults --------------------------------------------------------------------------------
def role_fault(exc: BaseException, roles: Any) -> str | None:
    """What died, when ``exc`` says a role's process (or the engine inside the rollout
    role) is gone; None for any other error (a refused step, a bug: not retried)."""
    import ray  # noqa: PLC0415

    from thundersync_core.rollout.engine import EngineFailed  # noqa: PLC0415

    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
    if isinstance(cause, EngineFailed) or isinstance(exc, EngineFailed):
        return f"rollout engine failed: {_first_line(cause)}"
    if not isinstance(cause, ray.exceptions.RayActorError):
        return None
    dead = [name for name, actor in _named_roles(roles) if not _answers(actor)]
    which = " and ".join(dead) if dead else "a"
    return f"the {which} role's process died ({_first_line(cause)})"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _named_roles(roles: Any) -> list[tuple[str, Any]]:
    named = [("rollout", roles.rollout), ("learner", roles.learner), ("teacher", roles.teacher)]
    return [(name, actor) for name, actor in named if actor is not None]


def _answers(actor: Any, timeout_s: float = 10.0) -> bool:
    import ray  # noqa: PLC0415

    try:
        ray.get(actor.pid.remote(), timeout=timeout_s)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
    return True


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

    def start(self, checkpoint: Path | None) -> tuple[int, dict[str, Any]]:
        """Start every role (from ``checkpoint`` if given); (first step, checkpoint state)."""
        self.roles, step, state = _start_roles(
            self.config,
            publish_dir=self.publish_dir,
            policy_dir=self.policy_dir,
            teacher_dir=self.teacher_dir,
            pool=self.pool,
            checkpoint=checkpoint,
        )
        self._write_pids()
        return step, state

    def recover(self, fault: str, summary: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Restart every role from the latest checkpoint after ``fault``; the schedule then
        replays from that step. Past ``max_role_restarts`` the run stops naming the fault."""
        steps_done = _steps_recorded(self.out / "metrics.jsonl")
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
        """Close the rollout role's sandboxes if it still answers, then kill every role."""
        import ray  # noqa: PLC0415

        with contextlib.suppress(Exception):  # best effort: the role is killed next anyway
            ray.get(self.roles.rollout.close.remote(), timeout=30)
        for _name, actor in _named_roles(self.roles):
            ray.kill(actor)

    def _write_pids(self) -> None:
        """``roles.json``: the driver's and each role's process ids (and the engine core's)."""
        import ray  # noqa: PLC0415

        pids: dict[str, Any] = {"driver": os.getpid(), "restarts": len(self.recoveries)}
        for name, actor in _named_roles(self.roles):
            pids[name] = ray.get(actor.pid.remote())
        pids["engine"] = ray.get(self.roles.rollout.engine_pids.remote())
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
            fault = role_fault(exc, crew.roles)
            if fault is None:
                raise
            start_step, state = crew.recover(fault, summary)
        else:
            return start_step + len(recorder.records)


def _steps_recorded(path: Path) -> int:
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def _start_roles(
    config: TrainConfig,
    *,
    publish_dir: Path,
    policy_dir: Path,
    teacher_dir: Path | None,
    pool: dict[str, Path],
    checkpoint: Path | None,
) -> tuple[Any, int, dict[str, Any]]:
    from thundersync_core.runtime.learner_worker import LearnerWorker  # noqa: PLC0415
    from thundersync_core.runtime.placement import remote_role  # noqa: PLC0415
    from thundersync_core.runtime.rollout_worker import RolloutWorker  # noqa: PLC0415
    from thundersync_core.runtime.teacher_worker import TeacherWorker  # noqa: PLC0415
    from thundersync_core.schedules.base import Roles  # noqa: PLC0415

    res = config.resources
    state: dict[str, Any] = {"step": 0, "policy_version": 0, "extra": {}}
    if checkpoint is not None:
        state = json.loads((checkpoint / "state.json").read_text())
        print(f"[resume] from {checkpoint} (step {state['step']})", flush=True)
    engine_dir = checkpoint / "model" if checkpoint is not None else policy_dir
    if res.learner.ranks > 1:
        from thundersync_core.runtime.learner_group import LearnerGroup  # noqa: PLC0415

        # The facade only routes sources; the ranks it starts hold the learner's resources.
        learner = remote_role(
            LearnerGroup, res.learner.model_copy(update={"num_cpus": 0.0, "num_gpus": 0.0})
        ).remote(policy_dir, config, publish_dir=publish_dir, resume_from=checkpoint)
    else:
        learner = remote_role(LearnerWorker, res.learner).remote(
            policy_dir, config, publish_dir=publish_dir, resume_from=checkpoint
        )
    rollout = remote_role(RolloutWorker, res.rollout, max_concurrency=2).remote(
        engine_dir,
        pool,
        config.rollout,
        cores=res.rollout.cores,
        seed=config.seed,
        policy_version=int(state["policy_version"]),
    )
    teacher = None
    if teacher_dir is not None:
        teacher = remote_role(TeacherWorker, res.teacher).remote(
            teacher_dir, cores=res.teacher.cores, top_k=config.opd_teacher_top_k
        )
    import ray  # noqa: PLC0415

    # Wait for every role to be up, so step 0 measures training and not start-up.
    ray.get(
        [a.version.remote() for a in (rollout, learner)]
        + ([teacher.ready.remote()] if teacher else [])
    )
    return Roles(rollout, learner, teacher), int(state["step"]), state


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
) -> _Recorder:

    from thundersync_core.runtime.placement import device_count  # noqa: PLC0415
    from thundersync_core.schedules import DRIVERS, RunContext  # noqa: PLC0415
    from thundersync_core.schedules.base import group_lookup  # noqa: PLC0415

    task_ids = list(train_pool)
    groups = group_lookup(roles.rollout)

    if start_step == 0:
        (out / "metrics.jsonl").unlink(missing_ok=True)
    else:
        _truncate_metrics(out / "metrics.jsonl", start_step)
    recorder = _Recorder(
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


def _truncate_metrics(path: Path, start_step: int) -> None:
    """On resume, drop records of steps after the checkpoint (they are trained again)."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line and json.loads(line)["step"] < start_step
    ]
    path.write_text("".join(line + "\n" for line in kept))
