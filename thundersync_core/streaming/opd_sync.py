"""The synchronous OPD learner: one batch forward/backward of L after the last teacher score."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from thundersync_core.batch import Trajectory, turns_of
from thundersync_core.objectives.opd import (
    batch_scale,
    check_turn_top,
    split_by_turn,
    turn_loss,
    turn_vocab_loss,
)
from thundersync_core.policy.logprobs import scored_logprobs
from thundersync_core.streaming.base import LearnerBase
from thundersync_core.streaming.rows import (
    check_micro_batch_tokens,
    micro_batches,
    right_padded,
    sequence_length,
)
from thundersync_core.streaming.vocab import scored_vocab_logprobs


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
        teacher_top_k: int = 0,
    ) -> None:
        super().__init__(model, accum_dtype=accum_dtype, policy_version=policy_version)
        self.micro_batch_tokens = check_micro_batch_tokens(micro_batch_tokens)
        #: 0: the one-sample reverse-KL loss; k: the reverse KL over the vocabulary against
        #: the teacher's top k (every trajectory must carry them).
        self.teacher_top_k = teacher_top_k
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])

    def _on_begin(self) -> None:
        self._batch: list[Trajectory] = []
        self._backward_done = False

    def submit(self, traj: Trajectory) -> None:
        teacher = split_by_turn(traj)  # refuses missing, miscounted or non-finite scores
        if self.teacher_top_k:
            for turn in turns_of(traj, teacher):
                n_scored = sum(turn.action.scored) if turn.action is not None else 0
                check_turn_top(turn, n_scored, self.teacher_top_k, self.vocab_size)
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
        # Both forwards return tokens row by row in position order: the order of the
        # teacher's scores in each record.
        teacher = [q for t in rows for q in t.teacher_logprobs or ()]
        if self.teacher_top_k:
            logp_NV, targets_N, _ = scored_vocab_logprobs(
                self.model, ids_BT, scored_BT, attention_mask_BT=mask_BT
            )
            k, dtype = self.teacher_top_k, logp_NV.dtype
            top_ids = [i for t in rows for i in t.teacher_top_ids or ()]
            top_logprobs = [q for t in rows for q in t.teacher_top_logprobs or ()]
            loss, log_ratio = turn_vocab_loss(
                logp_NV,
                targets_N,
                torch.tensor(teacher, dtype=dtype, device=self.device),
                torch.tensor(top_ids, device=self.device).view(-1, k),
                torch.tensor(top_logprobs, dtype=dtype, device=self.device).view(-1, k),
            )
        else:
            logprobs_N, _ = scored_logprobs(
                self.model, ids_BT, scored_BT, attention_mask_BT=mask_BT
            )
            teacher_N = torch.tensor(teacher, dtype=logprobs_N.dtype, device=self.device)
            loss, log_ratio = turn_loss(logprobs_N, teacher_N)
        self._add_grads(torch.autograd.grad(loss, self.params, allow_unused=True))
        self._add_opd_terms(loss, log_ratio)

    def _pending_work(self) -> str:
        return "" if self._backward_done else "the batch backward has not run yet (finish runs it)"
