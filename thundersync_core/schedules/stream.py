"""ThunderSync: sources go to the learner the moment their inputs are fixed.

GRPO: a trajectory when its reward lands. OPD: a turn when the teacher has scored it (turns
are scored as they are sampled, while the episode goes on). The learner's mailbox is the
work-conserving queue (with ``learner_pack_tokens``, what queued while the learner worked
goes over as one pack); its admission cap bounds live group statistics. One exact optimizer
step after the barrier, then theta_{k+1} is published. Rollouts and gradients of step k all
use theta_k: the learner refuses a source from another version.
"""

from __future__ import annotations

import time

import ray

from thundersync_core.batch import Trajectory
from thundersync_core.rollout.agent import TurnReady
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
    for step in range(start, end):
        t0 = time.time()
        specs = ctx.plan(step)
        ctx.roles.learner.begin.remote(ctx.groups(specs))
        mailbox = LearnerMailbox(ctx.roles.learner) if ctx.config.packs else None
        batch = []
        for event in events(ctx, specs, emit_turns=ctx.opd):
            if isinstance(event, TurnReady):
                ctx.roles.learner.submit_turn.remote(submit_turn(ctx, event))
            elif isinstance(event, Trajectory):
                batch.append(event)
                if mailbox is not None:
                    mailbox.put(event, reward_time(event))
                elif not ctx.opd:
                    ctx.roles.learner.submit.remote(event, reward_time(event))
        if mailbox is not None:
            mailbox.drain()
        learner = ray.get(ctx.roles.learner.step.remote(step))
        publication = publish_now(ctx, learner)
        line = timeline(
            step,
            start_s=t0,
            end_s=publication[1],
            learner=learner,
            trajectories=batch,
            publication=publication,
        )
        if not ctx.on_step(StepOutcome(step, line, learner, batch)):
            return
