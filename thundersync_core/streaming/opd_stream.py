"""The streaming OPD learner: a turn's backward runs as soon as the teacher has scored it.

Per trajectory the learner holds a list of key/value chunks (see ``chunks.py``); positions
[0, P-1) of the prompt are the group's shared prefix. When turn k arrives (action tokens at
positions [a, e)):

1. context not yet forwarded, [done, a-1), (observations, the previous action's last
   token) becomes a context chunk, forwarded without grad;
2. the action chunk [a-1, e-1) is forwarded after the proxies of every earlier chunk; its
   hidden states predict exactly the action's tokens; its loss is backpropagated at once
   into the parameters and into the earlier chunks' adjoint ledgers.

At trajectory close each chunk with a non-empty ledger is recomputed and its ledger
backpropagated, last chunk first (each chunk once; a chunk's ledger is complete when every
later chunk has replayed). The prompt's ledger is replayed once when the group's last
trajectory closes. A trailing observation is never forwarded. Live memory per open
trajectory is its keys/values plus their ledgers: linear in its length, with no activation
graph alive between turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from thundersync_core.batch import Trajectory, Turn, turns_of
from thundersync_core.objectives.opd import (
    batch_scale,
    check_turn_scores,
    split_by_turn,
    turn_loss,
)
from thundersync_core.policy.logprobs import chunk_forward
from thundersync_core.streaming.base import LearnerBase, LearnerRefusal
from thundersync_core.streaming.chunks import KVChunk, cache_over
from thundersync_core.streaming.prefix import SharedPrefix


@dataclass
class _GroupPrefix:
    prefix: SharedPrefix | None
    chunk: KVChunk | None


@dataclass
class _OpenTrajectory:
    trajectory_id: str
    group_id: str
    tokens: list[int]
    forwarded: int  # positions [0, forwarded) have keys/values in the prefix or chunks
    next_turn: int = 0
    chunks: list[KVChunk] = field(default_factory=list)


class StreamingOPDLearner(LearnerBase):
    maximise = False

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        accum_dtype: torch.dtype | None = None,
        policy_version: int = 0,
    ) -> None:
        super().__init__(model, accum_dtype=accum_dtype, policy_version=policy_version)
        #: (trajectory_id, chunk index) of every chunk replay, in order (for audits).
        self.replay_log: list[tuple[str, int]] = []

    def _on_begin(self) -> None:
        self._prefixes: dict[str, _GroupPrefix] = {}
        self._open: dict[str, _OpenTrajectory] = {}
        self.replay_log = []
        self._stats = {"turn_backwards": 0, "context_chunks": 0, "chunk_replays": 0}
        self._stats |= {"prefix_replays": 0, "peak_live_kv_bytes": 0}

    def _scale(self) -> float:
        return batch_scale(self._n_scored_tokens)

    # -- sources ---------------------------------------------------------------------------
    def submit(self, traj: Trajectory) -> None:
        """All turns of a finished trajectory, in order (teacher log-probs in the record)."""
        for turn in turns_of(traj, split_by_turn(traj)):
            self.submit_turn(turn)

    def submit_turn(self, turn: Turn) -> None:
        state = self._admit(turn)
        action = turn.action
        n_scored = sum(action.scored) if action is not None else 0
        check_turn_scores(turn.trajectory_id, turn.index, n_scored, turn.teacher_logprobs)
        self._n_sources += 1
        self._n_scored_tokens += n_scored
        if action is not None:
            state.tokens = list(turn.prompt_ids) + [i for s in turn.segments for i in s.ids]
            self._forward_turn(state, turn)
        state.next_turn += 1
        self._stats["peak_live_kv_bytes"] = max(
            self._stats["peak_live_kv_bytes"], self.live_kv_bytes()
        )
        if turn.last:
            self._close_trajectory(turn.trajectory_id)

    def _admit(self, turn: Turn) -> _OpenTrajectory:
        tid = turn.trajectory_id
        state = self._open.get(tid)
        if state is None:
            if turn.index != 0:
                raise LearnerRefusal(f"trajectory {tid!r}: turn {turn.index} arrived before turn 0")
            self._check_source(turn.group_id, tid, turn.prompt_ids, turn.policy_version)
            self._group_prefix(turn.group_id)
            state = _OpenTrajectory(
                tid, turn.group_id, list(turn.prompt_ids), len(turn.prompt_ids) - 1
            )
            self._open[tid] = state
            return state
        self._check_versions()
        if turn.index != state.next_turn:
            raise LearnerRefusal(
                f"trajectory {tid!r}: turn {turn.index} arrived, expected turn {state.next_turn}"
            )
        known = list(turn.prompt_ids) + [i for s in turn.segments for i in s.ids]
        if known[: len(state.tokens)] != state.tokens or turn.policy_version != self.policy_version:
            raise LearnerRefusal(
                f"trajectory {tid!r} turn {turn.index}: does not extend the trajectory's earlier "
                "turns (different prompt, tokens or policy version)"
            )
        return state

    def _group_prefix(self, group_id: str) -> _GroupPrefix:
        if group_id not in self._prefixes:
            prompt = self._groups[group_id].prompt_ids
            if len(prompt) > 1:
                prefix = SharedPrefix(self.model, prompt[:-1])
                entry = _GroupPrefix(prefix, KVChunk(prompt[:-1], prefix.proxies))
            else:
                entry = _GroupPrefix(None, None)
            self._prefixes[group_id] = entry
        return self._prefixes[group_id]

    # -- gradient work ---------------------------------------------------------------------
    def _predecessors(self, state: _OpenTrajectory, upto: int) -> list[KVChunk]:
        head = self._prefixes[state.group_id].chunk
        return ([head] if head is not None else []) + state.chunks[:upto]

    def _forward_turn(self, state: _OpenTrajectory, turn: Turn) -> None:
        action = turn.action
        assert action is not None
        end = len(state.tokens)
        start = end - len(action.ids)
        if start == end:
            return  # an empty action: nothing to predict, its context waits for the next turn
        if state.forwarded < start - 1:
            self._context_chunk(state, start - 1)
        ids = state.tokens[state.forwarded : end - 1]
        before = self._predecessors(state, len(state.chunks))
        ids_T = torch.tensor(ids, device=self.device)
        targets_T = torch.tensor(state.tokens[state.forwarded + 1 : end], device=self.device)
        scored_T = torch.tensor(action.scored, dtype=torch.bool, device=self.device)
        logprobs_N, new_kv = chunk_forward(
            self.model, ids_T, targets_T, scored_T, cache_over([c.proxies for c in before])
        )
        if logprobs_N.numel():
            teacher_N = torch.tensor(turn.teacher_logprobs, dtype=logprobs_N.dtype)
            loss = turn_loss(logprobs_N, teacher_N.to(self.device))
            proxies = [p for c in before for p in c.proxies]
            grads = torch.autograd.grad(loss, self.params + proxies, allow_unused=True)
            self._add_grads(grads[: len(self.params)])
            self._spread_adjoints(before, grads[len(self.params) :])
            self._objective_sum += float(loss.detach())
            self._stats["turn_backwards"] += 1
        state.chunks.append(KVChunk.from_kv(ids, new_kv))
        state.forwarded = end - 1

    def _context_chunk(self, state: _OpenTrajectory, upto: int) -> None:
        ids = state.tokens[state.forwarded : upto]
        before = self._predecessors(state, len(state.chunks))
        empty = torch.zeros(len(ids), dtype=torch.bool, device=self.device)
        with torch.no_grad():
            _, new_kv = chunk_forward(
                self.model,
                torch.tensor(ids, device=self.device),
                torch.zeros(len(ids), dtype=torch.long, device=self.device),
                empty,
                cache_over([c.proxies for c in before]),
            )
        state.chunks.append(KVChunk.from_kv(ids, new_kv))
        state.forwarded = upto
        self._stats["context_chunks"] += 1

    def _spread_adjoints(
        self, chunks: list[KVChunk], grads: tuple[torch.Tensor | None, ...]
    ) -> None:
        offset = 0
        for chunk in chunks:
            n = len(chunk.proxies)
            chunk.add_adjoint(grads[offset : offset + n], self.accum_dtype)
            offset += n

    def _close_trajectory(self, trajectory_id: str) -> None:
        state = self._open.pop(trajectory_id)
        for index in range(len(state.chunks) - 1, -1, -1):
            chunk = state.chunks[index]
            if chunk.ledger is not None:
                self._replay_chunk(state, index)
            state.chunks[index] = KVChunk(chunk.input_ids, [])  # free keys/values
        self._mark_done(state.group_id, trajectory_id)
        if self._group_complete(state.group_id):
            self._replay_prefix(state.group_id)

    def _replay_chunk(self, state: _OpenTrajectory, index: int) -> None:
        chunk = state.chunks[index]
        assert chunk.ledger is not None
        before = self._predecessors(state, index)
        n = len(chunk.input_ids)
        _, new_kv = chunk_forward(
            self.model,
            torch.tensor(chunk.input_ids, device=self.device),
            torch.zeros(n, dtype=torch.long, device=self.device),
            torch.zeros(n, dtype=torch.bool, device=self.device),
            cache_over([c.proxies for c in before]),
        )
        proxies = [p for c in before for p in c.proxies]
        grads = torch.autograd.grad(
            new_kv,
            self.params + proxies,
            grad_outputs=[a.to(t.dtype) for a, t in zip(chunk.ledger, new_kv, strict=True)],
            allow_unused=True,
        )
        self._add_grads(grads[: len(self.params)])
        self._spread_adjoints(before, grads[len(self.params) :])
        self.replay_log.append((state.trajectory_id, index))
        self._stats["chunk_replays"] += 1

    def _replay_prefix(self, group_id: str) -> None:
        entry = self._prefixes.pop(group_id)
        if entry.prefix is None or entry.chunk is None:
            return
        if entry.chunk.ledger is None:
            entry.prefix.release()
            return
        self._add_grads(entry.prefix.replay(entry.chunk.ledger, self.params))
        self._stats["prefix_replays"] += 1

    # -- state -----------------------------------------------------------------------------
    def live_kv_bytes(self) -> int:
        """Keys/values and ledgers held for open trajectories and their group prompts."""
        total = sum(c.nbytes for s in self._open.values() for c in s.chunks)
        return total + sum(e.chunk.nbytes for e in self._prefixes.values() if e.chunk)

    def _pending_work(self) -> str:
        if self._open:
            return f"{len(self._open)} trajectory(ies) still open: {sorted(self._open)[:5]}"
        if self._prefixes:
            return f"prompt replay pending for groups {sorted(self._prefixes)[:5]}"
        return ""

    def _counters(self) -> dict[str, int]:
        return dict(self._stats)
