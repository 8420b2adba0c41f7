"""On-policy distillation (OPD): per-token reverse KL to a frozen teacher, streamed per turn.

For one logical batch, over every scored token t of the student's own trajectories, with
q_t the frozen teacher's log-prob of the sampled token and sg the stop-gradient:

    L = (1/N_tok) * sum_t sg(log pi(y_t | ctx_t) - q_t) * log pi(y_t | ctx_t)   (minimised)

N_tok is the batch's scored-token count, clamped to at least 1. The gradient,
(1/N_tok) sum_t (log pi - q) grad log pi, is the score-function estimator of the per-token
reverse KL(pi || teacher) on samples from pi.

Why streaming is exact: each token's weight sg(log pi - q) is fixed once the teacher has
scored the turn, so a turn's term of L is final the moment its scores land and its backward
can run at once. Gradient a later turn sends into an earlier turn's keys/values is linear
in the adjoint, so it is accumulated and replayed through the earlier segment once, at
trajectory close (the prompt's once per group). 1/N_tok is a scalar applied at the barrier.

With the teacher's top k (``opd_teacher_top_k`` > 0) each token's term is the reverse KL
at its position taken over the whole vocabulary instead of its one-sample estimate:

    L = (1/N_tok) * sum_t sum_v pi(v | ctx_t) (log pi(v | ctx_t) - log q^_t(v))

q^_t is the teacher's top-k log-probs at position t, its remaining mass spread evenly over
the other V - k tokens. Its gradient is the expectation, over the token at t, of the
one-sample gradient above: the same objective, without the variance of one sampled token
(the sampled estimate barely moves a student towards a teacher token it rarely samples).
A term still depends only on its own turn's teacher scores, so streaming stays exact. The
KL is exact at each visited position, so off-policy samples need no per-token importance
weight (which corrects the choice of the sampled token, not the visited state).
"""

from __future__ import annotations

import math

import torch

from thundersync_core.batch import Trajectory, Turn


class TeacherScoreError(ValueError):
    """Teacher log-probs do not fit a turn; the message names trajectory and turn."""


