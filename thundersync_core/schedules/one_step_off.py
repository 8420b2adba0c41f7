"""One-step-off async: batch k+1 rolls out on theta_k while the learner trains on batch k.

Batch k was sampled by theta_{k-1} (batch 0 by theta_0), so every source is one version
stale; the learner admits a lag of one and weights each token by the truncated importance
ratio min(pi_theta / mu, is_clip) against the behaviour log-probs the engine recorded.
theta_{k+1} is published when both the step and the rollout of batch k+1 are done.
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
    batch = [e for e in events(ctx, ctx.plan(start)) if isinstance(e, Trajectory)]
    for step in range(start, end):
        t0 = time.time()
        ctx.roles.learner.begin.remote(ctx.groups(ctx.plan(step)))
        submit_batch(ctx, batch)
        stepping = ctx.roles.learner.step.remote(step)
        # The next batch rolls out on the current weights while the learner works.
        following = (
            [e for e in events(ctx, ctx.plan(step + 1)) if isinstance(e, Trajectory)]
            if step + 1 < end
            else []
        )
        learner = ray.get(stepping)
        publication = publish_now(ctx, learner)
        line = timeline(
            step,
            start_s=t0,
            end_s=publication[1],
            learner=learner,
            trajectories=batch + following,
            publication=publication,
            rolled_out=following,
        )
        if not ctx.on_step(StepOutcome(step, line, learner, batch)):
            return
        batch = following
