"""The frozen teacher scores turns incrementally, exactly as a full forward would."""

from __future__ import annotations

import dataclasses
import random

import torch

from tests.helpers import multi_turn_batch, reference_grad_l, rel_diff
from thundersync_core.batch import turns_of
from thundersync_core.objectives.opd import split_by_turn
from thundersync_core.policy import build_model
from thundersync_core.replay import interleave
from thundersync_core.streaming import StreamingOPDLearner, groups_of
from thundersync_core.teacher import Teacher, TeacherWorker


def full_forward_scores(model, traj):
    tokens = list(traj.prompt_ids) + list(traj.response_ids)
    scored = [False] * len(traj.prompt_ids) + list(traj.response_scored)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0], -1)
    return [float(logp[p - 1, tokens[p]]) for p in range(1, len(tokens)) if scored[p]]


def test_incremental_scores_equal_full_forward():
    teacher_model = build_model("micro", seed=99, dtype=torch.float64)
    teacher = Teacher(teacher_model)
    batch = multi_turn_batch(seed=4, vocab=1024)
    turns = {t.trajectory_id: turns_of(t, split_by_turn(t)) for t in batch}
    scores: dict[str, list[float]] = {t.trajectory_id: [] for t in batch}
    for turn in interleave(turns, random.Random(0)):
        scores[turn.trajectory_id] += teacher.score(turn)
    for traj in batch:
        expected = full_forward_scores(teacher_model, traj)
        torch.testing.assert_close(
            torch.tensor(scores[traj.trajectory_id]), torch.tensor(expected), rtol=1e-12, atol=0
        )
    assert teacher.open_sessions() == 0  # every session closed with its last turn
    assert not any(p.grad is not None for p in teacher_model.parameters())


def test_worker_scores_feed_the_streaming_learner_exactly(micro64):
    """Teacher on its own thread, learner on this one: the update is still exact."""
    teacher_model = build_model("micro", seed=99, dtype=torch.float64)
    batch = multi_turn_batch(seed=6, vocab=1024)
    turns = {t.trajectory_id: turns_of(t, split_by_turn(t)) for t in batch}
    learner = StreamingOPDLearner(micro64)
    learner.begin_batch(groups_of(batch))
    scored: dict[str, list[float]] = {t.trajectory_id: [] for t in batch}
    with TeacherWorker(Teacher(teacher_model)) as worker:
        order = interleave(turns, random.Random(1))
        futures = [worker.submit(turn) for turn in order]
        for turn, future in zip(order, futures, strict=True):
            real = future.result()
            scored[turn.trajectory_id] += real
            learner.submit_turn(dataclasses.replace(turn, teacher_logprobs=real))
    result = learner.finish()
    with_real = [
        dataclasses.replace(t, teacher_logprobs=tuple(scored[t.trajectory_id])) for t in batch
    ]
    _, ref = reference_grad_l(micro64, with_real)
    assert rel_diff(ref, result.grad_objective) <= 1e-10
