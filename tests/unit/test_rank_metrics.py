"""One step record from a learner group's ranks (``merge_rank_metrics``)."""

from __future__ import annotations

from thundersync_core.runtime.learner_group import merge_rank_metrics


def _record(rank: int, counters: dict[str, int]) -> dict:
    return {
        "loss": 0.5,
        "intervals": [(rank, rank + 1.0)],
        "releases": [],
        "services": [{"id": f"t{rank}"}],
        "token_versions": [],
        "flops": 10.0 * (rank + 1),
        "counters": counters,
        "peak_memory_bytes": 100 * (rank + 1),
        "learner_done_s": 5.0 + rank,
    }


def test_work_is_summed_and_peaks_are_the_largest_ranks():
    merged = merge_rank_metrics(
        [
            _record(0, {"trajectory_backwards": 3, "peak_open_groups": 2, "ticks": 4}),
            _record(1, {"trajectory_backwards": 2, "peak_open_groups": 3, "ticks": 0}),
        ]
    )
    assert merged["counters"] == {"trajectory_backwards": 5, "peak_open_groups": 3, "ticks": 4}
    assert merged["flops"] == 30.0
    assert merged["peak_memory_bytes"] == 200
    assert merged["peak_memory_per_rank_bytes"] == [100, 200]
    assert merged["learner_done_s"] == 6.0
    assert [s["id"] for s in merged["services"]] == ["t0", "t1"]
    assert merged["rank_services"] == [[{"id": "t0"}], [{"id": "t1"}]]
