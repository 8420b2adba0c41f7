"""OPD over the vocabulary with the teacher's top k: the teacher's top-k, the loss, both
learners and the records, against plainly written references.

The reference runs one forward of each full trajectory, writes q^ out position by position
(the teacher's top-k log-probs, its remaining mass spread evenly over the other tokens),
sums pi (log pi - log q^) over the vocabulary and takes one backward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import (
    multi_turn_batch,
    reference_vocab_kl,
    rel_diff,
    run_opd_stream,
    run_opd_sync,
    scored_positions,
    with_real_teacher,
)
from thundersync_core.batch import (
    BatchFormatError,
    parse_batch_lines,
    trajectory_to_json,
    turns_of,
)
from thundersync_core.objectives.opd import (
    TeacherScoreError,
    split_by_turn,
    turn_loss,
    vocab_kl,
)
from thundersync_core.policy import build_model
from thundersync_core.streaming import StreamingOPDLearner, SyncOPDLearner, groups_of
from thundersync_core.teacher import Teacher

K = 8
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def run_stream(model, batch, seed, **kwargs):
    return run_opd_stream(model, batch, seed, teacher_top_k=K, **kwargs)


def run_sync(model, batch):
    return run_opd_sync(model, batch, teacher_top_k=K)


@pytest.fixture(scope="module")
def batch():
    return with_real_teacher(multi_turn_batch(seed=21, vocab=1024), K)


def test_teacher_top_k_is_a_full_forwards_top_k(batch):
    """Scored turn by turn with a cache, the top-k (ids and log-probs, most likely first)
    and the sampled tokens' log-probs are those of one full forward."""
    model = build_model("micro", seed=99, dtype=torch.float64)
    for traj in batch:
        tokens, positions = scored_positions(traj)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0], -1)
        top, ids = logp[[p - 1 for p in positions]].topk(K, dim=-1)
        assert list(traj.teacher_top_ids) == ids.flatten().tolist()
        torch.testing.assert_close(
            torch.tensor(traj.teacher_top_logprobs, dtype=torch.float64),
            top.flatten(),
            rtol=1e-12,
            atol=0,
        )
        sampled = [float(logp[p - 1, tokens[p]]) for p in positions]
        torch.testing.assert_close(
            torch.tensor(traj.teacher_logprobs, dtype=torch.float64),
            torch.tensor(sampled, dtype=torch.float64),
            rtol=1e-12,
            atol=0,
        )
        assert bool((top[:, :-1] >= top[:, 1:]).all())


def test_a_top_k_teacher_scores_the_sampled_tokens_as_before():
    model = build_model("micro", seed=99, dtype=torch.float64)
    traj = multi_turn_batch(seed=5, vocab=1024)[4]
    plain, top = Teacher(model), Teacher(model, top_k=K)
    for turn in turns_of(traj, split_by_turn(traj)):
        assert top.score_turn(turn).logprobs == plain.score(turn)
    with pytest.raises(ValueError, match="opd_teacher_top_k: 2000 is not in"):
        Teacher(model, top_k=2000)


def test_with_the_whole_vocabulary_the_loss_is_the_exact_kl():
    """k = V: q^ is the teacher's distribution and vocab_kl is KL(pi || q) itself."""
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(5, 32, generator=gen, dtype=torch.float64), -1)
    logq = torch.log_softmax(torch.randn(5, 32, generator=gen, dtype=torch.float64), -1)
    top, ids = logq.topk(32, dim=-1)
    expected = torch.nn.functional.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(vocab_kl(logp, ids, top), expected, rtol=1e-12, atol=1e-14)


