"""The training stage's plain parts: config layering and errors, the data cursor, metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from thundersync_core.config import load_config
from thundersync_core.metrics import (
    FlopLedger,
    StepTimeline,
    episode_intervals,
    inflight_swaps,
    staleness_tokens,
    union_seconds,
)
from thundersync_core.pools import plan_step

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["train_embedded.yaml", "bench_embedded.yaml"])
def test_embedded_config_loads_and_resolves_relative_paths(name: str) -> None:
    config = load_config(CONFIGS / name)
    assert config.tasks.prep_dir == (CONFIGS.parent / "runs" / "prep").resolve()
    assert config.resources.rollout.cores != config.resources.learner.cores
    if name == "train_embedded.yaml":
        assert config.warm_start.cache_dir == (CONFIGS.parent / "runs" / "warmstart-cache")


def test_the_bench_measures_the_demos_workload() -> None:
    """The bench config trains what the demo trains (same warm start, hence one cached
    policy and one frontier score, same tasks, batch, rollout and learner settings)."""
    bench = load_config(CONFIGS / "bench_embedded.yaml")
    demo = load_config(CONFIGS / "train_embedded.yaml")
    assert bench.warm_start == demo.warm_start
    assert bench.policy == demo.policy
    assert bench.rollout == demo.rollout
    assert bench.resources == demo.resources
    assert bench.tasks.model_copy(update={"dev_tasks": 0, "dev_samples": 1}) == (
        demo.tasks.model_copy(update={"dev_tasks": 0, "dev_samples": 1})
    )
    keys = ("groups_per_step", "group_size", "lr", "learner_pack_tokens", "max_open_groups")
    assert [getattr(bench, k) for k in keys] == [getattr(demo, k) for k in keys]


def test_relative_pools_to_leave_out_of_dev_are_relative_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "c.yaml"
    path.parent.mkdir()
    path.write_text(f"tasks: {{dev_exclude: [../pools/a, {tmp_path / 'b'}]}}\n")
    config = load_config(path)
    assert config.tasks.dev_exclude == (tmp_path / "pools" / "a", tmp_path / "b")


def test_overrides_beat_the_file_and_errors_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("steps: 3\nrollout: {engine: hf}\n")
    config = load_config(path, {"steps": 5, "rollout.max_turns": 2})
    assert (config.steps, config.rollout.engine, config.rollout.max_turns) == (5, "hf", 2)
    path.write_text("rollout: {max_turns: 0}\n")
    with pytest.raises(ValueError, match=r"field rollout\.max_turns"):
        load_config(path)
    path.write_text("schedul: sync\n")
    with pytest.raises(ValueError, match="field schedul"):
        load_config(path)
    with pytest.raises(FileNotFoundError, match="--config"):
        load_config(tmp_path / "missing.yaml")


def test_plan_is_a_pure_function_of_seed_and_step() -> None:
    config = load_config(None, {"groups_per_step": 3, "group_size": 2})
    tasks = [f"t{i}" for i in range(7)]
    first = plan_step(config, tasks, 4)
    assert first == plan_step(config, tasks, 4)
    assert len(first) == 6
    assert len({s.group_id for s in first}) == 3
    assert all(s.batch == 4 and s.group_id.startswith("s00004-") for s in first)
    # One epoch (7 // 3 = 2 steps) visits distinct tasks; another seed orders them otherwise.
    epoch = [s.task_id for k in range(2) for s in plan_step(config, tasks, k)[::2]]
    assert len(set(epoch)) == 6
    other = load_config(None, {"groups_per_step": 3, "group_size": 2, "seed": 1})
    assert [s.task_id for s in plan_step(other, tasks, 4)] != [s.task_id for s in first]


def test_union_of_intervals_and_step_summary() -> None:
    assert union_seconds([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_seconds([(0, 10)], 2, 4) == 2
    line = StepTimeline(step=0, start_s=0.0, end_s=10.0, learner_done_s=9.0)
    line.releases_s = [3.0, 7.5]
    line.learner = [(3.0, 4.0), (7.5, 9.0)]
    summary = line.summary()
    assert summary["learner_busy_s"] == 2.5
    assert summary["learner_idle_fraction"] == pytest.approx(0.75)
    assert summary["learner_tail_s"] == pytest.approx(1.5)
    assert summary["rollout_stage_s"] == 7.5


def test_every_second_of_a_step_is_named_once() -> None:
    # Two episodes overlap; the learner works under them (hidden) and after the last reward.
    events = [
        [("setup_start", 0.0), ("start", 0.5), ("generate_start", 0.5), ("generate_end", 2.0),
         ("exec_start", 2.0), ("exec_end", 3.0), ("grade_start", 3.0), ("reward", 4.0),
         ("closed", 4.2)],
        [("setup_start", 0.0), ("start", 0.4), ("generate_start", 1.0), ("generate_end", 2.5),
         ("exec_start", 2.5), ("exec_end", 5.0), ("grade_start", 5.5), ("reward", 6.0),
         ("closed", 6.1)],
    ]  # fmt: skip
    line = StepTimeline(step=0, start_s=0.0, end_s=10.0, learner_done_s=8.5)
    for episode in events:
        parts = episode_intervals([{"event": e, "time": t} for e, t in episode])
        line.generation += parts["generation"]
        line.sandbox += parts["sandbox"]
        line.verify += parts["grading"]
    line.releases_s = [4.0, 6.0]
    line.learner = [(4.0, 5.0), (6.2, 7.5), (8.0, 8.5)]
    line.optimizer = (8.0, 8.5)
    line.publication = (9.0, 9.6)
    parts = line.breakdown()
    # Where parts overlap the first named wins: generation, grading, sandbox, optimizer,
    # publication, tail, learner.
    expected = {
        "generation": 2.5 - 0.5,  # either episode generating
        "grading": (4.0 - 3.0) + (6.0 - 5.5),  # over episode 2's command at 3.0-4.0
        "sandbox": 0.5 + (3.0 - 2.5) + (5.0 - 4.0) + 0.1,  # set-up, commands, removal
        "learner": 0.0,  # 4.0-5.0 runs under episode 2's command: the rollout's time
        "tail": 7.5 - 6.2,  # learner work after the last reward
        "optimizer": 0.5,
        "publication": (9.0 - 8.5) + (9.6 - 9.0),  # weights written, then loaded
        "overhead": (5.5 - 5.0) + (6.2 - 6.1) + (8.0 - 7.5) + (10.0 - 9.6),
    }
    for part, seconds in expected.items():
        assert parts[f"wall_{part}_s"] == pytest.approx(seconds), part
    assert sum(parts.values()) == pytest.approx(10.0)
    summary = line.summary()
    assert summary["wall_overhead_fraction"] == pytest.approx(parts["wall_overhead_s"] / 10.0)


def test_one_step_off_tail_is_learner_work_after_the_steps_own_rollout() -> None:
    # The learner got batch k at 100.0 (its releases) and worked until 121.0; batch k+1
    # rolled out meanwhile, its last reward at 130.0: the rollout hid all of that work.
    from thundersync_core.batch import Segment, Trajectory  # noqa: PLC0415
    from thundersync_core.schedules.base import timeline  # noqa: PLC0415

    def rolled(reward_at: float) -> Trajectory:
        events = [
            {"event": "generate_start", "time": 100.5},
            {"event": "reward", "time": reward_at},
        ]
        seg = Segment.action((1,))
        return Trajectory("g", f"g/{reward_at}", (0,), (seg,), 1.0, metadata={"events": events})

    learner = {
        "learner_done_s": 121.0,
        "intervals": [(100.0, 120.5)],
        "releases": [100.0, 100.0],
        "barrier_s": 0.5,
    }
    common = {"start_s": 100.0, "end_s": 131.0, "learner": learner, "publication": (130.5, 131.0)}
    hidden = timeline(3, trajectories=[], rolled_out=[rolled(125.0), rolled(130.0)], **common)
    assert hidden.summary()["learner_tail_s"] == 0.0
    assert hidden.summary()["rollout_stage_s"] == pytest.approx(30.0)
    # Without the step's rollout (the last step) every second of the learner's is tail.
    alone = timeline(3, trajectories=[], **common).summary()
    assert alone["learner_tail_s"] == pytest.approx(21.0)
    assert alone["rollout_stage_s"] == 0.0


def test_flop_ledger_and_staleness_histogram() -> None:
    ledger = FlopLedger(n_params=1000)
    ledger.add(forward=10, backward=10)
    assert ledger.flops == 6 * 1000 * 10
    assert staleness_tokens([(3, 5), (2, 4), (3, 1)], learner_version=3) == {"0": 6, "1": 4}


def test_inflight_swaps_count_trajectories_that_span_versions() -> None:
    from thundersync_core.batch import Segment, Trajectory  # noqa: PLC0415

    def traj(versions: list[int] | None) -> Trajectory:
        meta = None if versions is None else {"turn_versions": versions}
        return Trajectory("g", "t", (1,), (Segment.action([2]),), 0.0, metadata=meta)

    batch = [traj([3, 3, 4]), traj([4, 4]), traj(None), traj([2, 3]), traj([5])]
    assert inflight_swaps(batch) == 2
    assert inflight_swaps([]) == 0


def test_release_trace_keeps_one_queue_per_learner_rank() -> None:
    """A learner group's step lists each rank's sources; the trace must not merge them."""
    from thundersync_core.perfmodel.trace import predict_from_trace  # noqa: PLC0415
    from thundersync_core.recording import release_trace  # noqa: PLC0415
    from thundersync_core.schedules.base import StepOutcome  # noqa: PLC0415

    def source(i: int, release: float) -> dict:
        return {"id": f"g{i}/0", "release_s": 100.0 + release, "service_s": 2.0}

    rank0, rank1 = [source(0, 1.0), source(1, 1.0)], [source(2, 1.0), source(3, 1.0)]
    learner = {"services": rank0 + rank1, "rank_services": [rank0, rank1], "barrier_s": 0.5}
    line = StepTimeline(step=3, start_s=100.0, end_s=110.0, publication=(109.0, 109.5))
    trace = release_trace(StepOutcome(step=3, timeline=line, learner=learner))
    assert [[s["id"] for s in r["sources"]] for r in trace["ranks"]] == [
        ["g0/0", "g1/0"],
        ["g2/0", "g3/0"],
    ]
    assert trace["ranks"][1]["sources"][0]["release_s"] == pytest.approx(1.0)
    assert trace["suffix_s"] == pytest.approx(1.0)
    # Two ranks drain the four 2 s sources in 4 s after the release; one queue would take 8 s.
    prediction = predict_from_trace(trace)
    assert prediction["ranks"] == 2
    assert prediction["thundersync"]["step_s"] == pytest.approx(1.0 + 4.0 + 1.0)

    single = release_trace(
        StepOutcome(step=3, timeline=line, learner={**learner, "rank_services": None})
    )
    assert len(single["ranks"]) == 1
    assert len(single["ranks"][0]["sources"]) == 4


def test_dev_tasks_take_families_in_turn_and_leave_out_what_the_policy_saw(tmp_path: Path) -> None:
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    from thundersync_core.pools import dev_tasks  # noqa: PLC0415

    def table(rows: list[tuple[str, str, str]], path: Path) -> Path:
        names = ("task_id", "family", "instruction")
        cols = {name: [r[i] for r in rows] for i, name in enumerate(names)}
        cols["path"] = [f"tasks/{r[0]}" for r in rows]
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(cols), path)
        return path

    prep = tmp_path / "prep"
    table(
        [(f"toyterm-count-000{i}", "count", f"count the words in w{i}.txt") for i in range(3)]
        + [(f"toyterm-grep-000{i}", "grep", f"grep for x in g{i}.txt") for i in range(2)]
        + [("toyterm-perms-0000", "perms", "make p.sh executable")],
        prep / "terminal" / "dev.parquet",
    )
    assert dev_tasks(prep, (), 4) == (
        ["toyterm-count-0000", "toyterm-grep-0000", "toyterm-perms-0000", "toyterm-count-0001"],
        0,
    )
    assert dev_tasks(prep, ("count",), 9) == ([f"toyterm-count-000{i}" for i in range(3)], 0)

    # A repeat matches whatever the case and white space; folders and tables both count.
    def task_folder(root: Path, instruction: str) -> None:
        (root / "tests").mkdir(parents=True)
        (root / "tests" / "test.sh").write_text("exit 0\n")
        (root / "instruction.md").write_text(instruction)

    seen = tmp_path / "seen" / "toyterm-count-0099"
    task_folder(seen, "Count the words  in W1.txt\n")
    # A task table names its folders relative to itself (or to its prep folder).
    task_folder(tmp_path / "tasks" / "x", "GREP for x in g0.txt")
    other = table([("x", "grep", "")], tmp_path / "other.parquet")
    ids, left_out = dev_tasks(prep, (), 9, [seen.parent, other])
    assert left_out == 2
    assert ids == ["toyterm-count-0000", "toyterm-grep-0001", "toyterm-perms-0000",
                   "toyterm-count-0002"]  # fmt: skip
    assert dev_tasks(prep, (), 0, [seen.parent]) == ([], 0)
    (tmp_path / "notes.txt").write_text("not a table")
    with pytest.raises(ValueError, match=r"tasks\.dev_exclude: .*notes\.txt is not a task table"):
        dev_tasks(prep, (), 9, [tmp_path / "notes.txt"])
    with pytest.raises(FileNotFoundError, match=r"tasks\.dev_exclude: .*nope"):
        dev_tasks(prep, (), 9, [tmp_path / "nope"])
    with pytest.raises(FileNotFoundError, match=r"tasks\.prep_dir"):
        dev_tasks(tmp_path / "empty", (), 9)


def test_packs_apply_to_the_per_source_grpo_learner_on_one_rank_only() -> None:
    base = {"learner_pack_tokens": 4096}
    for schedule in ("sync", "thundersync", "async", "pipeline"):
        assert load_config(None, base | {"schedule": schedule}).packs, schedule
    assert load_config(None, base | {"learner_order": "fixed"}).packs
    for other in (
        {"objective": "opd"},
        {"schedule": "sync", "sync_learner": "batched"},
        {"resources.learner.ranks": 2},
        {"learner_pack_tokens": 0},
    ):
        assert not load_config(None, base | other).packs, other


def test_a_shared_dev_before_must_have_measured_the_same_thing(tmp_path: Path) -> None:
    import json  # noqa: PLC0415

    from thundersync_core.train import dev_before_key, shared_dev_before  # noqa: PLC0415

    config = load_config(CONFIGS / "train_embedded.yaml")
    key = dev_before_key(config, tmp_path / "policy", ["a", "b"])
    # Not the schedule: the schedules of one experiment share it.
    assert (
        dev_before_key(
            config.model_copy(update={"schedule": "sync"}), tmp_path / "policy", ["a", "b"]
        )
        == key
    )
    others = [
        dev_before_key(config, tmp_path / "other", ["a", "b"]),
        dev_before_key(config, tmp_path / "policy", ["a"]),
        dev_before_key(config.model_copy(update={"seed": 1}), tmp_path / "policy", ["a", "b"]),
    ]
    assert key not in others
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"dev_before": {"pass_rate": 0.5, "key": key}}))
    assert shared_dev_before(summary, key)["pass_rate"] == 0.5
    with pytest.raises(ValueError, match=r"tasks.dev_before_from: .*summary.json: measured other"):
        shared_dev_before(summary, others[0])
    summary.write_text(json.dumps({"status": "failed"}))
    with pytest.raises(ValueError, match="has no dev_before"):
        shared_dev_before(summary, key)
    with pytest.raises(ValueError, match=r"not a readable summary\.json"):
        shared_dev_before(tmp_path / "missing.json", key)


@pytest.mark.parametrize(
    ("schedule", "objective", "top_k", "expected"),
    [
        ("sync", "grpo", 0, "none"),
        ("thundersync", "opd", 16, "none"),
        ("async", "grpo", 0, "truncated_is"),
        ("pipeline", "opd", 0, "truncated_is"),
        ("async", "opd", 16, "exact_kl"),
        ("pipeline", "opd", 16, "exact_kl"),
    ],
)
def test_the_step_record_names_the_correction_the_learner_applies(
    micro32, schedule, objective, top_k, expected
) -> None:
    from thundersync_core.config import TrainConfig  # noqa: PLC0415
    from thundersync_core.recording import off_policy_correction  # noqa: PLC0415
    from thundersync_core.runtime.learner_worker import build_learner  # noqa: PLC0415

    config = TrainConfig(schedule=schedule, objective=objective, opd_teacher_top_k=top_k)
    assert off_policy_correction(config) == expected
    learner = build_learner(config, micro32, 0)
    # Weights are computed only off-policy; the top-k KL leaves them out of its loss.
    assert (learner.is_clip is not None) == (expected != "none")
    assert bool(getattr(learner, "teacher_top_k", 0)) == (expected == "exact_kl" or top_k > 0)
