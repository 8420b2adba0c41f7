"""Off-policy learners (one-step-off, pipeline): version lag and truncated importance weights.

The reference is written plainly: one full forward per trajectory, full-vocabulary
log-softmax, weights w_t = min(exp(log pi_t - log mu_t), c) held constant, one backward.
Behaviour log-probs are the true log-probs shifted by random offsets, so some weights are
clipped and the rest spread around 1: a learner ignoring the weights, or clipping the
wrong way, fails by far more than the tolerance.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics

import pytest
import torch

from tests.helpers import multi_turn_batch, random_batch, rel_diff
from thundersync_core.batch import Trajectory, turns_of
from thundersync_core.objectives.opd import split_by_turn
from thundersync_core.streaming import StreamingGRPOLearner, StreamingOPDLearner, groups_of
from thundersync_core.streaming.base import LearnerRefusal

CLIP = 1.5


def _token_logprobs(model: torch.nn.Module, t: Trajectory) -> list[torch.Tensor]:
    tokens = list(t.prompt_ids) + list(t.response_ids)
    scored = [False] * len(t.prompt_ids) + list(t.response_scored)
    logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0], -1)
    return [logp[pos - 1, tokens[pos]] for pos in range(1, len(tokens)) if scored[pos]]


def _with_behaviour(model, batch: list[Trajectory], seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    with torch.no_grad():
        for t in batch:
            true = [float(x) for x in _token_logprobs(model, t)]
            shifted = tuple(q + rng.uniform(-1.0, 0.6) for q in true)
            out.append(dataclasses.replace(t, behaviour_logprobs=shifted))
    return out


def _weights(logps: list[torch.Tensor], behaviour) -> list[float]:
    return [
        min(math.exp(float(lp.detach()) - b), CLIP) for lp, b in zip(logps, behaviour, strict=True)
    ]


def _reference_grpo(model, batch: list[Trajectory]) -> dict[str, torch.Tensor]:
    groups: dict[str, list[Trajectory]] = {}
    for t in batch:
        groups.setdefault(t.group_id, []).append(t)
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for members in groups.values():
        rewards = [t.reward for t in members]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        for t in members:
            adv = (t.reward - mean) / (std + 1e-6)
            logps = _token_logprobs(model, t)
            for w, lp in zip(_weights(logps, t.behaviour_logprobs), logps, strict=True):
                total = total + adv * w * lp
    (-(total / len(groups))).backward()
    grads = {n: -p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def test_grpo_importance_weights_match_plain_reference(micro64) -> None:
    batch = _with_behaviour(micro64, random_batch(5, micro64.config.vocab_size), seed=1)
    batch = [dataclasses.replace(t, policy_version=3 if i % 2 else 4) for i, t in enumerate(batch)]
    expected = _reference_grpo(micro64, batch)
    learner = StreamingGRPOLearner(micro64, policy_version=4, max_lag=1, is_clip=CLIP)
    learner.begin_batch(groups_of(batch))
    for t in random.Random(2).sample(batch, len(batch)):
        learner.submit(t)
    result = learner.finish()
    assert rel_diff(expected, result.grad_objective) < 1e-10
    assert 0 < learner.is_stats["clipped"] < learner.is_stats["tokens"]
    # Ignoring the weights is not within the tolerance: the test can fail.
    plain = StreamingGRPOLearner(micro64, policy_version=4, max_lag=1)
    plain.begin_batch(groups_of(batch))
    for t in batch:
        plain.submit(t)
    assert rel_diff(expected, plain.finish().grad_objective) > 1e-2
    micro64.zero_grad(set_to_none=True)


def test_opd_importance_weights_match_plain_reference(micro64) -> None:
    batch = _with_behaviour(micro64, multi_turn_batch(6, micro64.config.vocab_size), seed=3)
    model = micro64
    model.zero_grad(set_to_none=True)
    n_tokens = sum(t.n_scored_tokens for t in batch)
    total = torch.zeros((), dtype=torch.float64)
    for t in batch:
        logps = _token_logprobs(model, t)
        weights = _weights(logps, t.behaviour_logprobs)
        for w, lp, q in zip(weights, logps, t.teacher_logprobs or (), strict=True):
            total = total + w * (lp.detach() - q) * lp
    (total / n_tokens).backward()
    expected = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    learner = StreamingOPDLearner(model, policy_version=2, max_lag=2, is_clip=CLIP)
    learner.begin_batch(groups_of(batch))
    for t in batch:
        for turn in turns_of(t, split_by_turn(t)):
            learner.submit_turn(turn)
    assert rel_diff(expected, learner.finish().grad_objective) < 1e-10
    model.zero_grad(set_to_none=True)


def test_version_lag_window_is_enforced(micro32) -> None:
    batch = random_batch(7, micro32.config.vocab_size, n_groups=1, group_size=2)
    exact = StreamingGRPOLearner(micro32, policy_version=5)
    exact.begin_batch(groups_of(batch))
    with pytest.raises(LearnerRefusal, match="policy version 4; this batch trains version 5"):
        exact.submit(dataclasses.replace(batch[0], policy_version=4))
    lagged = StreamingGRPOLearner(micro32, policy_version=5, max_lag=1, is_clip=2.0)
    lagged.begin_batch(groups_of(batch))
    with pytest.raises(LearnerRefusal, match="admits a lag of at most 1"):
        lagged.submit(dataclasses.replace(batch[0], policy_version=3))
    with pytest.raises(LearnerRefusal, match="needs one behaviour log-prob per scored token"):
        lagged.submit(dataclasses.replace(batch[0], policy_version=4))


def test_nonfinite_score_names_the_trajectory(micro32) -> None:
    batch = random_batch(8, micro32.config.vocab_size, n_groups=1, group_size=2)
    learner = StreamingGRPOLearner(micro32)
    _, param = next(iter(micro32.named_parameters()))
    saved = param.detach().clone()
    try:
        with torch.no_grad():
            param.fill_(float("nan"))
        learner.begin_batch(groups_of(batch))
        with pytest.raises(LearnerRefusal, match=rf"{batch[0].trajectory_id}.*non-finite loss"):
            learner.submit(batch[0])
    finally:
        with torch.no_grad():
            param.copy_(saved)
