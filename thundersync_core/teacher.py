"""The frozen teacher of on-policy distillation: scores a turn's action tokens, no grad.

``Teacher`` keeps one key/value cache per open trajectory, so scoring turn k forwards only
the tokens that arrived since turn k-1. With ``top_k`` it also returns, at each scored
token, its k most likely tokens and their log-probs (OPD over the vocabulary).
``TeacherWorker`` runs a teacher on its own thread (torch releases the interpreter lock
inside its kernels), so scoring overlaps with the learner's backward of earlier turns;
``submit`` returns a future of the scores.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch
from transformers import DynamicCache, PreTrainedModel

from thundersync_core.batch import Turn
from thundersync_core.streaming.vocab import chunk_vocab_forward


class TurnScores(NamedTuple):
    """A turn's teacher scores: per scored token its log-prob, and (k per token, k = the
    teacher's ``top_k``) the most likely tokens and their log-probs, most likely first."""

    logprobs: tuple[float, ...]
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


class Teacher:
    def __init__(self, model: PreTrainedModel, *, top_k: int = 0) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        vocab = model.get_output_embeddings().weight.shape[0]
        if not 0 <= top_k <= vocab:
            raise ValueError(f"opd_teacher_top_k: {top_k} is not in [0, {vocab}] (the vocabulary)")
        self.top_k = top_k
        self._sessions: dict[str, tuple[DynamicCache, list[int]]] = {}

    def score(self, turn: Turn) -> tuple[float, ...]:
        """The teacher's log-prob of each scored action token of ``turn``, in order."""
        return self.score_turn(turn).logprobs

    @torch.no_grad()
    def score_turn(self, turn: Turn) -> TurnScores:
        """The teacher's scores of each scored action token of ``turn``, in order."""
        action = turn.action
        tokens = list(turn.prompt_ids) + [i for s in turn.segments for i in s.ids]
        cache, seen = self._sessions.pop(turn.trajectory_id, (DynamicCache(), []))
        if tokens[: len(seen)] != seen:
            cache, seen = DynamicCache(), []  # not a continuation: start over
        scores = TurnScores(())
        if action is not None and action.ids:
            start = len(tokens) - len(action.ids)
            done = len(seen)
            ids_T = torch.tensor(tokens[done : len(tokens) - 1], device=self.device)
            targets_T = torch.tensor(tokens[done + 1 :], device=self.device)
            scored_T = torch.zeros(len(ids_T), dtype=torch.bool, device=self.device)
            scored_T[start - 1 - done :] = torch.tensor(
                action.scored, dtype=torch.bool, device=self.device
            )
            logp_NV, _ = chunk_vocab_forward(self.model, ids_T, scored_T, cache)
            logprobs_N = logp_NV.gather(-1, targets_T[scored_T][:, None])[:, 0]
            scores = TurnScores(tuple(float(x) for x in logprobs_N.to(torch.float64)))
            if self.top_k and len(logp_NV):
                top_NK, ids_NK = logp_NV.topk(self.top_k, dim=-1)
                scores = scores._replace(
                    top_ids=tuple(int(i) for i in ids_NK.flatten()),
                    top_logprobs=tuple(float(x) for x in top_NK.flatten().to(torch.float64)),
                )
            seen = tokens[:-1]
        if not turn.last:
            self._sessions[turn.trajectory_id] = (cache, seen)
        return scores

    def open_sessions(self) -> int:
        return len(self._sessions)


class TeacherWorker:
    """A teacher on its own thread; turns are scored in submission order."""

    def __init__(self, teacher: Teacher) -> None:
        self.teacher = teacher
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="teacher")

    def submit(self, turn: Turn) -> Future[tuple[float, ...]]:
        return self._pool.submit(self.teacher.score, turn)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> TeacherWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
