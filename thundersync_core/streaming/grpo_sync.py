"""The synchronous GRPO learner: one batch forward/backward after the last reward.

This is what a synchronous trainer does and the baseline the streamed update must equal:
trajectories are collected until the batch is complete, advantages computed per group, and
the loss -J backpropagated over right-padded rows (in micro-batches of at most
``micro_batch_tokens`` padded tokens when set; J is linear in the rows, so accumulation is
exact). Rows with a zero advantage or no scored token are skipped: they add nothing to J.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from thundersync_core.batch import Trajectory
from thundersync_core.objectives.grpo import LossAgg, advantages
from thundersync_core.policy.logprobs import scored_logprobs
from thundersync_core.streaming.grpo_base import GRPOLearnerBase
from thundersync_core.streaming.rows import (
    check_micro_batch_tokens,
    micro_batches,
    right_padded,
    sequence_length,
)


class SyncGRPOLearner(GRPOLearnerBase):
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        loss_agg: LossAgg = "seq-sum",
        micro_batch_tokens: int | None = None,
        accum_dtype: torch.dtype | None = None,
        policy_version: int = 0,
    ) -> None:
        super().__init__(
            model, loss_agg=loss_agg, accum_dtype=accum_dtype, policy_version=policy_version
        )
        self.micro_batch_tokens = check_micro_batch_tokens(micro_batch_tokens)

    def _on_begin(self) -> None:
        self._batch: list[Trajectory] = []
        self._backward_done = False
        self._rows_run = 0

    def _on_submit(self, traj: Trajectory) -> None:
        self._batch.append(traj)

    def _on_barrier(self) -> None:
        if self._backward_done:
            return
        rows = self._weighted_rows()
        lengths = [sequence_length(t) for t, _ in rows]
        for chunk in micro_batches(rows, lengths, self.micro_batch_tokens):
            self._backward_rows(chunk)
        self._backward_done = True

    def _weighted_rows(self) -> list[tuple[Trajectory, float]]:
        by_group: dict[str, list[Trajectory]] = {}
        for traj in self._batch:
            by_group.setdefault(traj.group_id, []).append(traj)
        rows = []
        for members in by_group.values():
            for traj, adv in zip(members, advantages([t.reward for t in members]), strict=True):
                if adv != 0.0 and traj.n_scored_tokens > 0:
                    rows.append((traj, adv))
        return rows

    def _backward_rows(self, rows: Sequence[tuple[Trajectory, float]]) -> None:
        ids_BT, scored_BT, mask_BT = right_padded([t for t, _ in rows], self.device)
        logprobs_N, row_N = scored_logprobs(
            self.model, ids_BT, scored_BT, attention_mask_BT=mask_BT
        )
        scores_B = torch.zeros(len(rows), dtype=logprobs_N.dtype, device=self.device)
        scores_B = scores_B.index_add(0, row_N, logprobs_N)
        adv_B = torch.tensor([a for _, a in rows], dtype=scores_B.dtype, device=self.device)
        objective = (adv_B * scores_B).sum()
        grads = torch.autograd.grad(objective, self.params, allow_unused=True)
        self._add_grads(grads)
        self._objective_sum += float(objective.detach())
        self._rows_run += len(rows)

    def _pending_work(self) -> str:
        return "" if self._backward_done else "the batch backward has not run yet (finish runs it)"

    def _counters(self) -> dict[str, int]:
        return {"rows_backpropagated": self._rows_run}