def turn_loss(
    logprobs_N: torch.Tensor, teacher_N: torch.Tensor, is_weights_N: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_t sg(log pi_t - q_t) * log pi_t over one turn's (or row's) scored tokens, and
    sum_t (log pi_t - q_t) (detached, unweighted: the sampled reverse KL's numerator).

    Off-policy samples (one-step-off, pipeline) multiply each loss term by its truncated
    importance weight ``is_weights_N`` (constant).
    """
    log_ratio_N = (logprobs_N - teacher_N).detach()
    weights_N = log_ratio_N if is_weights_N is None else log_ratio_N * is_weights_N
    return (weights_N * logprobs_N).sum(), log_ratio_N.sum()


#: Floor on the teacher's mass outside its top k: float32 log-probs cannot resolve less.
TAIL_MASS_FLOOR = 1e-6


def vocab_kl(
    logp_NV: torch.Tensor, top_ids_NK: torch.Tensor, top_logprobs_NK: torch.Tensor
) -> torch.Tensor:
    """KL(pi || q^) at each of N positions over the whole vocabulary, q^ the teacher's top-k
    log-probs with the rest of its mass (at least ``TAIL_MASS_FLOOR``) spread evenly."""
    n_vocab, k = logp_NV.shape[-1], top_ids_NK.shape[-1]
    top_NK = top_logprobs_NK.to(logp_NV.dtype)
    tail_N = (1.0 - top_NK.exp().sum(-1)).clamp_min(TAIL_MASS_FLOOR) / max(n_vocab - k, 1)
    logq_NV = tail_N.log()[:, None].expand_as(logp_NV).scatter(-1, top_ids_NK, top_NK)
    # Tokens a top-k/top-p sampler never draws have log-prob -inf and add nothing (0 log 0
    # = 0); a finite stand-in keeps their 0 * inf out of the sum and the gradient.
    finite_NV = logp_NV.masked_fill(~torch.isfinite(logp_NV), 0.0)
    return (logp_NV.exp() * (finite_NV - logq_NV)).sum(-1)


def turn_vocab_loss(
    logp_NV: torch.Tensor,
    targets_N: torch.Tensor,
    teacher_N: torch.Tensor,
    top_ids_NK: torch.Tensor,
    top_logprobs_NK: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_t KL_t(pi || q^_t) over one turn's (or rows') scored tokens, and the sampled
    tokens' sum_t (log pi_t - q_t) (detached: the same reverse-KL estimate as ``turn_loss``)."""
    sampled_N = logp_NV.gather(-1, targets_N[:, None])[:, 0]
    log_ratio = (sampled_N - teacher_N).detach().sum()
    return vocab_kl(logp_NV, top_ids_NK, top_logprobs_NK).sum(), log_ratio


def batch_scale(n_scored_tokens: int) -> float:
    return 1.0 / max(n_scored_tokens, 1)


def check_turn_scores(
    trajectory_id: str, turn: int, n_scored: int, teacher: tuple[float, ...] | None
) -> None:
    if teacher is None:
        raise TeacherScoreError(f"trajectory {trajectory_id!r} turn {turn}: no teacher log-probs")
    if len(teacher) != n_scored:
        raise TeacherScoreError(
            f"trajectory {trajectory_id!r} turn {turn}: {len(teacher)} teacher log-probs "
            f"for {n_scored} scored tokens"
        )
    for value in teacher:
        if not math.isfinite(value):
            raise TeacherScoreError(
                f"trajectory {trajectory_id!r} turn {turn}: teacher log-prob {value} is not finite"
            )


def check_turn_top(turn: Turn, n_scored: int, k: int, vocab_size: int) -> None:
    """Refuse a turn whose teacher top-k is missing, miscounted, out of the vocabulary or
    not a log-probability, naming trajectory and turn."""
    where = f"trajectory {turn.trajectory_id!r} turn {turn.index}"
    ids, logprobs = turn.teacher_top_ids, turn.teacher_top_logprobs
    if n_scored == 0 and not ids and not logprobs:
        return  # nothing to score: a record without the fields is fine
    if ids is None or logprobs is None:
        raise TeacherScoreError(f"{where}: no teacher top-{k} (opd_teacher_top_k is {k})")
    if len(ids) != n_scored * k or len(logprobs) != n_scored * k:
        raise TeacherScoreError(
            f"{where}: {len(ids)} teacher top ids and {len(logprobs)} log-probs for "
            f"{n_scored} scored tokens x top-{k}"
        )
    bad_id = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad_id is not None:
        raise TeacherScoreError(
            f"{where}: teacher top id {bad_id} out of range for vocabulary of {vocab_size}"
        )
    bad = next((q for q in logprobs if not (math.isfinite(q) and q <= 0.0)), None)
    if bad is not None:
        raise TeacherScoreError(f"{where}: teacher top log-prob {bad} is not a finite log-prob")


def split_by_turn(traj: Trajectory) -> list[tuple[float, ...]]:
    """Split a trajectory's flat teacher log-probs into one tuple per action turn.

    Refuses a missing list, a wrong count or a non-finite value, naming the turn.
    """
    if traj.teacher_logprobs is None:
        raise TeacherScoreError(f"trajectory {traj.trajectory_id!r}: no teacher_logprobs")
    actions = [s for s in traj.segments if s.kind == "action"]
    needed = [sum(s.scored) for s in actions]
    flat = traj.teacher_logprobs
    if len(flat) != sum(needed):
        raise TeacherScoreError(
            f"trajectory {traj.trajectory_id!r}: {len(flat)} teacher log-probs for "
            f"{sum(needed)} scored tokens (per turn: {needed})"
        )
    out, start = [], 0
    for turn, n in enumerate(needed):
        chunk = flat[start : start + n]
        check_turn_scores(traj.trajectory_id, turn, n, chunk)
        out.append(chunk)
        start += n
    return out
