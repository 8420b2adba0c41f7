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
sync's post-rollout learner time; the speedup's geometric mean with a 95% interval, raw and
schedule-attributable (thundersync given sync's rollout stage of the same batch), and a sign
test of the two rollout stages; and the performance model's prediction of each step's
speedup from sync's release trace alone (out of sample), with its error
(predicted - measured) / measured. Before the measured steps the bench measures the
contention the model applies (``measure_contention``; GRPO): how much slower the learner
serves fixed sources beside a rollout than alone, run as the learner runs them (with packs,
a group at a time), without running thundersync (how much longer a rollout runs beside a
working learner is recorded too, not applied).

A sweep (``run_sweep``) keeps the roles up and measures several points of one setting that
only the drivers read (``rollout.max_live_episodes``: how many episodes roll out at once,
which moves the rollout stage's length and so the rollout/learner balance); per point it
reports the measured and the trace-predicted speedup, and over all points the mean absolute
error of the predictions.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thundersync_core.config import TrainConfig
from thundersync_core.schedules.base import StepOutcome

BENCH_SCHEDULES = ("sync", "thundersync")
#: The measured contention factors the predictions apply (``measure_contention``).
APPLIED_CONTENTION = ("learner_slowdown",)
#: Settings a sweep may vary without restarting a role (only the drivers read them).
SWEEPABLE = ("rollout.max_live_episodes",)


@dataclass
class BenchRig:
    """The roles a bench runs on: one rollout worker, one learner per schedule."""

    rollout: Any
    teacher: Any | None
    learners: dict[str, Any]
    task_ids: list[str]
    groups: Callable[..., Any]
    publish_dirs: list[Path]
    #: The roles' placement groups by name (``runtime.roles.reserve_roles``).
    reservations: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        from thundersync_core.runtime.roles import stop_actors  # noqa: PLC0415

        actors = [self.rollout, self.teacher, *self.learners.values()]
        stop_actors(actors, self.reservations.values())
        self.reservations = {}
        for folder in self.publish_dirs:
            shutil.rmtree(folder, ignore_errors=True)


def start_rig(config: TrainConfig, out_dir: Path) -> BenchRig:
    import ray  # noqa: PLC0415

    from thundersync_core.pools import load_pool  # noqa: PLC0415
    from thundersync_core.rollout.weights import publication_dir  # noqa: PLC0415
    from thundersync_core.runtime.placement import start_ray  # noqa: PLC0415
    from thundersync_core.runtime.roles import (  # noqa: PLC0415
        reserve_roles,
        start_learner,
        start_rollout,
        start_teacher,
    )
    from thundersync_core.schedules.base import group_lookup  # noqa: PLC0415
    from thundersync_core.warmstart.cache import prepare_policies  # noqa: PLC0415
    from thundersync_core.warmstart.frontier import frontier_pool  # noqa: PLC0415

    out_dir.mkdir(parents=True, exist_ok=True)
    pool = load_pool(config.tasks.prep_dir, "train", config.tasks.families)
    policy_dir, teacher_dir = prepare_policies(config, out_dir, list(pool.values()))
    pool = frontier_pool(config, policy_dir, pool, out_dir)
    start_ray(config.resources)
    # The two learners share the learner's cores and its share of Ray's CPUs: one of them
    # works at a time.
    learner = config.resources.learner
    shared = learner.model_copy(update={"num_cpus": learner.num_cpus / 2})
    reserved = reserve_roles(
        config, teacher=teacher_dir is not None, learners=dict.fromkeys(BENCH_SCHEDULES, shared)
    )
    publish_dirs = {s: publication_dir(f"bench-{s}") for s in BENCH_SCHEDULES}
    rollout = teacher = None
    learners: dict[str, Any] = {}
    try:
        rollout = start_rollout(config, policy_dir, pool, reservation=reserved["rollout"])
        if teacher_dir is not None:
            teacher = start_teacher(config, teacher_dir, reservation=reserved["teacher"])
        for s in BENCH_SCHEDULES:
            learners[s] = start_learner(
                config.model_copy(update={"schedule": s}),
                policy_dir,
                publish_dir=publish_dirs[s],
                resources=shared,
                reservation=reserved[f"learner.{s}"],
            )
        ray.get([rollout.version.remote(), *(lrn.version.remote() for lrn in learners.values())])
    except BaseException:
        dirs = list(publish_dirs.values())
        BenchRig(rollout, teacher, learners, [], lambda *_: None, dirs, reserved).close()
        raise
    return BenchRig(
        rollout,
        teacher,
        learners,
        list(pool),
        group_lookup(rollout, with_members=config.learner_chunks > 1),
        list(publish_dirs.values()),
        reserved,
    )


def bench_steps(
    rig: BenchRig, config: TrainConfig, steps: Sequence[int], label: str = ""
) -> dict[str, list[StepOutcome]]:
    """Measure ``steps`` (data-cursor positions) under both schedules, alternating."""
    import ray  # noqa: PLC0415

    from thundersync_core.pools import plan_step  # noqa: PLC0415
    from thundersync_core.schedules import DRIVERS, RunContext  # noqa: PLC0415
    from thundersync_core.schedules.base import Roles  # noqa: PLC0415

    outcomes: dict[str, list[StepOutcome]] = {s: [] for s in BENCH_SCHEDULES}
    for n, step in enumerate(steps):
        order = BENCH_SCHEDULES if n % 2 == 0 else BENCH_SCHEDULES[::-1]
        for schedule in order:
            learner = rig.learners[schedule]
            ray.get(rig.rollout.load_weights.remote(*ray.get(learner.weights_and_version.remote())))
            ctx = RunContext(
                config.model_copy(update={"schedule": schedule}),
                Roles(rig.rollout, learner, rig.teacher),
                lambda k: plan_step(config, rig.task_ids, k),
                rig.groups,
                _collector(outcomes[schedule]),
            )
            DRIVERS[schedule](ctx, step, step + 1)
            line = outcomes[schedule][-1].timeline.summary()
            print(
                f"[bench{label} step {step}] {schedule:<11} wall {line['step_wall_s']:.2f}s "
                f"idle {line['learner_idle_fraction']:.0%} tail {line['learner_tail_s']:.2f}s",
                flush=True,
            )
    return outcomes


def _timed_rollout(ctx: Any, specs: list[Any]) -> tuple[list, float]:
    """The batch's trajectories and its rollout stage (call to last reward), in seconds."""
    from thundersync_core.batch import Trajectory  # noqa: PLC0415
    from thundersync_core.schedules.base import events, reward_time  # noqa: PLC0415

    t0 = time.time()
    trajectories = [e for e in events(ctx, specs) if isinstance(e, Trajectory)]
    return trajectories, max(reward_time(t) for t in trajectories) - t0


def measure_contention(rig: BenchRig, config: TrainConfig, step: int) -> dict[str, Any] | None:
    """The trace model's contention factors on this machine, without running thundersync.

    On batch ``step`` (not one the bench measures): one rollout to warm the engine's caches
    and fix the learner's sources, one rollout alone, one learner pass alone over those
    sources (as packs, a group at a time, where the learner runs packs), then a rollout
    while the learner repeats the pass. ``learner_slowdown``: the
    learner's time for the sources it served beside that rollout over their time alone;
    ``rollout_slowdown``: the rollout stage beside the learner over alone (one sample each;
    recorded beside the spread of two rollouts alone, not applied). GRPO on one learner rank
    only (an OPD source is a teacher-scored turn; a learner group routes sources to ranks),
    on a batch that gives the learner work (a group with two reward values): None
    otherwise, and the predictions go without it. No weights change."""
    import ray  # noqa: PLC0415

    from thundersync_core.pools import plan_step  # noqa: PLC0415
    from thundersync_core.schedules import RunContext  # noqa: PLC0415
    from thundersync_core.schedules.base import Roles  # noqa: PLC0415

    if config.objective != "grpo" or config.resources.learner.ranks > 1:
        return None
    learner = rig.learners["thundersync"]
    ray.get(rig.rollout.load_weights.remote(*ray.get(learner.weights_and_version.remote())))
    specs = plan_step(config, rig.task_ids, step)
    groups = rig.groups(specs)
    ctx = RunContext(
        config,
        Roles(rig.rollout, learner, rig.teacher),
        lambda k: plan_step(config, rig.task_ids, k),
        rig.groups,
        _collector([]),
    )
    batch, first_rollout_s = _timed_rollout(ctx, specs)
    batch.sort(key=lambda t: t.trajectory_id)
    _, alone_rollout_s = _timed_rollout(ctx, specs)
    alone = {i: t1 - t0 for i, t0, t1 in ray.get(learner.time_sources.remote(groups, batch))}
    if not alone:
        print(
            f"[bench contention, batch {step}] not measured: every group of the batch has "
            "equal rewards, so the learner has no work to time",
            flush=True,
        )
        return None
    folder = Path(tempfile.mkdtemp(prefix="thundersync-contention-"))
    try:
        stop = folder / "stop"
        served = learner.time_sources.remote(groups, batch, str(stop))
        t0 = time.time()
        _, loaded_rollout_s = _timed_rollout(ctx, specs)
        end = t0 + loaded_rollout_s
        stop.touch()
        beside = [(i, b - a) for i, a, b in ray.get(served) if a >= t0 and b <= end]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if not beside:
        return None
    loaded_s = sum(d for _, d in beside)
    alone_s = sum(alone[i] for i, _ in beside)
    print(
        f"[bench contention, batch {step}] learner {loaded_s / alone_s:.3f}x slower beside "
        f"the rollout ({len(beside)} sources), rollout {loaded_rollout_s:.1f}s beside the "
        f"learner against {alone_rollout_s:.1f}s alone",
        flush=True,
    )
    return {
        "learner_slowdown": loaded_s / alone_s,
        "rollout_slowdown": loaded_rollout_s / alone_rollout_s,
        "step": step,
        "rollout_alone_s": alone_rollout_s,
        # The same batch's first rollout (cold caches): how far two rollouts of one batch
        # differ with nothing else running, the noise the rollout factor sits in.
        "rollout_first_s": first_rollout_s,
        "rollout_beside_learner_s": loaded_rollout_s,
        "learner_pass_alone_s": sum(alone.values()),
        "sources_served_beside_rollout": len(beside),
    }


def run_bench(config: TrainConfig, out_dir: Path, *, steps: int) -> dict[str, Any]:
    rig = start_rig(config, out_dir)
    try:
        contention = measure_contention(rig, config, steps)
        outcomes = bench_steps(rig, config, range(steps))
    finally:
        rig.close()
    report = bench_report(config, outcomes, contention)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def run_sweep(
    config: TrainConfig, out_dir: Path, *, steps: int, key: str, values: Sequence[int]
) -> dict[str, Any]:
    """One bench per value of ``key``, on the same roles; predicted vs measured per point."""
    if key not in SWEEPABLE:
        raise ValueError(
            f"--sweep: {key!r} cannot be swept without restarting roles; "
            f"sweepable: {', '.join(SWEEPABLE)}"
        )
    if not values:
        raise ValueError("--sweep: give at least one value")
    section, field = key.split(".")
    rig = start_rig(config, out_dir)
    points = []
    try:
        cursor = 0
        for value in values:
            sub = getattr(config, section).model_copy(update={field: value})
            point_config = config.model_copy(update={section: sub})
            # Each point's contention is its own (how many episodes generate at once moves
            # the rollout's load), measured on a batch the point does not train on.
            contention = measure_contention(rig, point_config, cursor + steps)
            outcomes = bench_steps(
                rig, point_config, range(cursor, cursor + steps), f" {key}={value}"
            )
            cursor += steps + 1
            points.append({"value": value, **bench_report(point_config, outcomes, contention)})
    finally:
        rig.close()
    report = sweep_summary(key, points)
    (out_dir / "sweep.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def sweep_summary(key: str, points: list[dict[str, Any]]) -> dict[str, Any]:
    """Per point (balance, predicted, measured, error) and the mean absolute error."""
    rows = []
    for point in points:
        predicted = statistics.median(p["predicted"] for p in point["perfmodel"])
        plain = statistics.median(p["predicted_without_contention"] for p in point["perfmodel"])
        measured = point["median_sync_over_thundersync"]
        rows.append(
            {
                "value": point["value"],
                "balance_rho": point["balance_rho"],
                "contention": point["contention"],
                "predicted_speedup": predicted,
                "measured_speedup": measured,
                # One convention throughout: (predicted - measured) / measured.
                "error": (predicted - measured) / measured,
                "predicted_speedup_without_contention": plain,
                "error_without_contention": (plain - measured) / measured,
            }
        )
    return {
        "key": key,
        "points": rows,
        "mean_absolute_error": statistics.mean(abs(r["error"]) for r in rows),
        "mean_error": statistics.mean(r["error"] for r in rows),
        "mean_absolute_error_without_contention": statistics.mean(
            abs(r["error_without_contention"]) for r in rows
        ),
        "benches": points,
    }


def _same_samples(a: Sequence[Any], b: Sequence[Any]) -> float | None:
    """Share of ``a``'s trajectories whose action tokens ``b`` has identically (same id)."""

    def tokens(trajectories: Sequence[Any]) -> dict[str, tuple[int, ...]]:
        return {
            t.trajectory_id: tuple(i for s in t.segments if s.kind == "action" for i in s.ids)
            for t in trajectories
        }

    mine, theirs = tokens(a), tokens(b)
    if not mine:
        return None
    return sum(theirs.get(k) == v for k, v in mine.items()) / len(mine)


def _collector(into: list[StepOutcome]) -> Any:
    def collect(outcome: StepOutcome) -> bool:
        into.append(outcome)
        return True

    return collect


def bench_report(
    config: TrainConfig,
    outcomes: dict[str, list[StepOutcome]],
    contention: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from thundersync_core.metrics import generated_tokens  # noqa: PLC0415
    from thundersync_core.perfmodel import predict_from_trace  # noqa: PLC0415
    from thundersync_core.recording import release_trace  # noqa: PLC0415
    from thundersync_core.stats import ratio_interval, sign_test  # noqa: PLC0415

    per: dict[str, dict[str, Any]] = {}
    for schedule, items in outcomes.items():
        lines = [o.timeline.summary() for o in items]
        per[schedule] = {
            "step_wall_s": [x["step_wall_s"] for x in lines],
            "learner_idle_fraction": [x["learner_idle_fraction"] for x in lines],
            "learner_tail_s": [x["learner_tail_s"] for x in lines],
            "rollout_stage_s": [x["rollout_stage_s"] for x in lines],
            "learner_busy_s": [x["learner_busy_s"] for x in lines],
            # Where a difference of the rollout stages comes from: the parts of the step
            # before the last reward, and how many tokens the batch sampled.
            **{
                f"wall_{part}_s": [x[f"wall_{part}_s"] for x in lines]
                for part in ("generation", "grading", "sandbox")
            },
            "generated_tokens": [generated_tokens(o.trajectories) for o in items],
        }
    sync, stream = per["sync"], per["thundersync"]
    ratios = [a / b for a, b in zip(sync["step_wall_s"], stream["step_wall_s"], strict=True)]
    tail_fraction = [
        t / s
        for t, s in zip(stream["learner_tail_s"], sync["learner_tail_s"], strict=True)
        if s > 0
    ]
    predictions = []
    traces: list[dict[str, Any]] = []
    for k, outcome in enumerate(outcomes["sync"]):
        # Out of sample: thundersync's step is predicted from sync's release trace (when
        # its rewards landed, what each source cost its learner) and the contention
        # measured before the steps (also without thundersync), which slows the learner
        # beside the rollout and the rollout beside the learner.
        trace = release_trace(outcome)
        fifo_only = float(predict_from_trace(trace)["predicted_speedup"])
        if config.objective == "grpo":
            # Thundersync's GRPO learner opens at most this many groups at once.
            trace["max_open_groups"] = config.max_open_groups
        plain = float(predict_from_trace(trace)["predicted_speedup"])
        if contention is not None:
            # The learner's factor only: the rollout's, from one rollout beside the learner
            # against one alone, sits inside the rollout's own run-to-run spread on this
            # machine (recorded, not applied; see measure_contention).
            trace["contention"] = {key: contention[key] for key in APPLIED_CONTENTION}
        model = predict_from_trace(trace)
        traces.append(
            trace
            | {
                "measured": {
                    "sync_step_s": sync["step_wall_s"][k],
                    "thundersync_step_s": stream["step_wall_s"][k],
                }
            }
        )
        predicted = float(model["predicted_speedup"])
        predicted_step = float(model["thundersync"]["step_s"])
        measured_step = stream["step_wall_s"][k]
        predictions.append(
            {
                "step": k,
                "predicted": predicted,
                "measured": ratios[k],
                "error": (predicted - ratios[k]) / ratios[k],
                "thundersync_step_predicted_s": predicted_step,
                "thundersync_step_error": (predicted_step - measured_step) / measured_step,
                "predicted_without_contention": plain,
                "error_without_contention": (plain - ratios[k]) / ratios[k],
                # The plain FIFO: neither the open-group cap nor contention.
                "predicted_fifo_only": fifo_only,
            }
        )
    # The schedule changes what the learner does during and after the rollout stage, not
    # the rollout itself: on the same batches the stages should agree. The sign test says
    # whether one schedule's stage was longer more often than chance allows; the
    # schedule-attributable speedup gives thundersync sync's rollout stage, step by step.
    test = sign_test(sync["rollout_stage_s"], stream["rollout_stage_s"])
    # Same batches, same seeds, (nearly) the same weights: the share of trajectories whose
    # sampled tokens are identical under both schedules.
    same_samples = [
        _same_samples(a.trajectories, b.trajectories)
        for a, b in zip(outcomes["sync"], outcomes["thundersync"], strict=True)
    ]
    rollout_check = {
        "sync_longer": test["a_larger"],
        "thundersync_longer": test["b_larger"],
        "sign_test_p": test["p_value"],
        "same_samples_fraction": same_samples,
        "median_sync_over_thundersync": statistics.median(
            a / b for a, b in zip(sync["rollout_stage_s"], stream["rollout_stage_s"], strict=True)
        ),
    }
    attributable = [
        s_step / (t_step - t_roll + s_roll)
        for s_step, t_step, s_roll, t_roll in zip(
            sync["step_wall_s"],
            stream["step_wall_s"],
            sync["rollout_stage_s"],
            stream["rollout_stage_s"],
            strict=True,
        )
    ]
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
        # Each schedule's learner (sync's the baseline: benchmarks/learner_packing.py
        # measures which sync learner is fastest on a batch).
        "learners": {
            s: config.model_copy(update={"schedule": s}).learner_label for s in BENCH_SCHEDULES
        },
        "schedules": per,
        "step_time_ratio": ratios,
        "median_sync_over_thundersync": statistics.median(ratios),
        # sync step / thundersync step: geometric mean over steps with its 95% interval.
        "speedup": ratio_interval(ratios),
        "schedule_attributable_step_time_ratio": attributable,
        "schedule_attributable_speedup": ratio_interval(attributable),
        "rollout_stage_sync_vs_thundersync": rollout_check,
        "median_learner_idle_fraction": {
            s: statistics.median(v["learner_idle_fraction"]) for s, v in per.items()
        },
        "median_tail_s": {s: statistics.median(v["learner_tail_s"]) for s, v in per.items()},
        "median_tail_fraction_of_sync": statistics.median(tail_fraction) if tail_fraction else None,
        "balance_rho": mean_rho,
        "contention": contention,
        "perfmodel": predictions,
        # What the predictions read (with ``contention``): ``thundersync perfmodel trace``
        # recomputes them from this file.
        "sync_release_traces": traces,
    }
