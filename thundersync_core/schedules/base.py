"""What every schedule driver shares: the run context, event streams, sources, outcomes.

A driver decides only *when* things happen: when a batch's rollouts start, when a source is
handed to the learner, when weights are published. The roles (runtime/) do the work; the
training loop (train.py) turns each ``StepOutcome`` into a metrics record and checkpoints.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from thundersync_core.batch import Trajectory
from thundersync_core.config import TrainConfig
from thundersync_core.metrics import StepTimeline, episode_intervals, rollout_intervals
from thundersync_core.rollout.agent import TurnReady
from thundersync_core.runtime.rollout_worker import RolloutSpec


@dataclass
class Roles:
    rollout: Any  # RolloutWorker actor handle
    learner: Any  # LearnerWorker actor handle
    teacher: Any | None = None  # TeacherWorker actor handle (OPD)
    #: The roles' placement groups (``runtime/placement.py``), given back with the roles.
    reservations: list[Any] = field(default_factory=list)


@dataclass
class StepOutcome:
    step: int
    timeline: StepTimeline
    learner: dict[str, Any]
    trajectories: list[Trajectory] = field(default_factory=list)


@dataclass
class RunContext:
    config: TrainConfig
    roles: Roles
    #: The rollout specs of a step (the data cursor is the step number).
    plan: Callable[[int], list[RolloutSpec]]
    #: group id -> (prompt ids, size) for a step's specs.
    groups: Callable[[Sequence[RolloutSpec]], dict[str, tuple[tuple[int, ...], int]]]
    #: Called once per finished step, in step order; returns False to stop the run.
    on_step: Callable[[StepOutcome], bool]

    @property
    def opd(self) -> bool:
        return self.config.objective == "opd"


def group_lookup(
    rollout: Any, *, with_members: bool = False
) -> Callable[[Sequence[RolloutSpec]], dict[str, tuple[Any, ...]]]:
    """group id -> (prompt ids, size) for a step's specs, and with ``with_members`` the
    group's sorted trajectory ids third (``learner_chunks`` plans by them); prompts asked of
    the rollout worker once per task (they are what its agent sends the engine)."""
    import ray  # noqa: PLC0415

    prompts: dict[str, tuple[int, ...]] = {}

    def groups(specs: Sequence[RolloutSpec]) -> dict[str, tuple[Any, ...]]:
        found: dict[str, tuple[tuple[int, ...], int]] = {}
        members: dict[str, list[str]] = {}
        for spec in specs:
            if spec.task_id not in prompts:
                prompts[spec.task_id] = ray.get(rollout.prompt_ids.remote(spec.task_id))
            prompt, size = found.get(spec.group_id, (prompts[spec.task_id], 0))
            found[spec.group_id] = (prompt, size + 1)
            members.setdefault(spec.group_id, []).append(spec.trajectory_id)
        if not with_members:
            return dict(found)
        return {g: (*spec, tuple(sorted(members[g]))) for g, spec in found.items()}

    return groups


def events(
    ctx: RunContext, specs: list[RolloutSpec], **options: Any
) -> Iterator[Trajectory | TurnReady]:
    """The rollout worker's events for ``specs``, in the order they happen.

    At most ``rollout.max_live_episodes`` episodes run at once unless ``max_live`` is given.
    """
    import ray  # noqa: PLC0415

    if "max_live" not in options and ctx.config.rollout.max_live_episodes:
        options["max_live"] = ctx.config.rollout.max_live_episodes

    stream = ctx.roles.rollout.rollout.options(num_returns="streaming").remote(specs, **options)
    for ref in stream:
        yield ray.get(ref)


def reward_time(traj: Trajectory) -> float:
    """When the trajectory's reward landed (its release as a GRPO source)."""
    for event in reversed((traj.metadata or {}).get("events") or []):
        if event["event"] == "reward":
            return float(event["time"])
    return time.time()


def submit_whole(ctx: RunContext, traj: Trajectory) -> None:
    """Hand a finished trajectory to the learner (OPD: scored whole by the teacher first)."""
    if ctx.opd:
        assert ctx.roles.teacher is not None, "OPD runs have a teacher role"
        scored = ctx.roles.teacher.score_trajectory.remote(traj)
        ctx.roles.learner.submit_scored.remote(scored)
    else:
        ctx.roles.learner.submit.remote(traj, reward_time(traj))


def submit_batch(ctx: RunContext, batch: list[Trajectory]) -> None:
    """Hand a finished batch to the learner in trajectory-id order (not grading order, so
    its float sums are reproducible); with packs all at once, each group as its packs."""
    batch.sort(key=lambda t: t.trajectory_id)
    if ctx.config.packs:
        ctx.roles.learner.submit_many.remote([(t, reward_time(t)) for t in batch])
        return
    for traj in batch:
        submit_whole(ctx, traj)


