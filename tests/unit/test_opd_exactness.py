"""Streamed OPD (turn-level release) equals the sync update and a plain reference.

The reference runs one forward of each full trajectory and one backward of L; the streamed
learner never sees a full trajectory at once, so a missing or doubled boundary adjoint (a
later turn's gradient into an earlier turn's keys/values) shows up as an O(1) relative
error. Tolerances as for GRPO: float64 1e-10, float32 1e-5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import multi_turn_batch, reference_grad_l, rel_diff, run_opd_stream, run_opd_sync
from thundersync_core.batch import Segment, turns_of
from thundersync_core.objectives.opd import TeacherScoreError, split_by_turn
from thundersync_core.streaming import (
    GroupSpec,
    LearnerRefusal,
    StreamingOPDLearner,
    SyncOPDLearner,
    groups_of,
)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def run_stream(model, batch, seed):
    return run_opd_stream(model, batch, seed)


def run_sync(model, batch):
    return run_opd_sync(model, batch)


@pytest.fixture(scope="module")
def batch():
    return multi_turn_batch(seed=13, vocab=1024)


@pytest.fixture(scope="module")
def references(micro64, micro32, batch):
    return {
        torch.float64: reference_grad_l(micro64, batch),
        torch.float32: reference_grad_l(micro32, batch),
    }


def test_batch_has_one_to_six_turns(batch):
    counts = sorted(sum(s.kind == "action" for s in t.segments) for t in batch)
    assert counts == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_sync_and_stream_match_reference(micro64, micro32, batch, references, dtype):
    model = micro64 if dtype == torch.float64 else micro32
    ref_loss, ref_grads = references[dtype]
    sync = run_sync(model, batch)
    _, stream = run_stream(model, batch, seed=0)
    for result in (sync, stream):
        assert rel_diff(ref_grads, result.grad_objective) <= TOLERANCE[dtype]
        assert result.objective == pytest.approx(ref_loss, rel=TOLERANCE[dtype])
    assert rel_diff(sync.grad_objective, stream.grad_objective) <= TOLERANCE[dtype]
    # p.grad holds grad L itself: OPD's objective is minimised.
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, stream.grad_objective[name].to(p.dtype))
    model.zero_grad(set_to_none=True)


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    derandomize=True,
)
@given(order_seed=st.integers(0, 2**31))
def test_any_turn_arrival_order_is_exact(micro64, batch, references, order_seed):
    _, result = run_stream(micro64, batch, order_seed)
    assert rel_diff(references[torch.float64][1], result.grad_objective) <= 1e-10


def test_turn_gradient_exists_before_its_trajectory_is_complete(micro64, batch):
    """The learner works on turn 0 while later turns (and their tool calls) are pending."""
    traj = next(t for t in batch if sum(s.kind == "action" for s in t.segments) == 4)
    turns = turns_of(traj, split_by_turn(traj))
    learner = StreamingOPDLearner(micro64)
    learner.begin_batch(groups_of(batch))
    assert all(float(g.abs().max()) == 0 for g in learner.gradient_so_far())
    learner.submit_turn(turns[0])
    after_first = learner.gradient_so_far()
    assert max(float(g.abs().max()) for g in after_first) > 0
    assert learner.counters_so_far()["turn_backwards"] == 1
    with pytest.raises(LearnerRefusal, match="still open"):
        learner.assert_safe_to_step()
    # Turn 0's direct term is final: later turns add their own terms on top.
    solo = dataclasses.replace(turns[0], trajectory_id="solo")
    one = StreamingOPDLearner(micro64)
    one.begin_batch({traj.group_id: GroupSpec(traj.prompt_ids, 1)})
    one.submit_turn(solo)
    for a, b in zip(after_first, one.gradient_so_far(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_replay_touches_each_segment_once(micro64, batch):
    """One recompute per multi-turn trajectory, covering every position before its last
    chunk exactly once; single-turn trajectories need none."""
    forwards = []
    hook = micro64.base_model.register_forward_hook(
        lambda _m, _a, kwargs, _out: forwards.append(kwargs["input_ids"].shape[-1]),
        with_kwargs=True,
    )
    try:
        learner, result = run_stream(micro64, batch, seed=5)
    finally:
        hook.remove()
    replayed = dict(learner.replay_log)
    assert len(replayed) == len(learner.replay_log), "a trajectory was replayed twice"
    for traj in batch:
        actions = [i for i, s in enumerate(traj.segments) if s.kind == "action"]
        if len(actions) == 1:
            assert traj.trajectory_id not in replayed
            continue
        # Positions before the last chunk: everything up to the previous action's end,
        # minus the prompt (the prompt is the group's, replayed once per group).
        before_last = sum(len(s.ids) for s in traj.segments[: actions[-2] + 1])
        assert replayed[traj.trajectory_id] == before_last
    n_turns = sum(sum(s.kind == "action" and bool(s.ids) for s in t.segments) for t in batch)
    assert len(forwards) == result.n_groups + n_turns + len(replayed)
    assert result.counters["prefix_replays"] == 2  # one per group


def test_empty_and_unscored_last_actions_are_exact(micro64, batch):
    edited = []
    for traj in batch:
        extra = (Segment.observation([7, 8]), Segment.action([9, 10], [False, False]))
        edited.append(dataclasses.replace(traj, segments=(*traj.segments, *extra)))
    edited[0] = dataclasses.replace(edited[0], segments=(*edited[0].segments, Segment.action([])))
    _, ref = reference_grad_l(micro64, edited)
    _, result = run_stream(micro64, edited, seed=2)
    assert rel_diff(ref, result.grad_objective) <= 1e-10


def test_trailing_observation_needs_no_work(micro64, batch):
    traj = batch[2]
    longer = dataclasses.replace(
        traj, segments=(*traj.segments, Segment.observation([1, 2, 3])), trajectory_id="x"
    )
    base = dataclasses.replace(traj, trajectory_id="x")
    counters = []
    for candidate in (base, longer):
        _, result = run_stream(micro64, [candidate], seed=0)
        counters.append(result.counters)
    assert counters[0] == counters[1]


def test_teacher_scores_are_checked_per_turn(micro64, batch):
    traj = next(t for t in batch if sum(s.kind == "action" for s in t.segments) == 3)
    bad = list(traj.teacher_logprobs)
    bad[-1] = float("nan")
    with pytest.raises(TeacherScoreError, match=rf"{traj.trajectory_id!r} turn 2: .*not finite"):
        split_by_turn(dataclasses.replace(traj, teacher_logprobs=tuple(bad)))
    with pytest.raises(TeacherScoreError, match=r"per turn: \["):
        split_by_turn(dataclasses.replace(traj, teacher_logprobs=tuple(bad[:-1])))
    turn = turns_of(traj, split_by_turn(traj))[1]
    learner = StreamingOPDLearner(micro64)
    learner.begin_batch(groups_of(batch))
    learner.submit_turn(turns_of(traj, split_by_turn(traj))[0])
    short = dataclasses.replace(turn, teacher_logprobs=turn.teacher_logprobs[:-1])
    with pytest.raises(TeacherScoreError, match=rf"{traj.trajectory_id!r} turn 1"):
        learner.submit_turn(short)


def test_turns_must_arrive_in_order(micro64, batch):
    traj = next(t for t in batch if sum(s.kind == "action" for s in t.segments) == 3)
    turns = turns_of(traj, split_by_turn(traj))
    learner = StreamingOPDLearner(micro64)
    learner.begin_batch(groups_of(batch))
    with pytest.raises(LearnerRefusal, match="turn 1 arrived before turn 0"):
        learner.submit_turn(turns[1])
    learner.submit_turn(turns[0])
    with pytest.raises(LearnerRefusal, match="turn 2 arrived, expected turn 1"):
        learner.submit_turn(turns[2])


def test_micro_batched_sync_matches_reference(micro64, batch, references):
    learner = SyncOPDLearner(micro64, micro_batch_tokens=30)
    learner.begin_batch(groups_of(batch))
    for traj in batch:
        learner.submit(traj)
    result = learner.finish()
    assert rel_diff(references[torch.float64][1], result.grad_objective) <= 1e-10


def test_live_memory_is_keys_values_and_ledger_only(micro64, batch):
    """After each turn an open trajectory holds at most its keys/values and a same-sized
    ledger: no activations survive the turn."""
    config = micro64.config
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * 64 * 8
    traj = max(batch, key=lambda t: len(t.segments))
    prompt_bytes = 2 * kv_bytes_per_token * (len(traj.prompt_ids) - 1)  # proxies + ledger
    learner = StreamingOPDLearner(micro64)
    learner.begin_batch(groups_of(batch))
    for turn in turns_of(traj, split_by_turn(traj))[:-1]:
        learner.submit_turn(turn)
        positions = len(traj.prompt_ids) + sum(len(s.ids) for s in turn.segments) - 1
        own = positions - (len(traj.prompt_ids) - 1)
        assert learner.live_kv_bytes() <= prompt_bytes + 2 * kv_bytes_per_token * own
        assert learner.live_kv_bytes() >= kv_bytes_per_token * own


def test_batch_reports_the_sampled_reverse_kl_to_the_teacher(micro64, batch):
    """mean over scored tokens of log pi - q, by a plain full forward of each trajectory."""
    total, count = 0.0, 0
    with torch.no_grad():
        for t in batch:
            tokens = list(t.prompt_ids) + [i for s in t.segments for i in s.ids]
            scored = [False] * len(t.prompt_ids) + [b for s in t.segments for b in s.scored]
            logp = torch.log_softmax(micro64(input_ids=torch.tensor([tokens])).logits[0], -1)
            student = [
                float(logp[pos - 1, tokens[pos]]) for pos in range(1, len(tokens)) if scored[pos]
            ]
            total += sum(lp - q for lp, q in zip(student, t.teacher_logprobs, strict=True))
            count += len(student)
    expected = total / count
    assert abs(expected) > 0.1  # made-up teacher scores are far from the model's
    for result in (run_sync(micro64, batch), run_stream(micro64, batch, seed=3)[1]):
        assert result.reverse_kl == pytest.approx(expected, rel=1e-10)
    micro64.zero_grad(set_to_none=True)
