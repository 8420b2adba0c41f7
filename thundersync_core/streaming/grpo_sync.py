"""The synchronous GRPO learner: one batch forward/backward after the last reward.

This is what a synchronous trainer does and the baseline the streamed update must equal:
trajectories are collected until the batch is complete, advantages computed per group, and
the loss -J backpropagated over right-padded rows (in micro-batches of at most
``micro_batch_tokens`` padded tokens when set; J is linear in the rows, so accumulation is
exact). Rows with a zero advantage or no scored token are skipped: they add nothing to J.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedModel

from thundersync_core.batch import Trajectory
from thundersync_core.objectives.grpo import LossAgg, advantages
from thundersync_core.policy.logprobs import scored_logprobs
from thundersync_core.streaming.grpo_base import GRPOLearnerBase


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
        if micro_batch_tokens is not None and micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1 or None, got {micro_batch_tokens}")
        super().__init__(
            model, loss_agg=loss_agg, accum_dtype=accum_dtype, policy_version=policy_version
        )
        self.micro_batch_tokens = micro_batch_tokens

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
        for chunk in self._micro_batches(rows):
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

    def _micro_batches(
        self, rows: Sequence[tuple[Trajectory, float]]
    ) -> Iterator[list[tuple[Trajectory, float]]]:
        if self.micro_batch_tokens is None:
            if rows:
                yield list(rows)
            return
        chunk: list[tuple[Trajectory, float]] = []
        longest = 0
        for row in rows:
            length = len(row[0].prompt_ids) + len(row[0].response_ids)
            if chunk and max(longest, length) * (len(chunk) + 1) > self.micro_batch_tokens:
                yield chunk
                chunk, longest = [], 0
            chunk.append(row)
            longest = max(longest, length)
        if chunk:
            yield chunk

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


def right_padded(
    rows: Sequence[Trajectory], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """ids_BT, scored_BT and a padding mask (None when every row has the same length)."""
    sequences = [list(t.prompt_ids) + list(t.response_ids) for t in rows]
    width = max(len(ids) for ids in sequences)
    ids_BT = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    scored_BT = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    mask_BT = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for b, (ids, traj) in enumerate(zip(sequences, rows, strict=True)):
        n_prompt = len(traj.prompt_ids)
        ids_BT[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        scored_BT[b, n_prompt : len(ids)] = torch.tensor(traj.response_scored, dtype=torch.bool)
        mask_BT[b, : len(ids)] = 1
    uniform = all(len(ids) == width for ids in sequences)
    return ids_BT, scored_BT, None if uniform else mask_BT
