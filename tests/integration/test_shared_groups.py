"""Open GRPO groups shared by the learner ranks, their statistics 1/W per rank, at 2 and 4
gloo ranks (``parallel/shared_groups.py``).

Against the plain reference gradient (one backward of the whole batch loss, one process):
float64 within 1e-10 and float32 within 1e-5, for trajectories landing one at a time and in
bursts (so ticks hand one rank or several their trajectories), with one open group and
with several; each rank holds 1/W of the open groups' statistics; a rank that refuses a
tick makes every rank refuse it at once.
"""

from __future__ import annotations

import pytest
import torch

from tests import dp_workers
from tests.helpers import reference_grad_j, reference_grad_l, rel_diff
from thundersync_core.batch import Segment, Trajectory
from thundersync_core.parallel.data_parallel import shard_rows
from thundersync_core.parallel.shared_groups import TickPlanner
from thundersync_core.policy import build_model
from thundersync_core.streaming import LearnerRefusal

pytestmark = pytest.mark.integration

#: (burst, open groups over all ranks, dtype)
CASES = [
    "shared:1:1:fp64",
    "shared:3:2:fp64",
    "shared:4:4:fp32",
    "shared_refusal",
    "opd_sharded",
]
TOLERANCE = {"fp64": 1e-10, "fp32": 1e-5}


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def ranks(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"shared-{world}")
    return world, dp_workers.run_ranks(world, out, CASES)


@pytest.mark.parametrize("case", CASES[:3])
def test_shared_groups_give_the_batch_gradient(ranks, case):
    world, results = ranks
    per_rank = results[case]
    _, burst, cap, precision = case.split(":")
    dtype = torch.float64 if precision == "fp64" else torch.float32
    objective, reference = reference_grad_j(
        build_model("micro", seed=3, dtype=dtype), dp_workers.grpo_batch(31), "seq-sum"
    )
    stacked = {name: torch.cat([r["grads"][name] for r in per_rank], dim=0) for name in reference}
    for rank, r in enumerate(per_rank):
        for name, full in reference.items():
            start, stop = shard_rows(full.shape[0], world, rank)
            assert r["grads"][name].shape == full[start:stop].shape, name
        assert r["objective"] == pytest.approx(objective, rel=TOLERANCE[precision])
        assert r["n_groups"] == 4
        assert r["peak_open"] <= int(cap)
        # Each rank's rows of x1 and x2: 1/W of two gradient-sized buffers per open group.
        element = 8 if precision == "fp64" else 4
        whole_pair = r["param_bytes"] // 8 * element * 2
        assert r["peak_stats_bytes"] <= int(cap) * whole_pair / world * 1.1
        assert r["peak_stats_bytes"] > 0
    assert rel_diff(reference, stacked) <= TOLERANCE[precision]
    ticks = per_rank[0]["ticks"]
    assert all(r["ticks"] == ticks for r in per_rank), "every rank runs the same ticks"
    assert sum(len(t) for t in ticks) == 12
    if burst != "1":
        assert max(len(t) for t in ticks) > 1, "some tick hands several ranks a trajectory"


def test_a_refusing_rank_stops_every_rank_at_once(ranks):
    _world, results = ranks
    errors = [r["error"] for r in results["shared_refusal"]]
    assert "policy version 5" in errors[1]
    for rank, error in enumerate(errors):
        if rank != 1:
            assert error is not None
            assert "rank(s) [1] refused a tick" in error
    assert max(r["elapsed_s"] for r in results["shared_refusal"]) < 30


def test_opd_turns_with_the_sharded_gradient_give_the_batch_gradient(ranks):
    """OPD's parameter side over ranks: whole groups per rank (their key/value ledgers), the
    batch gradient 1/W per rank, flushed after every turn: no rank holds it whole."""
    world, results = ranks
    per_rank = results["opd_sharded"]
    batch = dp_workers.opd_batch()
    model = build_model("micro", seed=3, dtype=torch.float32)
    objective, reference = reference_grad_l(model, batch)
    stacked = {name: torch.cat([r["grads"][name] for r in per_rank], dim=0) for name in reference}
    assert rel_diff(reference, stacked) <= TOLERANCE["fp32"]
    for r in per_rank:
        assert r["sharded"]
        assert r["objective"] == pytest.approx(objective, rel=TOLERANCE["fp32"])
        assert 0 < r["held_bytes"] <= r["param_bytes"] / world * 1.05


def _traj(group: str, index: int, reward: float) -> Trajectory:
    return Trajectory(
        trajectory_id=f"{group}-{index}",
        group_id=group,
        prompt_ids=(1, 2),
        segments=(Segment.action([3]),),
        reward=reward,
    )


def test_tick_planner_hands_one_trajectory_per_rank_and_holds_new_groups_at_the_cap():
    planner = TickPlanner(2, 1, {"a": 2, "b": 2})
    for traj in (_traj("a", 0, 1.0), _traj("b", 0, 0.0), _traj("b", 1, 1.0)):
        planner.add(traj)
    first = planner.next_tick()
    # "a" is open and the cap is one group: b's trajectories wait.
    assert [(e.rank, e.trajectory_id) for e, _ in first] == [(0, "a-0")]
    assert planner.next_tick() == []
    planner.add(_traj("a", 1, 0.0))
    second = planner.next_tick()
    assert [e.trajectory_id for e, _ in second] == ["a-1"]  # a closes in this tick
    third = planner.next_tick()
    assert [(e.rank, e.trajectory_id) for e, _ in third] == [(0, "b-0"), (1, "b-1")]
    assert not planner.pending
    with pytest.raises(LearnerRefusal, match="group 'c' is not registered"):
        planner.add(_traj("c", 0, 0.0))
    with pytest.raises(LearnerRefusal, match="already has 2 trajectories"):
        planner.add(_traj("a", 2, 0.0))
