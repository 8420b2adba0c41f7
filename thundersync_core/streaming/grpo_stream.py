"""The streaming GRPO learner: one backward per trajectory as its reward lands.

Each admitted group keeps two sufficient statistics over the parameters and over its
prompt's key/value proxies (see ``objectives/grpo.py`` for why they make the update exact):

    x2 = sum_i grad S_i,     x1 = sum_i (r_i - shift) grad S_i

At group close the combination a*x1 + b*x2 is added to the batch gradient, and its proxy
part is replayed through the prompt once. At most ``max_open_groups`` groups hold live
statistics (each costs two gradient-sized buffers); a trajectory of a further group is held,
as token ids only, until a group closes. Work is conserving: a close admits held sources at
once.

Float sums depend on their order. With ``order="arrival"`` (the default) a trajectory's
gradient enters its group's statistics as its reward lands, so two runs whose rewards land
in different orders differ in the last bits (about 1e-7 relative in float32). With
``order="fixed"`` each backward still runs the moment its reward lands, but the sums are
taken in trajectory-id order within a group (at its close) and in group-id order across
groups (at the barrier): the update is then bitwise the one this learner computes from the
batch in sorted order, which is what the sync schedule hands it, whatever the arrival order.
It costs memory: an open group holds one gradient per arrived trajectory instead of two
statistics, and a closed group holds its contribution until the barrier.

``submit_many`` takes several landed trajectories at once (what queued while the learner
was busy). Those that close their group run as packs: right-padded forwards over the
group's prompt cache, each of at most ``pack_tokens`` padded tokens, the rows cut by length
where padding would cost more than another pack (``_packs``: a group's one long episode
runs alone instead of widening the others to its length). Every advantage
A_i = a (r_i - shift) + b is then known, so one backward of sum_i A_i S_i a pack joins
a x1 + b x2 of the trajectories before them. A pack that left its group open would need two
backwards (sum_i S_i into x2, sum_i (r_i - shift) S_i into x1), as many row backwards as
one at a time, so the members of a group that stays open run one at a time.
The sufficient statistics, hence the update, are the per-trajectory path's (up to float
rounding: a padded row is summed in another order).

Release per closed group (``release="group"``): a trajectory's advantage is final once
every reward of its group is known, so a trajectory can wait, as token ids, for its group's
last reward and then run with that advantage (one backward of sum_i A_i S_i per pack, or
per trajectory without packs) straight into the batch gradient. No group holds the two
gradient-sized statistics: memory is the batch gradient alone (plus one transient
gradient while a group runs), at the price of overlap, since no backward of a group starts
before its last reward. ``release="trajectory"`` (the default) runs each backward as its
reward lands.

Packs with ``order="fixed"``: a group's trajectories wait, as token ids, until its last
lands; the group then runs in trajectory-id order as packs (each knows its advantages: one
backward each) and its contribution waits for the barrier, which adds them in group-id
order. Nothing depends on the arrival, so a thundersync update is bitwise the sync one
(whose whole batch arrives at once) and the work is the packed sync learner's; the cost is
that a group's backward starts at its last reward instead of at each.

Chunks (``chunks`` > 1, with ``order="fixed"`` and packs, for groups whose trajectory ids
are planned, ``GroupSpec.members``): the group's sorted ids are cut into ``chunks`` runs, a
plan fixed before anything lands. A chunk runs once its members have landed: its members
split by reward value, each value's packs one backward of sum_i S_i (weight 1), and the
gradient G_{c,v} kept until the group closes, which adds A(v) G_{c,v} in chunk and value
order (A(v) the advantage of reward v). Every trajectory of a value has the same advantage,
so this is sum_i A_i grad S_i; with 0/1 rewards a chunk takes at most two backwards. A chunk
whose rewards are all equal waits for its group's close (the group may turn out uniform,
whose advantages are all 0 and which takes no backward); a chunk with two reward values
proves the group is not, so it runs at once. Sync runs the same chunks at close in the same
order: the update is still bitwise thundersync's, and the work is only the chunk split's
extra packs; the overlap is that a group's first chunks run before its last reward.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PreTrainedModel

from thundersync_core.batch import Trajectory
from thundersync_core.objectives.grpo import LossAgg, advantages, close_coefficients, is_uniform
from thundersync_core.policy.logprobs import scored_logprobs
from thundersync_core.streaming.base import GroupSpec, LearnerRefusal
from thundersync_core.streaming.grpo_base import GRPOLearnerBase
from thundersync_core.streaming.prefix import SharedPrefix


@dataclass
class _OpenGroup:
    spec: GroupSpec
    prefix: SharedPrefix | None
    shift: float | None = None
    rewards: list[float] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    x1: list[torch.Tensor] | None = None
    x2: list[torch.Tensor] | None = None
    #: order="fixed": trajectory id -> (reward, score, gradients), summed at close.
    arrived: dict[str, tuple[float, float, list[torch.Tensor | None] | None]] = field(
        default_factory=dict
    )
    #: chunks: chunk index -> (reward value, the gradient of sum_i S_i over its members
    #: of that value) in value order, and each run member's (reward, score) by id.
    chunk_grads: dict[int, list[tuple[float, list[torch.Tensor | None]]]] = field(
        default_factory=dict
    )
    chunk_scores: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.rewards) == self.spec.size


class StreamingGRPOLearner(GRPOLearnerBase):
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        loss_agg: LossAgg = "seq-sum",
        max_open_groups: int = 4,
        accum_dtype: torch.dtype | None = None,
        policy_version: int = 0,
        max_lag: int = 0,
        is_clip: float | None = None,
        order: Literal["arrival", "fixed"] = "arrival",
        release: Literal["trajectory", "group"] = "trajectory",
        chunks: int = 1,
    ) -> None:
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        if max_open_groups < 1:
            raise ValueError(f"max_open_groups must be >= 1, got {max_open_groups}")
        if order not in ("arrival", "fixed"):
            raise ValueError(f"order must be 'arrival' or 'fixed', got {order!r}")
        if release not in ("trajectory", "group"):
            raise ValueError(f"release must be 'trajectory' or 'group', got {release!r}")
        super().__init__(
            model,
            loss_agg=loss_agg,
            accum_dtype=accum_dtype,
            policy_version=policy_version,
            max_lag=max_lag,
            is_clip=is_clip,
        )
        self.max_open_groups = max_open_groups
        self.order = order
        self.release = release
        self.chunks = chunks

    def _on_begin(self) -> None:
        self._open: dict[str, _OpenGroup] = {}
        #: order="fixed": group id -> (objective term, parameter gradient parts), added at
        #: the barrier in group-id order.
        self._closed: dict[str, tuple[float, list[list[torch.Tensor | None]]]] = {}
        self._held: deque[Trajectory] = deque()
        #: order="fixed" with packs: group id -> its landed trajectories, until the last.
        self._waiting: dict[str, list[Trajectory]] = {}
        self._stats = {"groups_closed": 0, "prefix_replays": 0, "sources_held": 0}
        self._stats |= {"peak_open_groups": 0, "trajectory_backwards": 0}
        self._stats |= {"pack_backwards": 0, "packed_trajectories": 0}
        self._stats |= {"chunks_run": 0, "chunks_run_early": 0, "uniform_groups_skipped": 0}

    def _on_submit(self, traj: Trajectory) -> None:
        if self.release == "group":
            self._run_whole_groups([traj], pack_tokens=0)
            return
        if traj.group_id in self._open or len(self._open) < self.max_open_groups:
            self._process(traj)
            self._admit_held()
        else:
            self._held.append(traj)
            self._stats["sources_held"] += 1

    def _admit_held(self) -> None:
        progressed = True
        while progressed and self._held:
            progressed = False
            for traj in list(self._held):
                if traj.group_id in self._open or len(self._open) < self.max_open_groups:
                    self._held.remove(traj)
                    self._process(traj)
                    progressed = True
                    break

    def _open_group(self, group_id: str) -> _OpenGroup:
        spec = self._groups[group_id]
        prefix = (
            SharedPrefix(self.model, spec.prompt_ids[:-1]) if len(spec.prompt_ids) > 1 else None
        )
        group = _OpenGroup(spec=spec, prefix=prefix)
        self._open[group_id] = group
        self._stats["peak_open_groups"] = max(self._stats["peak_open_groups"], len(self._open))
        return group

    def _process(self, traj: Trajectory) -> None:
        group = self._open.get(traj.group_id) or self._open_group(traj.group_id)
        score, grads = self._score_and_grad(traj, group.prefix)
        if self.order == "fixed":
            group.arrived[traj.trajectory_id] = (traj.reward, score, grads)
            group.rewards.append(traj.reward)
            if group.complete:
                self._sum_in_order(group)
                self._close(traj.group_id)
            return
        if group.shift is None:
            group.shift = traj.reward
        group.rewards.append(traj.reward)
        group.scores.append(score)
        if grads is not None:
            self._accumulate(group, grads, traj.reward - group.shift)
        del grads  # not held through the close's combination
        if group.complete:
            self._close(traj.group_id)

    # -- packs -----------------------------------------------------------------------------
    def submit_many(self, trajs: Sequence[Trajectory], *, pack_tokens: int = 0) -> None:
        """Several landed trajectories; those of one group run as packs of at most
        ``pack_tokens`` padded tokens (0: one trajectory at a time, as ``submit``)."""
        if pack_tokens <= 0:
            for traj in trajs:
                self.submit(traj)
            return
        if self.order == "fixed" or self.release == "group":
            for traj in trajs:
                self._check_reward(traj)
                self._accept_whole(traj)
            self._run_whole_groups(trajs, pack_tokens)
            return
        by_group: dict[str, list[Trajectory]] = {}
        for traj in trajs:
            self._check_reward(traj)
            self._accept_whole(traj)
            by_group.setdefault(traj.group_id, []).append(traj)
        for group_id, members in by_group.items():
            if group_id in self._open or len(self._open) < self.max_open_groups:
                self._run_landed(group_id, members, pack_tokens)
                self._admit_held()
            else:
                self._held.extend(members)
                self._stats["sources_held"] += len(members)

    def _run_whole_groups(self, trajs: Sequence[Trajectory], pack_tokens: int) -> None:
        """Accepted trajectories whose backward waits for their group's last reward
        (release="group", or order="fixed" with packs): a group's trajectories wait, as
        token ids, until the last lands; then the group runs in trajectory-id order as
        packs of at most ``pack_tokens`` padded tokens (0: one trajectory a pack) that all
        know their advantages (one backward each). With order="fixed" its contribution
        waits for the barrier, so every float sum is taken in an order fixed by the ids,
        whatever the arrival: the update is bitwise the one of the whole batch handed over
        at once (sync's); with order="arrival" it joins the batch gradient at once."""
        for traj in trajs:
            self._waiting.setdefault(traj.group_id, []).append(traj)
        for group_id in sorted({traj.group_id for traj in trajs}):
            members = self._waiting[group_id]
            if self._chunked(group_id, pack_tokens):
                self._run_chunks(group_id, pack_tokens)
                continue
            if len(members) < self._groups[group_id].size:
                continue
            del self._waiting[group_id]
            members.sort(key=lambda traj: traj.trajectory_id)
            self._run_closing(group_id, members, pack_tokens)

    # -- chunks ----------------------------------------------------------------------------
    def _chunked(self, group_id: str, pack_tokens: int) -> bool:
        """Whether a group runs as chunks: asked for, ids planned, fixed order and packs."""
        spec = self._groups[group_id]
        return (
            self.chunks > 1
            and bool(spec.members)
            and self.order == "fixed"
            and self.release == "trajectory"
            and pack_tokens > 0
        )

    def _chunk_plan(self, group_id: str) -> list[tuple[str, ...]]:
        """The group's sorted planned ids cut into ``chunks`` runs of near-equal size."""
        ids = sorted(self._groups[group_id].members)
        n = min(self.chunks, len(ids))
        return [tuple(ids[k * len(ids) // n : (k + 1) * len(ids) // n]) for k in range(n)]

    def _run_chunks(self, group_id: str, pack_tokens: int) -> None:
        """Run every chunk of the group that may run now; close the group once all landed.
        A chunk runs when its members have landed and either carry two reward values (the
        group is then surely not uniform) or the group is complete (and not uniform)."""
        landed = {traj.trajectory_id: traj for traj in self._waiting[group_id]}
        complete = len(landed) == self._groups[group_id].size
        uniform = complete and is_uniform([t.reward for t in landed.values()])
        group = self._open.get(group_id)
        for k, chunk in enumerate(self._chunk_plan(group_id)):
            if group is not None and k in group.chunk_grads:
                continue
            if uniform or not all(i in landed for i in chunk):
                continue
            rewards = {landed[i].reward for i in chunk}
            if len(rewards) < 2 and not complete:
                continue
            group = group or self._open.get(group_id) or self._open_group(group_id)
            self._run_chunk(group, k, [landed[i] for i in chunk], pack_tokens)
            self._stats["chunks_run_early"] += 0 if complete else 1
        if not complete:
            return
        del self._waiting[group_id]
        if uniform:  # every advantage is 0: no forward, no backward, nothing to add
            assert group is None, "a chunk ran in a group whose rewards are all equal"
            self._close_uniform(group_id)
            return
        assert group is not None, "a complete group that is not uniform has run its chunks"
        ordered = [group.chunk_scores[i] for i in sorted(group.chunk_scores)]
        group.rewards = [reward for reward, _ in ordered]
        group.scores = [score for _, score in ordered]
        group.shift = group.rewards[0]
        coeff_x1, coeff_x2 = close_coefficients(group.rewards, group.shift)
        direct: list[torch.Tensor | None] | None = None
        for k in sorted(group.chunk_grads):
            for value, grads in group.chunk_grads.pop(k):
                advantage = coeff_x1 * (value - group.shift) + coeff_x2
                direct = _add_scaled(direct, grads, advantage, self.accum_dtype)
        self._close(group_id, direct=direct)

    def _run_chunk(
        self, group: _OpenGroup, k: int, members: list[Trajectory], pack_tokens: int
    ) -> None:
        """One chunk: its members by reward value, each value's packs one backward of
        sum_i S_i, summed in pack order into G_{k,v}."""
        results: list[tuple[float, list[torch.Tensor | None]]] = []
        for value in sorted({t.reward for t in members}):
            same = [t for t in members if t.reward == value]  # id order
            total: list[torch.Tensor | None] | None = None
            for pack in _packs(same, pack_tokens):
                scores, grads = self._pack_scores_and_grads(pack, group.prefix, [1.0] * len(pack))
                for traj, score in zip(pack, scores, strict=True):
                    group.chunk_scores[traj.trajectory_id] = (traj.reward, score)
                if grads is not None:
                    total = _sum_grads(total, grads)
                del grads
            if total is not None:
                results.append((value, total))
        group.chunk_grads[k] = results
        self._stats["chunks_run"] += 1

    def _run_closing(self, group_id: str, members: list[Trajectory], pack_tokens: int) -> None:
        """``members`` close their group: every advantage is known, so each of their packs
        (of at most ``pack_tokens`` padded tokens, 0: one trajectory a pack) takes one
        backward of sum_i A_i S_i; their sum joins the group's statistics at its close.
        A group whose rewards are all equal has every advantage 0: it closes with no
        forward and no backward (its members' earlier statistics are weighted by 0)."""
        if group_id not in self._open and is_uniform([t.reward for t in members]):
            self._close_uniform(group_id)
            return
        group = self._open.get(group_id) or self._open_group(group_id)
        if group.shift is None:
            group.shift = members[0].reward
        rewards = group.rewards + [traj.reward for traj in members]
        assert len(rewards) == group.spec.size, "the members close their group"
        if is_uniform(rewards):
            group.rewards += [t.reward for t in members]
            group.scores += [0.0] * len(members)  # A_i = 0: nothing to score
            self._close(group_id)
            return
        coeff_x1, coeff_x2 = close_coefficients(rewards, group.shift)
        direct: list[torch.Tensor | None] | None = None
        for pack in _packs(members, pack_tokens) if pack_tokens > 0 else [[t] for t in members]:
            weights = [coeff_x1 * (t.reward - group.shift) + coeff_x2 for t in pack]
            scores, grads = self._pack_scores_and_grads(pack, group.prefix, weights)
            # A pack's rows in the order of their scores: the objective pairs them.
            group.rewards += [t.reward for t in pack]
            group.scores += scores
            if grads is not None:
                direct = _sum_grads(direct, grads)
            del grads  # not held through the next pack's backward
        self._close(group_id, direct=direct)

    def _close_uniform(self, group_id: str) -> None:
        """Close a group none of whose trajectories ran, whose rewards are all equal: every
        advantage is 0, so it adds nothing (objective 0, no gradient)."""
        self._stats["groups_closed"] += 1
        self._stats["uniform_groups_skipped"] += 1
        if self.order == "fixed":
            self._closed[group_id] = (0.0, [])

    def _run_landed(self, group_id: str, members: list[Trajectory], pack_tokens: int) -> None:
        """Landed members of an admitted group (order="arrival"): if they close it, they run
        as packs, each knowing its advantages (one backward each); if it stays open, one at
        a time, since a pack that left its group open would take two backwards (x1 and x2),
        as many row backwards as its rows take one at a time."""
        seen = len(self._open[group_id].rewards) if group_id in self._open else 0
        if seen + len(members) < self._groups[group_id].size:
            for traj in members:
                self._process(traj)
        else:
            self._run_closing(group_id, members, pack_tokens)

    def _pack_scores_and_grads(
        self, pack: list[Trajectory], prefix: SharedPrefix | None, weights: list[float]
    ) -> tuple[list[float], list[torch.Tensor | None] | None]:
        """Each row's S_i from one padded forward, and the gradient of sum_i w_i S_i (None
        when nothing is scored or every w_i is 0)."""
        rows = [[t.prompt_ids[-1], *t.response_ids] for t in pack]
        width = max(map(len, rows))
        ids_BT = torch.zeros((len(pack), width), dtype=torch.long, device=self.device)
        scored_BT = torch.zeros((len(pack), width), dtype=torch.bool, device=self.device)
        for i, (row, traj) in enumerate(zip(rows, pack, strict=True)):
            ids_BT[i, : len(row)] = torch.tensor(row, device=self.device)
            scored_BT[i, 1 : len(row)] = torch.tensor(traj.response_scored, device=self.device)
        if not bool(scored_BT.any()):
            return [0.0] * len(pack), None
        cache = prefix.cache_for_rows(len(pack)) if prefix is not None else None
        logprobs_N, row_N = scored_logprobs(self.model, ids_BT, scored_BT, past_key_values=cache)
        terms_N = logprobs_N
        if self.is_clip is not None:
            weights_N = torch.cat(
                [
                    iw
                    for i, traj in enumerate(pack)
                    if (iw := self._importance_weights(
                        f"trajectory {traj.trajectory_id!r}", logprobs_N[row_N == i],
                        traj.behaviour_logprobs,
                    )) is not None
                ]
            )  # fmt: skip
            terms_N = weights_N * logprobs_N
        score_B = torch.zeros(len(pack), dtype=terms_N.dtype, device=self.device)
        score_B = score_B.index_add(0, row_N, terms_N)
        scores = [float(x) for x in score_B.detach().tolist()]
        for traj, score in zip(pack, scores, strict=True):
            if not math.isfinite(score):
                raise LearnerRefusal(
                    f"trajectory {traj.trajectory_id!r}: its log-prob score is {score} "
                    "(non-finite loss)"
                )
        self._stats["packed_trajectories"] += len(pack)
        if all(w == 0.0 for w in weights):
            return scores, None  # no advantage: a zero gradient, no backward
        inputs = self.params + (prefix.proxies if prefix is not None else [])
        w_B = torch.tensor(weights, dtype=score_B.dtype, device=self.device)
        grads = torch.autograd.grad((w_B * score_B).sum(), inputs, allow_unused=True)
        self._stats["pack_backwards"] += 1
        return scores, list(grads)

    def _sum_in_order(self, group: _OpenGroup) -> None:
        """The arrival path's sums, taken in trajectory-id order."""
        group.rewards, group.scores = [], []
        for trajectory_id in sorted(group.arrived):
            reward, score, grads = group.arrived.pop(trajectory_id)
            if group.shift is None:
                group.shift = reward
            group.rewards.append(reward)
            group.scores.append(score)
            if grads is not None:
                self._accumulate(group, grads, reward - group.shift)

    def _score_and_grad(
        self, traj: Trajectory, prefix: SharedPrefix | None
    ) -> tuple[float, list[torch.Tensor | None] | None]:
        """S_i and grad S_i w.r.t. parameters and prompt proxies; None when nothing is scored."""
        if traj.n_scored_tokens == 0:
            return 0.0, None
        ids_1T = torch.tensor([[traj.prompt_ids[-1], *traj.response_ids]], device=self.device)
        scored_1T = torch.tensor([[False, *traj.response_scored]], device=self.device)
        cache = prefix.cache() if prefix is not None else None
        logprobs_N, _ = scored_logprobs(self.model, ids_1T, scored_1T, past_key_values=cache)
        weights_N = self._importance_weights(
            f"trajectory {traj.trajectory_id!r}", logprobs_N, traj.behaviour_logprobs
        )
        score = logprobs_N.sum() if weights_N is None else (weights_N * logprobs_N).sum()
        if not torch.isfinite(score):
            raise LearnerRefusal(
                f"trajectory {traj.trajectory_id!r}: its log-prob score is {float(score)} "
                "(non-finite loss)"
            )
        inputs = self.params + (prefix.proxies if prefix is not None else [])
        grads = torch.autograd.grad(score, inputs, allow_unused=True)
        self._stats["trajectory_backwards"] += 1
        return float(score.detach()), list(grads)

    def _accumulate(
        self, group: _OpenGroup, grads: list[torch.Tensor | None], centred_reward: float
    ) -> None:
        if group.x1 is None or group.x2 is None:
            inputs = self.params + (group.prefix.proxies if group.prefix is not None else [])
            group.x1 = [torch.zeros_like(t, dtype=self.accum_dtype) for t in inputs]
            group.x2 = [torch.zeros_like(t, dtype=self.accum_dtype) for t in inputs]
        for x1, x2, g in zip(group.x1, group.x2, grads, strict=True):
            if g is None:
                continue
            g_acc = g.to(self.accum_dtype)
            x2.add_(g_acc)
            x1.add_(g_acc, alpha=centred_reward)

    def _close(self, group_id: str, direct: list[torch.Tensor | None] | None = None) -> None:
        """Close a group: a x1 + b x2, plus ``direct`` (a closing pack's sum_i A_i grad S_i),
        into the batch gradient, its prompt part replayed once."""
        group = self._open.pop(group_id)
        advantages_I = advantages(group.rewards)
        objective = sum(a * s for a, s in zip(advantages_I, group.scores, strict=True))
        coeff_x1, coeff_x2 = close_coefficients(group.rewards, group.shift or 0.0)
        self._stats["groups_closed"] += 1
        parts: list[list[torch.Tensor | None]] = []
        uniform = coeff_x1 == 0.0 and coeff_x2 == 0.0
        if (group.x1 is None and direct is None) or uniform:
            if group.prefix is not None:
                group.prefix.release()
        else:
            combined = _combine(group, coeff_x1, coeff_x2, direct, self.accum_dtype)
            n_params = len(self.params)
            parts.append(list(combined[:n_params]))
            if group.prefix is not None:
                parts.append(list(group.prefix.replay(combined[n_params:], self.params)))
                self._stats["prefix_replays"] += 1
        if self.order == "fixed":
            self._closed[group_id] = (objective, parts)
            return
        self._commit(objective, parts)

    def _commit(self, objective: float, parts: list[list[torch.Tensor | None]]) -> None:
        self._objective_sum += objective
        for grads in parts:
            self._add_grads(grads)

    def _on_barrier(self) -> None:
        # Runs once every group has closed; group-id order makes the sum arrival-free.
        for group_id in sorted(self._closed):
            self._commit(*self._closed.pop(group_id))

    def _pending_work(self) -> str:
        if self._open:
            return f"{len(self._open)} group(s) with live statistics: {sorted(self._open)[:5]}"
        if self._held:
            return f"{len(self._held)} held source(s) not yet processed"
        if self._waiting:
            waiting = sorted(self._waiting)[:5]
            return f"{len(self._waiting)} group(s) waiting for trajectories: {waiting}"
        return ""

    def _counters(self) -> dict[str, int]:
        return dict(self._stats)

    def live_statistics_bytes(self) -> int:
        """Bytes held by open groups' sufficient statistics (the admission cap bounds this)
        and, with order="fixed", by held gradients and closed groups' contributions."""
        total = 0
        for group in self._open.values():
            for buffers in (group.x1, group.x2):
                total += sum(t.numel() * t.element_size() for t in buffers or [])
            for _reward, _score, grads in group.arrived.values():
                total += sum(t.numel() * t.element_size() for t in grads or [] if t is not None)
            for results in group.chunk_grads.values():
                for _value, grads in results:
                    total += sum(t.numel() * t.element_size() for t in grads if t is not None)
        for _objective, parts in getattr(self, "_closed", {}).values():
            total += sum(t.numel() * t.element_size() for g in parts for t in g if t is not None)
        return total


__all__ = ["LearnerRefusal", "StreamingGRPOLearner"]


def _combine(
    group: _OpenGroup,
    coeff_x1: float,
    coeff_x2: float,
    direct: list[torch.Tensor | None] | None,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """a x1 + b x2 (+ a closing pack's direct gradient), per input."""
    if group.x1 is not None and group.x2 is not None:
        combined = [
            coeff_x1 * x1 + coeff_x2 * x2 for x1, x2 in zip(group.x1, group.x2, strict=True)
        ]
    else:
        assert direct is not None
        combined = [torch.zeros_like(g, dtype=dtype) if g is not None else None for g in direct]  # type: ignore[misc]
    if direct is not None:
        for acc, g in zip(combined, direct, strict=True):
            if g is not None:
                acc.add_(g.to(dtype))
    return combined


def _add_scaled(
    total: list[torch.Tensor | None] | None,
    grads: list[torch.Tensor | None],
    coeff: float,
    dtype: torch.dtype,
) -> list[torch.Tensor | None]:
    """``total + coeff * grads`` per input, in ``dtype`` (a fresh sum when ``total`` is None)."""
    if total is None:
        return [None if g is None else g.to(dtype) * coeff for g in grads]
    out: list[torch.Tensor | None] = []
    for acc, g in zip(total, grads, strict=True):
        if g is None:
            out.append(acc)
        elif acc is None:
            out.append(g.to(dtype) * coeff)
        else:
            out.append(acc.add_(g.to(dtype), alpha=coeff))
    return out


def _sum_grads(
    total: list[torch.Tensor | None] | None, grads: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """``total + grads`` per input, in place where it can (the sum and one pack's
    gradient, never two sums); ``grads`` itself when there is no sum yet."""
    if total is None:
        return grads
    return [d if g is None else (g if d is None else _add_into(d, g))
            for d, g in zip(total, grads, strict=True)]  # fmt: skip


def _add_into(total: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``total + grad``, in place when ``total`` owns its memory (autograd may return an
    expanded view, which cannot be written)."""
    return total.add_(grad) if total.is_contiguous() else total + grad


#: A pack's fixed cost in padded-token equivalents (one more forward and backward through
#: the layers): on one core of the 2-core box, the wide policy on a logged batch
#: (benchmarks/data/embedded_batch.jsonl), a group as 8 one-row packs took 35 ms a pack
#: more than as one, and a padded token about 1.5 ms.
PACK_OVERHEAD_TOKENS = 32


def _packs(trajs: list[Trajectory], pack_tokens: int) -> list[list[Trajectory]]:
    """``trajs`` as packs of at most ``pack_tokens`` padded tokens (rows x longest row; a
    trajectory longer than the bound is a pack of its own), split where padding costs more
    than another pack: the rows, by length, cut into the runs of least padded tokens plus
    ``PACK_OVERHEAD_TOKENS`` a pack (a group's one straggler runs alone instead of widening
    seven rows to its length). Deterministic in ``trajs``' order: within a pack, and from
    pack to pack, rows keep it (ties of length too), so a plan, hence every float sum, is a
    function of the members alone."""
    if not trajs:
        return []
    rows = [1 + len(traj.response_ids) for traj in trajs]
    order = sorted(range(len(trajs)), key=lambda i: (rows[i], i))
    # best[j]: the least cost of the j shortest rows; cut[j]: where their last run starts.
    best = [0] + [math.inf] * len(order)
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        width = rows[order[j - 1]]  # the longest of any run ending at j
        for i in range(j - 1, -1, -1):
            if j - i > 1 and (j - i) * width > pack_tokens:
                break
            cost = best[i] + PACK_OVERHEAD_TOKENS + (j - i) * width
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs: list[list[int]] = []
    j = len(order)
    while j > 0:
        runs.append(sorted(order[cut[j] : j]))
        j = cut[j]
    return [[trajs[i] for i in run] for run in sorted(runs)]
