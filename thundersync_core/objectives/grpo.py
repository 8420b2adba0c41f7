"""GRPO: group-normalised advantages on sequence log-probabilities, streamed exactly.

For one logical batch of G groups, trajectory i with reward r_i and score
S_i = sum_{t scored in i} log pi(y_t | ctx_t), the objective (maximised) is

    J = c * sum_g sum_{i in g} A_i S_i,      A_i = (r_i - mu_g) / (sigma_g + eps)

with mu_g, sigma_g the mean and *population* std of the group's rewards (float64),
eps = 1e-6, and c = 1/G (``seq-sum``) or 1/N_tok, the batch's scored-token count
(``token-mean``). A group whose rewards are all equal has A_i = 0 exactly (not eps-sized
rounding noise), so single-trajectory groups contribute nothing.

Why streaming is exact: A_i is affine in r_i once the group has closed, so for any shift s

    sum_i A_i grad S_i = (G1 - (mu - s) G2) / (sigma + eps),
    G2 = sum_i grad S_i,   G1 = sum_i (r_i - s) grad S_i.

G1 and G2 are sums over the group's trajectories in any order, so each trajectory's backward
runs when its reward lands; mu and sigma are needed only at group close, c only at the
barrier. The shift s (the group's first reward) keeps G1 - (mu - s) G2 well conditioned when
rewards share a large offset; s = 0 gives the textbook form. The same identity holds for the
adjoints of the shared prompt's keys/values, which are replayed through the prompt at close.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

EPS = 1e-6
LossAgg = Literal["seq-sum", "token-mean"]


def group_moments(rewards: Sequence[float]) -> tuple[float, float]:
    """Mean and population std of a group's rewards, in float64 with exact summation."""
    if not rewards:
        raise ValueError("a group needs at least one reward")
    n = len(rewards)
    mean = math.fsum(rewards) / n
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / n)
    return mean, std


def is_uniform(rewards: Sequence[float]) -> bool:
    return max(rewards) == min(rewards)


def advantages(rewards: Sequence[float]) -> list[float]:
    """A_i for one group (the batch form, used by the sync learner and references)."""
    if is_uniform(rewards):
        return [0.0] * len(rewards)
    mean, std = group_moments(rewards)
    return [(r - mean) / (std + EPS) for r in rewards]


def close_coefficients(rewards: Sequence[float], shift: float) -> tuple[float, float]:
    """(a, b) with sum_i A_i x_i = a * X1 + b * X2 for X1 = sum (r_i - shift) x_i, X2 = sum x_i."""
    if is_uniform(rewards):
        return 0.0, 0.0
    mean, std = group_moments(rewards)
    return 1.0 / (std + EPS), -(mean - shift) / (std + EPS)


def batch_scale(loss_agg: LossAgg, n_groups: int, n_scored_tokens: int) -> float:
    """The scalar c applied once at the barrier."""
    if loss_agg == "seq-sum":
        return 1.0 / max(n_groups, 1)
    if loss_agg == "token-mean":
        return 1.0 / max(n_scored_tokens, 1)
    raise ValueError(f"loss_agg must be 'seq-sum' or 'token-mean', got {loss_agg!r}")