def test_its_gradient_is_the_expected_one_sample_gradient():
    """The same objective as the one-sample loss: the gradient over the vocabulary equals
    the sampled-token gradient averaged over the token, weighted by pi."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    logq = torch.log_softmax(torch.randn(1, 16, generator=gen, dtype=torch.float64), -1)
    top, ids = logq.topk(16, dim=-1)
    (exact,) = torch.autograd.grad(vocab_kl(torch.log_softmax(logits, -1), ids, top).sum(), logits)
    expected = torch.zeros_like(logits)
    probs = torch.softmax(logits, -1).detach()[0]
    for y in range(16):
        logp = torch.log_softmax(logits, -1)[0, y : y + 1]
        loss, _ = turn_loss(logp, logq[0, y : y + 1])
        (grad,) = torch.autograd.grad(loss, logits)
        expected += probs[y] * grad
    torch.testing.assert_close(exact, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_sync_and_stream_match_the_reference(micro64, micro32, batch, dtype):
    model = micro64 if dtype == torch.float64 else micro32
    ref_loss, ref_grads = reference_vocab_kl(model, batch, K)
    sync = run_sync(model, batch)
    results = [sync] + [run_stream(model, batch, seed)[1] for seed in (0, 7)]
    for result in results:
        assert rel_diff(ref_grads, result.grad_objective) <= TOLERANCE[dtype]
        assert result.objective == pytest.approx(ref_loss, rel=TOLERANCE[dtype])
    # The recorded reverse KL is still the sampled tokens' estimate.
    log_ratio = [
        lp - q
        for t in batch
        for lp, q in zip(sampled_student(model, t), t.teacher_logprobs or (), strict=True)
    ]
    n = sum(t.n_scored_tokens for t in batch)
    assert sync.reverse_kl == pytest.approx(sum(log_ratio) / n, rel=TOLERANCE[dtype])


def sampled_student(model, traj):
    tokens, positions = scored_positions(traj)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0], -1)
    return [float(logp[p - 1, tokens[p]]) for p in positions]


def test_off_policy_turns_need_no_importance_weight(micro64, batch):
    """Stale samples: the weights are counted, not applied; the update is the reference's."""
    _, ref_grads = reference_vocab_kl(micro64, batch, K)
    stale = [
        dataclasses.replace(
            t, behaviour_logprobs=tuple(q - 0.5 for q in sampled_student(micro64, t))
        )
        for t in batch
    ]
    learner, result = run_stream(micro64, stale, seed=3, is_clip=2.0, max_lag=1)
    assert rel_diff(ref_grads, result.grad_objective) <= 1e-10
    assert learner.is_stats["tokens"] == sum(t.n_scored_tokens for t in batch)
    assert learner.is_stats["clipped"] == 0  # exp(0.5) < 2: every weight was exp(0.5)


def test_a_turn_without_its_top_k_is_refused_by_name(micro64, batch):
    traj = next(t for t in batch if sum(s.kind == "action" for s in t.segments) == 3)
    turns = turns_of(traj, split_by_turn(traj))
    learner = StreamingOPDLearner(micro64, teacher_top_k=K)
    learner.begin_batch(groups_of(batch))
    learner.submit_turn(turns[0])
    cases = [
        (dataclasses.replace(turns[1], teacher_top_ids=None), "turn 1: no teacher top-8"),
        (
            dataclasses.replace(turns[1], teacher_top_ids=turns[1].teacher_top_ids[:-1]),
            "turn 1: .* teacher top ids and .* log-probs for .* x top-8",
        ),
        (
            dataclasses.replace(turns[1], teacher_top_ids=(5000,) * len(turns[1].teacher_top_ids)),
            "turn 1: teacher top id 5000 out of range for vocabulary of 1024",
        ),
        (
            dataclasses.replace(
                turns[1],
                teacher_top_logprobs=(0.5, *turns[1].teacher_top_logprobs[1:]),
            ),
            "turn 1: teacher top log-prob 0.5 is not a finite log-prob",
        ),
    ]
    for bad, message in cases:
        with pytest.raises(TeacherScoreError, match=rf"{traj.trajectory_id!r} {message}"):
            learner.submit_turn(bad)
    sync = SyncOPDLearner(micro64, teacher_top_k=K)
    sync.begin_batch(groups_of(batch))
    nan = (float("nan"), *traj.teacher_top_logprobs[1:])
    with pytest.raises(TeacherScoreError, match=rf"{traj.trajectory_id!r} turn 0: .*nan"):
        sync.submit(dataclasses.replace(traj, teacher_top_logprobs=nan))


def test_records_keep_the_top_k_and_refuse_a_ragged_one(batch):
    lines = [trajectory_to_json(t) for t in batch]
    back = parse_batch_lines(lines)
    for a, b in zip(batch, back, strict=True):
        assert a.teacher_top_ids == b.teacher_top_ids
        assert a.teacher_top_logprobs == b.teacher_top_logprobs
    traj = batch[3]
    ragged = dataclasses.replace(
        traj,
        teacher_top_ids=traj.teacher_top_ids[:-1],
        teacher_top_logprobs=traj.teacher_top_logprobs[:-1],
    )
    with pytest.raises(BatchFormatError, match=rf"{traj.trajectory_id!r}: field teacher_top_ids"):
        turns_of(ragged, split_by_turn(ragged))
    alone = dataclasses.replace(traj, teacher_top_logprobs=None)
    with pytest.raises(BatchFormatError, match="must come together"):
        turns_of(alone, split_by_turn(alone))
