"""Allocation planner: roofline decoding by hand, pruning rules, the 8-GPU example."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from thundersync_core.perfmodel.config import (
    PlanConfig,
    ResponseConfig,
    RooflineConfig,
    load_plan_config,
)
from thundersync_core.perfmodel.planner import decode_engine, plan, response_lengths

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "plan_example.yaml"


def test_roofline_latency() -> None:
    roofline = RooflineConfig(floor_s_per_token=0.02, compute_s_per_seq=1e-3, max_concurrency=64)
    assert roofline.step_latency_s(1) == pytest.approx(0.02)  # memory-bound
    assert roofline.step_latency_s(40) == pytest.approx(0.04)  # compute-bound


def test_decode_engine_by_hand() -> None:
    # Two sequences share steps at latency(2) = 1.2 s until the short one ends (10 steps),
    # then the long one decodes alone at the floor (1 s) for its last 10 steps.
    roofline = RooflineConfig(floor_s_per_token=1.0, compute_s_per_seq=0.6, max_concurrency=8)
    assert decode_engine([10.0, 20.0], roofline) == pytest.approx([12.0, 22.0])
    # Concurrency 1: the second waits for the first (a wave).
    single = RooflineConfig(floor_s_per_token=1.0, compute_s_per_seq=0.6, max_concurrency=1)
    assert decode_engine([10.0, 20.0], single) == pytest.approx([10.0, 30.0])


def test_response_lengths_are_stratified() -> None:
    responses = ResponseConfig(
        median_tokens=1000, sigma=0.2, straggler_prob=0.01, straggler_extra_tokens=5000
    )
    lengths = response_lengths(responses, 512)
    assert len(lengths) == 512
    assert int(np.sum(lengths > 5000)) == 5  # round(512 * 0.01)
    assert float(np.median(lengths)) == pytest.approx(1000, rel=0.01)


def test_example_reproduces_the_straggler_scenario() -> None:
    result = plan(load_plan_config(EXAMPLE))
    batch = result["batch"]
    # Sync with every GPU decoding: 99% of samples by ~40 s, the last 1% ~80 s more.
    assert batch["sync_rollout_p99_s"] == pytest.approx(40.0, abs=2.0)
    assert batch["sync_straggler_tail_s"] == pytest.approx(80.0, abs=5.0)
    winner = result["winner"]
    assert winner["schedule"] == "pipeline"
    assert winner["rollout_devices"] + winner["learner_devices"] == 8
    assert 1.3 < winner["speedup_vs_sync"] < 3.0
    best = result["best_per_schedule"]
    # The stragglers stay on the critical path of the batch-synchronous schedules.
    assert best["pipeline"]["speedup_vs_sync"] > best["async"]["speedup_vs_sync"]
    assert best["async"]["speedup_vs_sync"] > 1.0
    assert best["thundersync"]["speedup_vs_sync"] > 1.0


def test_feasible_rows_obey_the_rules() -> None:
    config = load_plan_config(EXAMPLE)
    result = plan(config)
    speeds = [row["samples_per_s"] for row in result["ranked"]]
    assert speeds == sorted(speeds, reverse=True)
    for row in result["ranked"]:
        assert row["max_lag"] <= config.max_staleness
        if row["schedule"] in ("async", "pipeline"):
            rates = [row["generation_samples_per_s"], row["learner_samples_per_s"]]
            assert min(rates) / max(rates) >= 1.0 - config.rate_tolerance
    assert result["pruned"]
    assert all(row["reason"] for row in result["pruned"])


def test_staleness_bound_prunes_async_and_pipeline() -> None:
    config = load_plan_config(EXAMPLE).model_copy(update={"max_staleness": 0})
    result = plan(config)
    assert {row["schedule"] for row in result["ranked"]} <= {"sync", "thundersync"}
    assert any("staleness" in row["reason"] for row in result["pruned"])


def test_looser_tolerance_keeps_more_rows() -> None:
    config = load_plan_config(EXAMPLE)
    strict = plan(config.model_copy(update={"rate_tolerance": 0.1}))
    loose = plan(config.model_copy(update={"rate_tolerance": 0.6}))
    assert len(loose["ranked"]) > len(strict["ranked"])


def test_teacher_split_is_swept() -> None:
    data = load_plan_config(EXAMPLE).model_dump()
    data["teacher"] = {"tokens_per_s_per_device": 4000.0}
    result = plan(PlanConfig.model_validate(data))
    rows = result["ranked"] + result["pruned"]
    teachers = {row["teacher_devices"] for row in rows if row["schedule"] != "sync"}
    assert min(teachers) == 1
    assert len(teachers) > 1
    for row in rows:
        if row["schedule"] != "sync":
            total = row["rollout_devices"] + row["learner_devices"] + row["teacher_devices"]
            assert total == 8
            assert row["teacher_samples_per_s"] is not None


def test_bad_config_names_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(EXAMPLE.read_text().replace("max_concurrency: 64", "max_concurrency: -3"))
    with pytest.raises(ValueError, match=r"plan\.yaml: sampling\.max_concurrency"):
        load_plan_config(path)
    path.write_text("devices: 8\nbatch_size: 4\nlearner: {}\nbogus: 1\n")
    with pytest.raises(ValueError, match=r"learner\.tokens_per_s_per_device.*bogus"):
        load_plan_config(path)
