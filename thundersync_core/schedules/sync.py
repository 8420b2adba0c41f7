"""Sync: roll the whole batch out on theta_k, then train on it, then publish theta_{k+1}.

The learner receives nothing until the last reward of the batch has landed (OPD: the
teacher scores after the last trajectory ends); it is idle for the whole rollout stage.
"""

from __future__ import annotations

import time

import ray

from thundersync_core.batch import Trajectory
from thundersync_core.schedules.base import (
    RunContext,
    StepOutcome,
    events,
    publish_now,
    submit_batch,
    timeline,
)


def run(ctx: RunContext, start: int, end: int) -> None:
    for step in range(start, end):
        t0 = time.time()
        specs = ctx.plan(step)
        ctx.roles.learner.begin.remote(ctx.groups(specs))
        batch = [e for e in events(ctx, specs) if isinstance(e, Trajectory)]
        submit_batch(ctx, batch)
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