class LearnerMailbox:
    """Trajectories for a learner that runs packs (``learner_pack_tokens``): each time it
    finishes one, everything that landed meanwhile goes over as the next. Work-conserving:
    a trajectory waits only while the learner is working. ``drain`` returns once the learner
    holds every trajectory put (call it before the step)."""

    def __init__(self, learner: Any) -> None:
        self._learner = learner
        self._lock = threading.Lock()
        self._pending: list[tuple[Trajectory, float]] = []
        self._busy = False
        self._idle = threading.Event()
        self._idle.set()

    def put(self, traj: Trajectory, release_s: float) -> None:
        with self._lock:
            self._pending.append((traj, release_s))
            if self._busy:
                return
            self._busy = True
            self._idle.clear()
            batch, self._pending = self._pending, []
        threading.Thread(target=self._deliver, args=(batch,), daemon=True).start()

    def _deliver(self, batch: list[tuple[Trajectory, float]]) -> None:
        import ray  # noqa: PLC0415

        while True:
            # A refusal is kept by the learner for its step, and a dead learner fails the
            # step too: either surfaces there, with its cause.
            with contextlib.suppress(Exception):
                ray.get(self._learner.submit_many.remote(batch))
            with self._lock:
                if not self._pending:
                    self._busy = False
                    self._idle.set()
                    return
                batch, self._pending = self._pending, []

    def drain(self) -> None:
        self._idle.wait()


def submit_turn(ctx: RunContext, ready: TurnReady) -> Any:
    """Score an OPD turn on the teacher; the learner takes it once the scores land."""
    assert ctx.roles.teacher is not None, "OPD runs have a teacher role"
    return ctx.roles.teacher.score_turn.remote(ready.turn)


def publish_now(
    ctx: RunContext, learner_metrics: dict[str, Any], *, in_flight: bool = False
) -> tuple[float, float]:
    """Load the new weights into the engine (``in_flight``: taken at the rollout's next
    round, see ``publish_weights``); (start, acknowledged) times."""
    t0 = time.time()
    ack, sent = publish_weights(
        ctx.config,
        ctx.roles.learner,
        ctx.roles.rollout,
        learner_metrics["policy_version"],
        learner_metrics["weights"],
        in_flight=in_flight,
    )
    if sent is not None:
        learner_metrics["publication_bytes"] = sent
    return t0, ack


def publish_weights(
    config: TrainConfig,
    learner: Any,
    rollout: Any,
    version: int,
    weights: str,
    *,
    in_flight: bool = False,
) -> tuple[float, int | None]:
    """The learner's current weights into every engine, by the configured publication (a
    broadcast, checked when ``verify_publication``; or the file ``weights``, with
    ``lora_publication: adapter`` the adapter's folder); returns the time the engines had
    them and the bytes broadcast (None for a file or folder: an adapter's size is in the
    learner's step record). ``in_flight``: with episodes under way, the engines take it at
    the rollout's next generation round (a file is queued for it; the time returned is
    then the queueing's)."""
    import ray  # noqa: PLC0415

    if config.rollout.publication == "collective":
        verify = config.rollout.verify_publication
        receive = rollout.receive_in_flight if in_flight else rollout.receive_weights
        sent, (ack, reports) = ray.get(
            [learner.send_weights.remote(verify), receive.remote(version, verify)]
        )
        if verify:
            check_publication(version, sent, reports)
        return float(ack), int(sent["bytes"])
    if in_flight:
        ray.get(rollout.publish.remote(weights, version))
        return time.time(), None
    return float(ray.get(rollout.load_weights.remote(weights, version))), None


def check_publication(version: int, sent: dict[str, Any], reports: Sequence[Any]) -> None:
    """Refuse a publication that did not arrive whole: an engine worker whose received
    bytes hash otherwise than the learner's, or whose loaded parameters differ from them."""
    for number, report in enumerate(reports):
        where = f"engine {report.get('engine', 0)} (worker report {number})"
        if report.get("checksum") != sent.get("checksum"):
            raise RuntimeError(
                f"publication of version {version}: {where} received other bytes than the "
                "learner sent"
            )
        if report.get("differ"):
            raise RuntimeError(
                f"publication of version {version}: {where} loaded parameters that differ "
                f"from what it received: {report['differ'][:5]}"
            )


def timeline(
    step: int,
    *,
    start_s: float,
    end_s: float,
    learner: dict[str, Any],
    trajectories: Sequence[Trajectory],
    publication: tuple[float, float],
    in_flight: Sequence[Sequence[Mapping[str, Any]]] = (),
    rolled_out: Sequence[Trajectory] = (),
) -> StepTimeline:
    """The step's timeline from the learner's record and the rollouts' events:
    ``trajectories`` finished, ``in_flight`` the event lists of episodes still under way at
    ``end_s`` (a pipeline's next batches), whose intervals so far count as well.

    The rollout stage ends at the last release the learner saw, unless ``rolled_out`` names
    the batch that rolled out during the step while the learner trained on an earlier one
    (one-step-off): then at that batch's last reward, so the tail is the learner work the
    step's rollout did not hide."""
    line = StepTimeline(step=step, start_s=start_s, end_s=end_s, publication=publication)
    line.learner_done_s = float(learner["learner_done_s"])
    line.learner = [(float(a), float(b)) for a, b in learner["intervals"]]
    releases = [reward_time(t) for t in rolled_out] if rolled_out else learner["releases"]
    line.releases_s = [max(float(r), start_s) for r in releases]
    line.optimizer = (line.learner_done_s - float(learner["barrier_s"]), line.learner_done_s)
    finished = [((t.metadata or {}).get("events") or [], None) for t in trajectories]
    for events, open_until in [*finished, *((e, end_s) for e in in_flight)]:
        parts = episode_intervals(events, open_until=open_until)
        line.generation.extend(parts["generation"])
        line.sandbox.extend(parts["sandbox"])
        line.verify.extend(parts["grading"])
        gen, _verify = rollout_intervals(events)
        line.rollout.extend(gen)
    return line
