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
    reward_time,
    submit_whole,
    timeline,
)


def run(ctx: RunContext, start: int, end: int) -> None:
    for step in range(start, end):
        t0 = time.time()
        specs = ctx.plan(step)
        ctx.roles.learner.begin.remote(ctx.groups(specs))
        batch = [e for e in events(ctx, specs) if isinstance(e, Trajectory)]
        # A fixed order (not grading order) makes the batch's float sums reproducible.
        batch.sort(key=lambda t: t.trajectory_id)
        if ctx.config.packs:
            # The whole batch at once: each group runs as packs, one backward per pack.
            ctx.roles.learner.submit_many.remote([(t, reward_time(t)) for t in batch])
        else:
            for traj in batch:
                submit_whole(ctx, traj)
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
