"""Pipeline: rollouts never stop; weights are swapped in flight, between generation rounds.

All batches stream through one rollout: a batch-b trajectory starts only once the engine's
policy version is at least b - max_staleness (rollouts are held back when the learner falls
behind). Every action records the version that sampled it, so a trajectory may span
versions; the learner admits a lag up to max_staleness and applies truncated importance
weights per token. When batch b's last source is in, the learner steps and the new weights
are queued for the engine's next round (no wait for the rollouts in flight); an evaluation
after the run applies the last queued weights first. By collective publication the learner
broadcasts and the engines receive at that next round (drained, so no reply mixes versions).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import ray

from thundersync_core.batch import Trajectory
from thundersync_core.rollout.agent import TurnReady
from thundersync_core.runtime.rollout_worker import RolloutSpec
from thundersync_core.schedules.base import (
    LearnerMailbox,
    RunContext,
    StepOutcome,
    events,
    publish_now,
    reward_time,
    submit_turn,
    timeline,
)


def run(ctx: RunContext, start: int, end: int) -> None:
    plans = {step: ctx.plan(step) for step in range(start, end)}
    batch_of = {s.trajectory_id: step for step, specs in plans.items() for s in specs}
    specs: list[RolloutSpec] = [s for step in range(start, end) for s in plans[step]]
    waiting: dict[int, list[tuple[str, Any]]] = defaultdict(list)
    finished: dict[int, list[Trajectory]] = defaultdict(list)
    current, t0 = start, time.time()
    ctx.roles.learner.begin.remote(ctx.groups(plans[current]))
    # With packs, what lands while the learner works goes over together (LearnerMailbox).
    mailbox = LearnerMailbox(ctx.roles.learner) if ctx.config.packs else None
    live = ctx.config.rollout.max_live_episodes
    stream = events(
        ctx,
        specs,
        max_live=min(live, ctx.config.batch_size) if live else ctx.config.batch_size,
        max_staleness=ctx.config.max_staleness,
        emit_turns=ctx.opd,
    )
    for event in stream:
        if isinstance(event, TurnReady):
            waiting[batch_of[event.turn.trajectory_id]].append(("turn", submit_turn(ctx, event)))
            continue
        assert isinstance(event, Trajectory)
        step = batch_of[event.trajectory_id]
        finished[step].append(event)
        if not ctx.opd:
            waiting[step].append(("trajectory", event))
        while current < end and len(finished[current]) == len(plans[current]):
            _hand_over(ctx, waiting.pop(current, []), mailbox)
            if mailbox is not None:
                mailbox.drain()
            learner = ray.get(ctx.roles.learner.step.remote(current))
            # Queued for the engines' next round (a file), or broadcast and taken there (the
            # driver waits about a round: the learner sends until then); either way awaited,
            # so that nothing sent to the rollout role later, an evaluation above all, and
            # not the next batch's ``begin``, can overtake it.
            sent, acknowledged = publish_now(ctx, learner, in_flight=True)
            # The next batches roll out during this step: theirs is rollout time as well.
            in_flight = ray.get(ctx.roles.rollout.in_flight_events.remote())
            later = [t for step, done in finished.items() if step > current for t in done]
            line = timeline(
                current,
                start_s=t0,
                end_s=acknowledged,
                learner=learner,
                trajectories=finished[current] + later,
                publication=(sent, acknowledged),
                in_flight=in_flight,
            )
            if not ctx.on_step(StepOutcome(current, line, learner, finished.pop(current))):
                return
            current, t0 = current + 1, acknowledged
            if current < end:
                ctx.roles.learner.begin.remote(ctx.groups(plans[current]))
        if current < end:
            _hand_over(ctx, waiting.pop(current, []), mailbox)


def _hand_over(
    ctx: RunContext, sources: list[tuple[str, Any]], mailbox: LearnerMailbox | None
) -> None:
    for kind, source in sources:
        if kind == "turn":
            ctx.roles.learner.submit_turn.remote(source)
        elif mailbox is not None:
            mailbox.put(source, reward_time(source))
        else:
            ctx.roles.learner.submit.remote(source, reward_time(source))
