"""The synchronous OPD learner: one batch forward/backward of L after the last teacher score."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from thundersync_core.batch import Trajectory
from thundersync_core.objectives.opd import batch_scale, split_by_turn, turn_loss
from thundersync_core.policy.logprobs import scored_logprobs
from thundersync_core.streaming.base import LearnerBase
from thundersync_core.streaming.rows import (
    check_micro_batch_tokens,
    micro_batches,
    right_padded,
    sequence_length,
)


class SyncOPDLearner(LearnerBase):
    maximise = False
    tracks_reverse_kl = True

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        micro_batch_tokens: int | None = None,
        accum_dtype: torch.dtype | None = None,
        policy_version: int = 0,
    ) -> None:
        super().__init__(model, accum_dtype=accum_dtype, policy_version=policy_version)
        self.micro_batch_tokens = check_micro_batch_tokens(micro_batch_tokens)

    def _on_begin(self) -> None:
        self._batch: list[Trajectory] = []
        self._backward_done = False

    def submit(self, traj: Trajectory) -> None:
        split_by_turn(traj)  # refuses missing, miscounted or non-finite teacher scores
        self._accept_whole(traj)
        self._batch.append(traj)

    def _scale(self) -> float:
        return batch_scale(self._n_scored_tokens)

    def _on_barrier(self) -> None:
        if self._backward_done:
            return
        rows = [t for t in self._batch if t.n_scored_tokens > 0]
        lengths = [sequence_length(t) for t in rows]
        for chunk in micro_batches(rows, lengths, self.micro_batch_tokens):
            self._backward_rows(chunk)
        self._backward_done = True

    def _backward_rows(self, rows: list[Trajectory]) -> None:
        ids_BT, scored_BT, mask_BT = right_padded(rows, self.device)
        logprobs_N, _ = scored_logprobs(self.model, ids_BT, scored_BT, attention_mask_BT=mask_BT)
        # scored_logprobs returns tokens row by row in position order: the order of the
        # teacher log-probs in each record.
        teacher = [q for t in rows for q in t.teacher_logprobs or ()]
        teacher_N = torch.tensor(teacher, dtype=logprobs_N.dtype, device=self.device)
        loss, log_ratio = turn_loss(logprobs_N, teacher_N)
        self._add_grads(torch.autograd.grad(loss, self.params, allow_unused=True))
        self._add_opd_terms(loss, log_ratio)

    def _pending_work(self) -> str:
        return "" if self._backward_done else "the batch backward has not run yet (finish runs it)"
