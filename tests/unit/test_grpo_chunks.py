"""Chunks: a group's planned ids cut into runs, each run as soon as it may, still exact.

With ``chunks`` > 1 (``order="fixed"``, packs, ids planned in ``GroupSpec.members``) a chunk
whose members have landed with two reward values runs at once (one backward of sum_i S_i
per reward value and pack), and its gradient waits for the group's close, which weights it
by that value's advantage. Checked against the independent reference (full-sequence
forwards, one backward of the summed loss) at float64 1e-10 and float32 1e-5, for 0/1 and
graded rewards, several arrival orders, chunkings and pack bounds; and bitwise against the
whole batch handed over at once (what sync does), whatever the arrival.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import random_batch, reference_grad_j, rel_diff
from thundersync_core.batch import Trajectory
from thundersync_core.streaming import StreamingGRPOLearner, groups_of
from thundersync_core.streaming.base import GroupSpec, LearnerRefusal

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


#: 0/1 rewards by trajectory index: g0's two chunks (of two) mixed, g1 uniform (all
#: advantages 0), g2's first chunk all 0 (it waits for the close), its second mixed.
PATTERN = {"g0": [1, 0, 1, 0, 0, 1], "g1": [1] * 6, "g2": [0, 0, 0, 1, 0, 0]}


def _binary(batch: list[Trajectory]) -> list[Trajectory]:
    return [
        t.__class__(**{**t.__dict__, "reward": float(
            PATTERN[t.group_id][int(t.trajectory_id.rsplit("-t", 1)[1])])})
        for t in batch
    ]  # fmt: skip


@pytest.fixture(scope="module")
def graded():
    return random_batch(seed=31, vocab=1024, n_groups=3, group_size=6)


@pytest.fixture(scope="module")
def binary(graded):
    return _binary(graded)


def _learner(model, chunks: int, **kwargs) -> StreamingGRPOLearner:
    return StreamingGRPOLearner(model, order="fixed", chunks=chunks, **kwargs)


def run_arrival(learner, batch, *, seed: int, pack_tokens: int):
    """``batch`` in a seeded arrival order, in chunks of seeded random sizes."""
    rng = random.Random(seed)
    order = rng.sample(batch, len(batch))
    learner.begin_batch(groups_of(batch, with_members=True))
    while order:
        size = rng.randint(1, len(order))
        part, order = order[:size], order[size:]
        learner.submit_many(part, pack_tokens=pack_tokens)
    return learner.finish()


def at_once(learner, batch, *, pack_tokens: int):
    learner.begin_batch(groups_of(batch, with_members=True))
    learner.submit_many(sorted(batch, key=lambda t: t.trajectory_id), pack_tokens=pack_tokens)
    return learner.finish()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("rewards", ["binary", "graded"])
@pytest.mark.parametrize(("chunks", "pack_tokens"), [(2, 16), (2, 10_000), (3, 10_000), (6, 64)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunks_match_the_reference(
    micro64, micro32, graded, binary, dtype, rewards, chunks, pack_tokens, seed
):
    model = micro64 if dtype == torch.float64 else micro32
    batch = binary if rewards == "binary" else graded
    ref_objective, ref_grads = reference_grad_j(model, batch, "token-mean")
    learner = _learner(model, chunks, loss_agg="token-mean")
    result = run_arrival(learner, batch, seed=seed, pack_tokens=pack_tokens)
    assert rel_diff(ref_grads, result.grad_objective) <= TOLERANCE[dtype]
    assert result.objective == pytest.approx(ref_objective, rel=TOLERANCE[dtype], abs=1e-12)
    assert result.counters["groups_closed"] == 3
    assert result.counters["trajectory_backwards"] == 0
    assert learner.live_statistics_bytes() == 0


@pytest.mark.parametrize("rewards", ["binary", "graded"])
@pytest.mark.parametrize(("chunks", "pack_tokens"), [(2, 16), (2, 10_000), (3, 64)])
def test_chunks_are_bitwise_the_whole_batch_at_once(micro32, graded, binary, rewards, chunks,
                                                    pack_tokens):  # fmt: skip
    batch = binary if rewards == "binary" else graded
    whole = at_once(_learner(micro32, chunks), batch, pack_tokens=pack_tokens)
    early = 0
    for seed in range(5):
        result = run_arrival(_learner(micro32, chunks), batch, seed=seed, pack_tokens=pack_tokens)
        for name, grad in whole.grad_objective.items():
            assert torch.equal(result.grad_objective[name], grad), (seed, name)
        assert result.objective == whole.objective
        assert result.counters["pack_backwards"] == whole.counters["pack_backwards"]
        early += result.counters["chunks_run_early"]
    assert whole.counters["chunks_run_early"] == 0
    assert early > 0, "some arrival should have run a chunk before its group closed"


def test_a_mixed_chunk_runs_before_its_group_closes(micro64, binary):
    members = sorted((t for t in binary if t.group_id == "g0"), key=lambda t: t.trajectory_id)
    first = members[:3]  # chunk 0 of two
    assert len({t.reward for t in first}) == 2, "the fixture's first chunk has both rewards"
    learner = _learner(micro64, 2)
    learner.begin_batch(groups_of(binary, with_members=True))
    learner.submit_many(first, pack_tokens=10_000)
    counters = learner.counters_so_far()
    assert counters["chunks_run_early"] == 1
    assert counters["pack_backwards"] == 2  # one per reward value
    assert learner.live_statistics_bytes() > 0  # its two gradients wait for the close
    learner.submit_many(members[3:], pack_tokens=10_000)
    assert learner.counters_so_far()["groups_closed"] == 1


def test_a_single_valued_chunk_waits_and_a_uniform_group_takes_no_backward(micro64, binary):
    uniform = sorted((t for t in binary if t.group_id == "g1"), key=lambda t: t.trajectory_id)
    learner = _learner(micro64, 2)
    learner.begin_batch(groups_of(binary, with_members=True))
    learner.submit_many(uniform[:3], pack_tokens=10_000)
    assert learner.counters_so_far()["packed_trajectories"] == 0  # all 1: it may be uniform
    learner.submit_many(uniform[3:], pack_tokens=10_000)
    counters = learner.counters_so_far()
    assert counters["groups_closed"] == 1
    assert counters["packed_trajectories"] == 0
    assert counters["pack_backwards"] == 0
    assert counters["peak_open_groups"] == 0  # not even its prompt ran


def test_without_planned_ids_a_group_runs_whole(micro32, binary):
    # No members in the specs: the plan of chunks=1, bitwise.
    def run(chunks: int):
        learner = _learner(micro32, chunks)
        learner.begin_batch(groups_of(binary))
        learner.submit_many(binary, pack_tokens=10_000)
        return learner.finish()

    plain, chunked = run(1), run(3)
    assert chunked.counters["chunks_run"] == 0
    for name, grad in plain.grad_objective.items():
        assert torch.equal(chunked.grad_objective[name], grad), name


def test_an_unplanned_trajectory_id_is_refused_naming_it(micro64, binary):
    learner = _learner(micro64, 2)
    learner.begin_batch(groups_of(binary, with_members=True))
    stray = binary[0].__class__(**{**binary[0].__dict__, "trajectory_id": "g0-stray"})
    with pytest.raises(LearnerRefusal, match="'g0-stray' is not one of group 'g0'"):
        learner.submit_many([stray], pack_tokens=10_000)


def test_a_plan_with_the_wrong_ids_is_refused_naming_the_group(micro64):
    learner = _learner(micro64, 2)
    with pytest.raises(LearnerRefusal, match=r"group 'g7'.*3 distinct ids"):
        learner.begin_batch({"g7": GroupSpec((1, 2), 3, ("a", "a", "b"))})
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        _learner(micro64, 0)
