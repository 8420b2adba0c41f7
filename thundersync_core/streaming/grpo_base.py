"""What the two GRPO learners share: trajectory sources with rewards and the 1/G or 1/N scale."""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedModel

from thundersync_core.batch import Trajectory
from thundersync_core.objectives.grpo import LossAgg, batch_scale
from thundersync_core.streaming.base import LearnerBase, LearnerRefusal


class GRPOLearnerBase(LearnerBase):
    maximise = True

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        loss_agg: LossAgg = "seq-sum",
        accum_dtype: torch.dtype | None = None,
        policy_version: int = 0,
        max_lag: int = 0,
        is_clip: float | None = None,
    ) -> None:
        batch_scale(loss_agg, 1, 1)  # validates the name early
        super().__init__(
            model,
            accum_dtype=accum_dtype,
            policy_version=policy_version,
            max_lag=max_lag,
            is_clip=is_clip,
        )
        self.loss_agg: LossAgg = loss_agg

    def submit(self, traj: Trajectory) -> None:
        """One trajectory whose reward has landed."""
        self._check_reward(traj)
        self._accept_whole(traj)
        self._on_submit(traj)

    def _check_reward(self, traj: Trajectory) -> None:
        if not math.isfinite(traj.reward):
            raise LearnerRefusal(
                f"trajectory {traj.trajectory_id!r}: reward {traj.reward} is not finite"
            )

    def _on_submit(self, traj: Trajectory) -> None:
        raise NotImplementedError

    def _scale(self) -> float:
        return batch_scale(self.loss_agg, self._n_groups(), self._n_scored_tokens)
