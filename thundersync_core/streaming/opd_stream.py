"""The streaming OPD learner: a turn's backward runs as soon as the teacher has scored it.

Positions [0, P-1) of the prompt are the group's shared prefix (forwarded once per group).
Each open trajectory keeps the keys/values of its positions since then, detached, and an
adjoint ledger of the same shape. When turn k arrives (action tokens at positions [a, e)):

1. the chunk [done, e-1) is forwarded: the context that arrived since the last turn
   (the previous action's last token, the observation) plus the action but its last token,
   whose hidden states predict exactly the action's tokens. It attends to one detached leaf
   per layer holding every earlier key/value (prompt and earlier turns);
2. the turn's loss is backpropagated at once into the parameters; what it puts on the
   earlier keys/values is added to the trajectory's ledger (and the prompt's);
3. the chunk's keys/values are appended, detached. No activation graph outlives the turn.

At trajectory close the ledger is replayed once: the positions before the last chunk are
recomputed in one forward after the prompt and the ledger is backpropagated through it.
Autograd visits the segments last to first, so each segment's keys/values receive the
gradient every later turn put on them, in one pass. The last chunk is never recomputed (no
later position reads it), and a trailing observation is never forwarded. The prompt's
ledger is replayed when the group's last trajectory closes. Live memory per open trajectory
is its keys/values plus their ledger: linear in its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from thundersync_core.batch import Trajectory, Turn, turns_of
from thundersync_core.objectives.opd import (
    batch_scale,
    check_turn_scores,
    check_turn_top,
    split_by_turn,
    turn_loss,
    turn_vocab_loss,
)
from thundersync_core.policy.logprobs import cache_from_flat, chunk_forward
from thundersync_core.streaming.base import LearnerBase, LearnerRefusal
from thundersync_core.streaming.prefix import SharedPrefix, backward_adjoints
from thundersync_core.streaming.vocab import chunk_vocab_forward

SEQ_DIM = -2  # keys/values are [batch, kv_heads, positions, head_dim]


@dataclass
class _GroupPrompt:
    prefix: SharedPrefix | None
    ledger: list[torch.Tensor] | None = None


@dataclass
class _OpenTrajectory:
    trajectory_id: str
    group_id: str
    tokens: list[int]
    prefix_len: int  # P - 1: positions held by the group's prompt prefix
    forwarded: int  # positions [0, forwarded) have keys/values
    last_chunk_start: int
    next_turn: int = 0
    kv: list[torch.Tensor] | None = None  # positions [prefix_len, forwarded), detached
    ledger: list[torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        tensors = (self.kv or []) + (self.ledger or [])
        return sum(t.numel() * t.element_size() for t in tensors)


def _add_into(ledger: list[torch.Tensor] | None, grads, like, dtype) -> list[torch.Tensor]:
    if ledger is None:
        ledger = [torch.zeros_like(t, dtype=dtype) for t in like]
    for acc, g in zip(ledger, grads, strict=True):
        if g is not None:
            acc.add_(g.to(dtype))
    return ledger


class StreamingOPDLearner(LearnerBase):
    maximise = False
    tracks_reverse_kl = True

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        accum_dtype: torch.dtype | None = None,
        policy_version: int = 0,
        max_lag: int = 0,
        is_clip: float | None = None,
        teacher_top_k: int = 0,
    ) -> None:
        super().__init__(
            model,
            accum_dtype=accum_dtype,
            policy_version=policy_version,
            max_lag=max_lag,
            is_clip=is_clip,
        )
        #: 0: the one-sample reverse-KL loss; k: the reverse KL over the vocabulary against
        #: the teacher's top k (every turn must carry them).
        self.teacher_top_k = teacher_top_k
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        #: (trajectory_id, positions recomputed) for every trajectory replay, in order.
        self.replay_log: list[tuple[str, int]] = []

    def _on_begin(self) -> None:
        self._prompts: dict[str, _GroupPrompt] = {}
        self._open: dict[str, _OpenTrajectory] = {}
        self.replay_log = []
        self._stats = {"turn_backwards": 0, "turn_forwards": 0, "trajectory_replays": 0}
        self._stats |= {"prefix_replays": 0, "peak_live_kv_bytes": 0}

    def _scale(self) -> float:
        return batch_scale(self._n_scored_tokens)

    # -- sources ---------------------------------------------------------------------------
    def submit(self, traj: Trajectory) -> None:
        """All turns of a finished trajectory, in order (teacher log-probs in the record)."""
        for turn in turns_of(traj, split_by_turn(traj)):
            self.submit_turn(turn)

    def submit_turn(self, turn: Turn) -> None:
        tokens = list(turn.prompt_ids) + [i for s in turn.segments for i in s.ids]
        state = self._admit(turn, tokens)
        action = turn.action
        n_scored = sum(action.scored) if action is not None else 0
        check_turn_scores(turn.trajectory_id, turn.index, n_scored, turn.teacher_logprobs)
        if self.teacher_top_k:
            check_turn_top(turn, n_scored, self.teacher_top_k, self.vocab_size)
        self._n_sources += 1
        self._n_scored_tokens += n_scored
        if action is not None and action.ids:
            state.tokens = tokens
            self._forward_turn(state, turn)
        state.next_turn += 1
        live = self.live_kv_bytes()
        self._stats["peak_live_kv_bytes"] = max(self._stats["peak_live_kv_bytes"], live)
        if turn.last:
            self._close_trajectory(turn.trajectory_id)

    def _admit(self, turn: Turn, tokens: list[int]) -> _OpenTrajectory:
        tid = turn.trajectory_id
        state = self._open.get(tid)
        if state is None:
            if turn.index != 0:
                raise LearnerRefusal(f"trajectory {tid!r}: turn {turn.index} arrived before turn 0")
            self._check_source(turn.group_id, tid, turn.prompt_ids, turn.policy_version)
            self._group_prompt(turn.group_id)
            n = len(turn.prompt_ids) - 1
            state = _OpenTrajectory(tid, turn.group_id, list(turn.prompt_ids), n, n, n)
            self._open[tid] = state
            return state
        self._check_versions()
        if turn.index != state.next_turn:
            raise LearnerRefusal(
                f"trajectory {tid!r}: turn {turn.index} arrived, expected turn {state.next_turn}"
            )
        if tokens[: len(state.tokens)] != state.tokens:
            raise LearnerRefusal(
                f"trajectory {tid!r} turn {turn.index}: does not extend the trajectory's earlier "
                "turns (different prompt or tokens)"
            )
        self._check_version(f"{tid} turn {turn.index}", turn.policy_version)
        return state

    def _group_prompt(self, group_id: str) -> _GroupPrompt:
        if group_id not in self._prompts:
            prompt = self._groups[group_id].prompt_ids
            prefix = SharedPrefix(self.model, prompt[:-1]) if len(prompt) > 1 else None
            self._prompts[group_id] = _GroupPrompt(prefix)
        return self._prompts[group_id]

    # -- gradient work ---------------------------------------------------------------------
    def _context_leaves(self, state: _OpenTrajectory) -> list[torch.Tensor]:
        """One detached leaf per layer key/value: the prompt prefix then the trajectory."""
        prefix = self._prompts[state.group_id].prefix
        parts = [prefix.proxies] if prefix is not None else []
        if state.kv is not None:
            parts.append(state.kv)
        if not parts:
            return []
        return [
            torch.cat([p[i] for p in parts], dim=SEQ_DIM).detach().requires_grad_(True)
            for i in range(len(parts[0]))
        ]

    def _forward_turn(self, state: _OpenTrajectory, turn: Turn) -> None:
        action = turn.action
        assert action is not None
        end = len(state.tokens)
        start = end - len(action.ids)
        done = state.forwarded
        ids_T = torch.tensor(state.tokens[done : end - 1], device=self.device)
        targets_T = torch.tensor(state.tokens[done + 1 : end], device=self.device)
        scored_T = torch.zeros(end - 1 - done, dtype=torch.bool, device=self.device)
        scored_T[start - 1 - done :] = torch.tensor(action.scored, dtype=torch.bool)
        leaves = self._context_leaves(state)
        cache = cache_from_flat(leaves)
        with torch.set_grad_enabled(bool(scored_T.any())):
            if self.teacher_top_k:
                logp_NV, new_kv = chunk_vocab_forward(self.model, ids_T, scored_T, cache)
                targets_N = targets_T[scored_T]
                logprobs_N = logp_NV.gather(-1, targets_N[:, None])[:, 0]
            else:
                logprobs_N, new_kv = chunk_forward(self.model, ids_T, targets_T, scored_T, cache)
        self._stats["turn_forwards"] += 1
        if logprobs_N.numel():
            source = f"trajectory {turn.trajectory_id!r} turn {turn.index}"
            teacher_N = torch.tensor(
                turn.teacher_logprobs, dtype=logprobs_N.dtype, device=self.device
            )
            # Over the vocabulary the KL at a visited position is exact: the weights are
            # counted (the run's importance-weight record) but not applied.
            weights_N = self._importance_weights(source, logprobs_N, turn.behaviour_logprobs)
            if self.teacher_top_k:
                top_ids_NK, top_logprobs_NK = self._turn_top(turn, logp_NV.dtype)
                loss, log_ratio = turn_vocab_loss(
                    logp_NV, targets_N, teacher_N, top_ids_NK, top_logprobs_NK
                )
            else:
                loss, log_ratio = turn_loss(logprobs_N, teacher_N, weights_N)
            if not torch.isfinite(loss):
                raise LearnerRefusal(f"{source}: its loss is {float(loss)} (not finite)")
            grads = torch.autograd.grad(loss, self.params + leaves, allow_unused=True)
            self._add_grads(grads[: len(self.params)])
            self._spread_context_adjoint(state, leaves, grads[len(self.params) :])
            self._add_opd_terms(loss, log_ratio)
            self._stats["turn_backwards"] += 1
        self._append_kv(state, [t.detach() for t in new_kv])
        state.last_chunk_start, state.forwarded = done, end - 1

    def _turn_top(self, turn: Turn, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.teacher_top_k
        ids = torch.tensor(turn.teacher_top_ids, device=self.device).view(-1, k)
        logprobs = torch.tensor(turn.teacher_top_logprobs, dtype=dtype, device=self.device)
        return ids, logprobs.view(-1, k)

    def _spread_context_adjoint(
        self,
        state: _OpenTrajectory,
        leaves: list[torch.Tensor],
        grads: tuple[torch.Tensor | None, ...],
    ) -> None:
        """Split each leaf's gradient into the prompt's ledger and the trajectory's."""
        n_prefix = state.prefix_len
        prompt = self._prompts[state.group_id]
        if prompt.prefix is not None:
            head = [g.narrow(SEQ_DIM, 0, n_prefix) if g is not None else None for g in grads]
            prompt.ledger = _add_into(prompt.ledger, head, prompt.prefix.proxies, self.accum_dtype)
        if state.kv is not None:
            n_own = leaves[0].shape[SEQ_DIM] - n_prefix
            tail = [g.narrow(SEQ_DIM, n_prefix, n_own) if g is not None else None for g in grads]
            if state.ledger is not None:
                state.ledger = [_pad_to(t, n_own) for t in state.ledger]
            state.ledger = _add_into(state.ledger, tail, state.kv, self.accum_dtype)

    def _append_kv(self, state: _OpenTrajectory, new_kv: list[torch.Tensor]) -> None:
        if state.kv is None:
            state.kv = new_kv
        else:
            state.kv = [
                torch.cat([a, b], dim=SEQ_DIM) for a, b in zip(state.kv, new_kv, strict=True)
            ]

    def _close_trajectory(self, trajectory_id: str) -> None:
        state = self._open.pop(trajectory_id)
        n_replay = state.last_chunk_start - state.prefix_len
        if state.ledger is not None and n_replay > 0:
            self._replay_trajectory(state, n_replay)
        state.kv = state.ledger = None
        self._mark_done(state.group_id, trajectory_id)
        if self._group_complete(state.group_id):
            self._replay_prompt(state.group_id)

    def _replay_trajectory(self, state: _OpenTrajectory, n_replay: int) -> None:
        """Recompute positions [P-1, last chunk) once and backpropagate their ledger."""
        assert state.ledger is not None
        prompt = self._prompts[state.group_id]
        proxies = prompt.prefix.proxies if prompt.prefix is not None else []
        ids_T = torch.tensor(
            state.tokens[state.prefix_len : state.last_chunk_start], device=self.device
        )
        nothing_T = torch.zeros(n_replay, dtype=torch.bool, device=self.device)
        _, new_kv = chunk_forward(self.model, ids_T, ids_T, nothing_T, cache_from_flat(proxies))
        # The ledger ends where the last backward left it: zero-extend over later positions.
        ledger = [_pad_to(a, n_replay).narrow(SEQ_DIM, 0, n_replay) for a in state.ledger]
        grads = backward_adjoints(new_kv, ledger, self.params + proxies)
        self._add_grads(grads[: len(self.params)])
        if prompt.prefix is not None:
            prompt.ledger = _add_into(
                prompt.ledger, grads[len(self.params) :], proxies, self.accum_dtype
            )
        self.replay_log.append((state.trajectory_id, n_replay))
        self._stats["trajectory_replays"] += 1

    def _replay_prompt(self, group_id: str) -> None:
        prompt = self._prompts.pop(group_id)
        if prompt.prefix is None:
            return
        if prompt.ledger is None:
            prompt.prefix.release()
            return
        self._add_grads(prompt.prefix.replay(prompt.ledger, self.params))
        self._stats["prefix_replays"] += 1

    # -- state -----------------------------------------------------------------------------
    def live_kv_bytes(self) -> int:
        """Keys/values and ledgers held for open trajectories and their groups' prompts."""
        total = sum(s.nbytes for s in self._open.values())
        for prompt in self._prompts.values():
            if prompt.prefix is not None:
                total += prompt.prefix.nbytes
            total += sum(t.numel() * t.element_size() for t in prompt.ledger or [])
        return total

    def _pending_work(self) -> str:
        if self._open:
            return f"{len(self._open)} trajectory(ies) still open: {sorted(self._open)[:5]}"
        if self._prompts:
            return f"prompt replay pending for groups {sorted(self._prompts)[:5]}"
        return ""

    def _counters(self) -> dict[str, int]:
        return dict(self._stats)


def _pad_to(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-extend a ledger along the position axis to cover newly appended positions."""
    missing = length - tensor.shape[SEQ_DIM]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[SEQ_DIM] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=SEQ_DIM)
