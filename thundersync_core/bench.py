"""``thundersync bench``: sync and thundersync alternately, on the same workload, same cores.

One rollout worker (engine, agent, sandboxes) serves both schedules; each schedule has its
own learner actor, and both learners are pinned to the same learner cores, so neither gets
more hardware. Step k of both schedules trains on the same batch (same tasks, same seeds);
the two learners' weights stay equal up to floating-point noise because the updates are
mathematically the same. Before each measured step the engine is loaded (untimed) with the
weights of the schedule about to run; the measured step then ends with that schedule's own
publication, as in training. Which schedule goes first alternates from step to step, so
slow drift of the machine favours neither.

Printed and written (``--out``): per schedule the step wall times, learner idle fractions
and tails; the median sync/thundersync step-time ratio; thundersync's tail as a fraction of
sync's post-rollout learner time; and the performance model's prediction from each
thundersync step's release trace, with its error against the measured ratio.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from thundersync_core.config import TrainConfig
from thundersync_core.schedules.base import StepOutcome

BENCH_SCHEDULES = ("sync", "thundersync")


def run_bench(config: TrainConfig, out_dir: Path, *, steps: int) -> dict[str, Any]:
    import ray  # noqa: PLC0415

    from thundersync_core.runtime.learner_worker import LearnerWorker  # noqa: PLC0415
    from thundersync_core.runtime.placement import remote_role, start_ray  # noqa: PLC0415
    from thundersync_core.runtime.rollout_worker import RolloutWorker  # noqa: PLC0415
    from thundersync_core.runtime.teacher_worker import TeacherWorker  # noqa: PLC0415
    from thundersync_core.schedules import DRIVERS, RunContext  # noqa: PLC0415
    from thundersync_core.schedules.base import Roles, group_lookup  # noqa: PLC0415
    from thundersync_core.train import load_pool, plan_step, prepare_policies  # noqa: PLC0415

    out_dir.mkdir(parents=True, exist_ok=True)
    pool = load_pool(config.tasks.prep_dir, "train", config.tasks.families)
    policy_dir, teacher_dir = prepare_policies(config, out_dir, list(pool.values()))
    start_ray(config.resources)
    res = config.resources
    rollout = remote_role(RolloutWorker, res.rollout, max_concurrency=2).remote(
        policy_dir, pool, config.rollout, cores=res.rollout.cores, seed=config.seed
    )
    teacher = None
    if teacher_dir is not None:
        teacher = remote_role(TeacherWorker, res.teacher).remote(
            teacher_dir, cores=res.teacher.cores
        )
    # The two learners share the learner's cores and its share of Ray's CPUs: one of them
    # works at a time.
    shared = res.learner.model_copy(update={"num_cpus": res.learner.num_cpus / 2})
    learners = {
        s: remote_role(LearnerWorker, shared).remote(
            policy_dir,
            config.model_copy(update={"schedule": s}),
            publish_dir=Path("/dev/shm") / f"thundersync-bench-{s}-{time.time_ns()}",
        )
        for s in BENCH_SCHEDULES
    }
    ray.get([rollout.version.remote(), *(lrn.version.remote() for lrn in learners.values())])
    task_ids = list(pool)
    groups = group_lookup(rollout)

    outcomes: dict[str, list[StepOutcome]] = {s: [] for s in BENCH_SCHEDULES}
    try:
        for step in range(steps):
            order = BENCH_SCHEDULES if step % 2 == 0 else BENCH_SCHEDULES[::-1]
            for schedule in order:
                learner = learners[schedule]
                ray.get(rollout.load_weights.remote(*ray.get(learner.weights_and_version.remote())))
                ctx = RunContext(
                    config.model_copy(update={"schedule": schedule}),
                    Roles(rollout, learner, teacher),
                    lambda k: plan_step(config, task_ids, k),
                    groups,
                    _collector(outcomes[schedule]),
                )
                DRIVERS[schedule](ctx, step, step + 1)
                line = outcomes[schedule][-1].timeline.summary()
                print(
                    f"[bench step {step}] {schedule:<11} wall {line['step_wall_s']:.2f}s "
                    f"idle {line['learner_idle_fraction']:.0%} tail {line['learner_tail_s']:.2f}s",
                    flush=True,
                )
    finally:
        for actor in [rollout, teacher, *learners.values()]:
            if actor is not None:
                ray.kill(actor)
    report = bench_report(config, outcomes)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _collector(into: list[StepOutcome]) -> Any:
    def collect(outcome: StepOutcome) -> bool:
        into.append(outcome)
        return True

    return collect


def bench_report(config: TrainConfig, outcomes: dict[str, list[StepOutcome]]) -> dict[str, Any]:
    from thundersync_core.perfmodel import predict_from_trace  # noqa: PLC0415
    from thundersync_core.train import release_trace  # noqa: PLC0415

    per: dict[str, dict[str, Any]] = {}
    for schedule, items in outcomes.items():
        lines = [o.timeline.summary() for o in items]
        per[schedule] = {
            "step_wall_s": [x["step_wall_s"] for x in lines],
            "learner_idle_fraction": [x["learner_idle_fraction"] for x in lines],
            "learner_tail_s": [x["learner_tail_s"] for x in lines],
            "rollout_stage_s": [x["rollout_stage_s"] for x in lines],
            "learner_busy_s": [x["learner_busy_s"] for x in lines],
        }
    sync, stream = per["sync"], per["thundersync"]
    ratios = [a / b for a, b in zip(sync["step_wall_s"], stream["step_wall_s"], strict=True)]
    tail_fraction = [
        t / s
        for t, s in zip(stream["learner_tail_s"], sync["learner_tail_s"], strict=True)
        if s > 0
    ]
    predictions = []
    for k, outcome in enumerate(outcomes["thundersync"]):
        trace = release_trace(outcome)
        measured = ratios[k]
        trace["measured"] = {
            "sync_step_s": sync["step_wall_s"][k],
            "thundersync_step_s": stream["step_wall_s"][k],
        }
        predicted = float(predict_from_trace(trace)["predicted_speedup"])
        predictions.append(
            {
                "step": k,
                "predicted": predicted,
                "measured": measured,
                "error": predicted / measured - 1.0,
            }
        )
    mean_rho = statistics.mean(
        b / r for b, r in zip(sync["learner_busy_s"], sync["rollout_stage_s"], strict=True) if r > 0
    )
    return {
        "objective": config.objective,
        "steps": len(ratios),
        "batch": {"groups": config.groups_per_step, "group_size": config.group_size},
        "cores": {
            "rollout": list(config.resources.rollout.cores),
            "learner": list(config.resources.learner.cores),
        },
        "schedules": per,
        "step_time_ratio": ratios,
        "median_sync_over_thundersync": statistics.median(ratios),
        "median_learner_idle_fraction": {
            s: statistics.median(v["learner_idle_fraction"]) for s, v in per.items()
        },
        "median_tail_s": {s: statistics.median(v["learner_tail_s"]) for s, v in per.items()},
        "median_tail_fraction_of_sync": statistics.median(tail_fraction) if tail_fraction else None,
        "balance_rho": mean_rho,
        "perfmodel": predictions,
    }
