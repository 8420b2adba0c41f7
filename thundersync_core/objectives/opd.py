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
"""

from __future__ import annotations

import math

import torch

from thundersync_core.batch import Trajectory


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
