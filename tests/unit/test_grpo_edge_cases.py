"""Defined results or clear refusals for the corner cases of a GRPO batch."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.helpers import random_batch, reference_grad_j, rel_diff
from thundersync_core.batch import Segment, Trajectory
from thundersync_core.policy import build_model
from thundersync_core.streaming import (
    LearnerRefusal,
    StreamingGRPOLearner,
    SyncGRPOLearner,
    groups_of,
)

LEARNERS = [SyncGRPOLearner, StreamingGRPOLearner]


def with_reward(traj: Trajectory, reward: float) -> Trajectory:
    return dataclasses.replace(traj, reward=reward)


def run(learner, batch):
    learner.begin_batch(groups_of(batch))
    for traj in batch:
        learner.submit(traj)
    return learner.finish()


@pytest.mark.parametrize("cls", LEARNERS)
def test_uniform_reward_groups_contribute_exactly_zero(micro64, cls):
    batch = random_batch(seed=2, vocab=1024, n_groups=2, group_size=3)
    uniform = [with_reward(t, 0.3) for t in batch]  # 0.3 * 3 / 3 != 0.3 in binary
    result = run(cls(micro64), uniform)
    assert result.objective == 0.0
    assert all(bool((g == 0).all()) for g in result.grad_objective.values())


@pytest.mark.parametrize("cls", LEARNERS)
def test_single_trajectory_groups_contribute_zero_but_count_in_g(micro64, cls):
    batch = random_batch(seed=4, vocab=1024, n_groups=2, group_size=4)
    single = random_batch(seed=9, vocab=1024, n_groups=1, group_size=1)
    single = [dataclasses.replace(t, group_id="solo", trajectory_id="solo-0") for t in single]
    alone = run(cls(micro64), batch)
    mixed = run(cls(micro64), batch + single)
    # seq-sum divides by G, and G counts the single-trajectory group.
    for name, g in alone.grad_objective.items():
        torch.testing.assert_close(mixed.grad_objective[name], g * 2 / 3, rtol=1e-12, atol=0)


@pytest.mark.parametrize("cls", LEARNERS)
def test_empty_action_segments_change_nothing(micro64, cls):
    batch = random_batch(seed=6, vocab=1024, n_groups=2, group_size=3)
    padded = [
        dataclasses.replace(t, segments=(Segment.action([]), *t.segments, Segment.action([])))
        for t in batch
    ]
    plain, with_empty = run(cls(micro64), batch), run(cls(micro64), padded)
    assert rel_diff(plain.grad_objective, with_empty.grad_objective) <= 1e-12


@pytest.mark.parametrize("cls", LEARNERS)
def test_trajectory_with_nothing_scored_still_sets_the_group_mean(micro64, cls):
    batch = random_batch(seed=8, vocab=1024, n_groups=2, group_size=3)
    blank = dataclasses.replace(batch[0], segments=(Segment.observation([5, 6]),))
    batch = [blank, *batch[1:]]
    _, ref = reference_grad_j(micro64, batch)
    assert rel_diff(ref, run(cls(micro64), batch).grad_objective) <= 1e-10


def test_one_token_prompt_has_no_shared_prefix(micro64):
    batch = [dataclasses.replace(t, prompt_ids=(17,)) for t in random_batch(1, 1024, 2, 3)]
    _, ref = reference_grad_j(micro64, batch)
    result = run(StreamingGRPOLearner(micro64), batch)
    assert rel_diff(ref, result.grad_objective) <= 1e-10
    assert result.counters["prefix_replays"] == 0


@pytest.mark.parametrize("cls", LEARNERS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_refused_naming_the_trajectory(micro64, cls, bad):
    batch = random_batch(seed=1, vocab=1024, n_groups=1, group_size=2)
    learner = cls(micro64)
    learner.begin_batch(groups_of(batch))
    with pytest.raises(LearnerRefusal, match=r"g0-t1.*not finite"):
        learner.submit(with_reward(batch[1], bad))


@pytest.mark.parametrize("cls", LEARNERS)
def test_step_refused_while_a_group_is_open(micro64, cls):
    batch = random_batch(seed=1, vocab=1024, n_groups=2, group_size=2)
    micro64.zero_grad(set_to_none=True)
    learner = cls(micro64)
    learner.begin_batch(groups_of(batch))
    for traj in batch[:-1]:
        learner.submit(traj)
    with pytest.raises(LearnerRefusal, match=r"g1 \(1/2\)"):
        learner.assert_safe_to_step()
    with pytest.raises(LearnerRefusal, match="still open"):
        learner.finish()
    assert all(p.grad is None for p in micro64.parameters())


def test_parameter_change_before_the_barrier_is_refused():
    model = build_model("micro", seed=0, dtype=torch.float64)
    batch = random_batch(seed=1, vocab=1024, n_groups=1, group_size=3)
    learner = StreamingGRPOLearner(model)
    learner.begin_batch(groups_of(batch))
    learner.submit(batch[0])
    with torch.no_grad():
        model.model.norm.weight.mul_(1.01)
    with pytest.raises(LearnerRefusal, match=r"model\.norm\.weight.*version guard"):
        learner.submit(batch[1])


def test_sources_from_another_policy_version_are_refused(micro64):
    batch = random_batch(seed=1, vocab=1024, n_groups=1, group_size=2)
    learner = StreamingGRPOLearner(micro64, policy_version=4)
    learner.begin_batch(groups_of(batch))
    with pytest.raises(LearnerRefusal, match="policy version 0; this batch trains version 4"):
        learner.submit(batch[0])


def test_duplicates_and_unknown_groups_are_refused(micro64):
    batch = random_batch(seed=1, vocab=1024, n_groups=1, group_size=3)
    learner = SyncGRPOLearner(micro64)
    learner.begin_batch(groups_of(batch))
    learner.submit(batch[0])
    with pytest.raises(LearnerRefusal, match="submitted twice"):
        learner.submit(batch[0])
    with pytest.raises(LearnerRefusal, match="not registered"):
        learner.submit(dataclasses.replace(batch[1], group_id="nope"))


def test_admission_cap_bounds_live_statistics(micro64):
    batch = random_batch(seed=3, vocab=1024, n_groups=4, group_size=2)
    # Round-robin arrival opens every group at once unless the cap holds them back.
    order = [batch[i] for i in (0, 2, 4, 6, 1, 3, 5, 7)]
    learner = StreamingGRPOLearner(micro64, max_open_groups=1)
    learner.begin_batch(groups_of(batch))
    peak_bytes = 0
    for traj in order:
        learner.submit(traj)
        peak_bytes = max(peak_bytes, learner.live_statistics_bytes())
    result = learner.finish()
    params_bytes = sum(p.numel() * 8 for p in micro64.parameters())
    assert result.counters["peak_open_groups"] == 1
    assert result.counters["sources_held"] == 3
    assert params_bytes * 2 <= peak_bytes < params_bytes * 2.5  # one group: x1 and x2
    _, ref = reference_grad_j(micro64, batch)
    assert rel_diff(ref, result.grad_objective) <= 1e-10


def test_step_applies_once_and_advances_the_version():
    model = build_model("micro", seed=0, dtype=torch.float64)
    batch = random_batch(seed=1, vocab=1024, n_groups=2, group_size=3)
    learner = StreamingGRPOLearner(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.model.norm.weight.detach().clone()
    learner.begin_batch(groups_of(batch))
    for traj in batch:
        learner.submit(traj)
    result = learner.step(optimizer)
    expected = before + 0.1 * result.grad_objective["model.norm.weight"]  # ascent on J
    torch.testing.assert_close(model.model.norm.weight.detach(), expected)
    assert learner.policy_version == 1


def test_micro_batched_sync_equals_one_batch(micro64):
    batch = random_batch(seed=12, vocab=1024, n_groups=3, group_size=4)
    whole = run(SyncGRPOLearner(micro64), batch)
    small = SyncGRPOLearner(micro64, micro_batch_tokens=40)
    pieces = run(small, batch)
    assert rel_diff(whole.grad_objective, pieces.grad_objective) <= 1e-12
    assert pieces.objective == pytest.approx(whole.objective, rel=1e-12)
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 1"):
        SyncGRPOLearner(micro64, micro_batch_tokens=0)


@pytest.mark.parametrize("cls", LEARNERS)
def test_a_discarded_batch_leaves_nothing_behind(micro64, cls):
    """A timing pass (the bench's contention measurement) runs sources in a batch it then
    drops: the next batch's gradient is the plain reference's, the parameters unchanged."""
    before = {n: p.detach().clone() for n, p in micro64.named_parameters()}
    other = random_batch(seed=11, vocab=1024, n_groups=2, group_size=3)
    batch = random_batch(seed=12, vocab=1024, n_groups=2, group_size=3)
    learner = cls(micro64)
    learner.begin_batch(groups_of(other))
    for traj in other[:4]:
        learner.submit(traj)
    learner.discard_batch()
    assert not learner.in_batch
    assert all(p.grad is None for p in micro64.parameters())
    assert all(torch.equal(p, before[n]) for n, p in micro64.named_parameters())
    _, ref = reference_grad_j(micro64, batch)
    assert rel_diff(ref, run(learner, batch).grad_objective) <= 1e-10
    with pytest.raises(LearnerRefusal, match="outside a batch"):
        learner.discard_batch()
