"""The experiment's schedule table, from run folders written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tasks.schedules_table import (
    dev_interval,
    learner_name,
    paired_counts,
    schedule_rows,
    schedules_markdown,
)
from thundersync_core.config import load_config


def write_run(folder: Path, walls, tails, stale, swaps, before, after, rewards=None) -> dict:
    folder.mkdir(parents=True)
    rewards = rewards or [0.5] * len(walls)
    records = [
        {
            "step": i,
            "step_wall_s": w,
            "learner_tail_s": t,
            "staleness_tokens": {"0": 10 - s, "1": s},
            "inflight_swaps": n,
            "reward_mean": r,
        }
        for i, (w, t, s, n, r) in enumerate(zip(walls, tails, stale, swaps, rewards, strict=True))
    ]
    config = {"schedule": folder.name, "objective": "grpo", "learner_pack_tokens": 4096,
              "learner_order": "fixed", "resources": {"learner": {"ranks": 1}}}  # fmt: skip
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    dev = lambda solved: {  # noqa: E731
        "pass_rate": sum(solved.values()) / (2 * len(solved)),
        "tasks": len(solved),
        "samples": 2,
        "solved": solved,
    }
    (folder / "summary.json").write_text(
        json.dumps({"dev_before": dev(before), "dev_after": dev(after)})
    )
    return {"schedule": folder.name, "run_dir": str(folder)}


def test_rows_hold_speedups_tail_shares_staleness_and_paired_dev_counts(tmp_path: Path) -> None:
    before = {"a": 0, "b": 1, "c": 2, "d": 1}
    runs = [
        write_run(tmp_path / "sync", [10, 12, 11], [4, 5, 6], [0, 0, 0], [0, 0, 0], before,
                  {"a": 1, "b": 1, "c": 2, "d": 0}),
        write_run(tmp_path / "pipeline", [5, 6, 7], [0.5, 1, 0.25], [0, 5, 5], [0, 3, 0], before,
                  {"a": 2, "b": 2, "c": 1, "d": 1}, rewards=[0.5, 0.25, 0.5]),
    ]  # fmt: skip
    rows = {r["schedule"]: r for r in schedule_rows(runs)}
    assert rows["sync"]["speedup"] == 1.0
    assert rows["pipeline"]["speedup"] == pytest.approx(11 / 6)
    assert rows["pipeline"]["tail_share_of_baseline"] == pytest.approx(0.5 / 5)
    assert rows["pipeline"]["stale_token_share"] == pytest.approx(10 / 30)
    assert rows["sync"]["stale_token_share"] == 0.0
    assert (rows["pipeline"]["inflight_swap_steps"], rows["pipeline"]["inflight_swaps"]) == (1, 3)
    assert (rows["sync"]["tasks_gained"], rows["sync"]["tasks_lost"]) == (1, 1)
    assert (rows["pipeline"]["tasks_gained"], rows["pipeline"]["tasks_lost"]) == (2, 1)
    table = schedules_markdown(list(rows.values()))
    assert "| pipeline | 3 | 6.00 | 1.83x | 0.50 | 10% | 33% | 1/3 |" in table
    assert "+1/-1 | per-source, packs <= 4096 tokens, id order | 3/3 |" in table  # sync
    # The pipeline packs as well; its rewards match sync's at 2 of 3 steps.
    assert "+2/-1 | per-source, packs <= 4096 tokens, id order | 2/3 |" in table
    assert "4 tasks x 2 samples" in table


def test_dev_interval_is_over_per_task_rates() -> None:
    dev = {"samples": 2, "solved": {"a": 0, "b": 2, "c": 1, "d": 1}}
    low, high = dev_interval(dev)
    # Rates 0, 1, .5, .5: mean .5, sample sd sqrt(1/6), se sd/2.
    assert (low + high) / 2 == pytest.approx(0.5)
    assert high - low == pytest.approx(2 * 1.96 * (1 / 6) ** 0.5 / 2)
    assert dev_interval({"samples": 2, "solved": {"a": 1}}) is None
    assert paired_counts({"solved": {"a": 1}}, {"solved": {"a": 1, "b": 2}}) == (0, 0)


def test_learner_names_follow_the_config() -> None:
    def name(**fields) -> str:
        return learner_name(load_config(None, fields))

    assert name(schedule="sync", sync_learner="batched") == "batched"
    assert name(schedule="thundersync", sync_learner="batched") == "per-source"
    packed = {"schedule": "thundersync", "learner_pack_tokens": 512}
    assert name(**packed) == "per-source, packs <= 512 tokens"
    assert name(**packed, objective="opd") == "per-source"  # packs are GRPO's
    assert name(**packed, **{"resources.learner.ranks": 2}) == "per-source"
    assert name(schedule="async", learner_order="fixed") == "per-source, id order"
