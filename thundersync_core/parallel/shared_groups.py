"""Open GRPO groups shared by every learner rank: their statistics held 1/W per rank.

With whole groups per rank (``data_parallel.py``) each rank keeps its open groups' two
sufficient statistics (x1, x2: see ``streaming/grpo_stream.py``) whole: 8 bytes per
parameter per group, which at 8B parameters and a few open groups is most of a GPU.
Sharding each rank's own groups over the ranks would not help (every rank would hold 1/W of
W times as many groups). Here the ranks share the groups instead:

- every rank registers every group of the batch; at most ``max_open_groups`` groups are
  open at once over all the ranks, each held as this rank's ``Shard(0)`` rows of x1 and x2
  (FSDP2's layout, as the sharded batch gradient: ``ShardedGradient``);
- landed trajectories go to the ranks in lockstep *ticks* (``TickPlanner``): a tick hands
  at most one trajectory to each rank; every rank runs its backward, then all ranks
  reduce-scatter, per group the tick touched, their gradients into x2's rows and their
  centred-reward-weighted gradients into x1's rows, one tensor at a time;
- when a tick completes a group, every rank adds a x1 + b x2 of its rows straight into its
  rows of the batch gradient (nothing whole, nothing pending); the prompt's key/value
  adjoints (small: they stay whole, on the ranks that ran the group's trajectories) are
  combined the same way and replayed through a fresh prompt forward on those ranks (no
  prompt graph is held while a group is open), and the replays are reduce-scattered.

Every rank sees every tick's rewards (in the plan's order), so all agree on each group's
shift, its close coefficients and when it closes; the objective and the counts are summed
over the ranks at the barrier as in the other data-parallel path. The update is the
one-process learner's up to the order of float sums. A rank that refuses a source says so
in the tick's first collective, so every rank refuses the tick at once instead of waiting
in a reduction for the collective timeout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from thundersync_core.batch import Trajectory
from thundersync_core.objectives.grpo import advantages, close_coefficients
from thundersync_core.parallel.data_parallel import ProcessGroupReducer
from thundersync_core.streaming.base import GroupSpec, LearnerRefusal, PeerRefusal
from thundersync_core.streaming.grpo_stream import StreamingGRPOLearner
from thundersync_core.streaming.prefix import SharedPrefix


@dataclass(frozen=True)
class TickEntry:
    """One trajectory of a tick: the rank that runs it and what every rank must know of it."""

    rank: int
    group_id: str
    trajectory_id: str
    reward: float


class TickPlanner:
    """Which landed trajectories the next tick hands to which rank.

    Trajectories wait in arrival order; a tick takes the first ones it may, at most one per
    rank, and a trajectory of a group not yet open only while fewer than ``max_open_groups``
    groups are open (a group stays open until its last trajectory has been handed out; one
    that closes in a tick still counts as open in that tick). A pure function of the
    arrival order and of when ticks are asked for.
    """

    def __init__(self, world_size: int, max_open_groups: int, sizes: Mapping[str, int]) -> None:
        if world_size < 1 or max_open_groups < 1:
            raise ValueError(
                f"world_size and max_open_groups must be >= 1, got {world_size}, {max_open_groups}"
            )
        self.world_size = world_size
        self.max_open_groups = max_open_groups
        self.sizes = dict(sizes)
        self.waiting: list[Trajectory] = []
        self.handed: dict[str, int] = {}

    def add(self, traj: Trajectory) -> None:
        size = self.sizes.get(traj.group_id)
        if size is None:
            raise LearnerRefusal(
                f"trajectory {traj.trajectory_id!r}: group {traj.group_id!r} is not "
                "registered in this batch"
            )
        landed = self.handed.get(traj.group_id, 0)
        landed += sum(t.group_id == traj.group_id for t in self.waiting)
        if landed >= size:
            raise LearnerRefusal(
                f"trajectory {traj.trajectory_id!r}: group {traj.group_id!r} already has "
                f"{size} trajectories"
            )
        self.waiting.append(traj)

    def open_groups(self) -> set[str]:
        return {g for g, n in self.handed.items() if n < self.sizes[g]}

    def next_tick(self) -> list[tuple[TickEntry, Trajectory]]:
        """The next tick (empty when nothing may go now)."""
        open_now = self.open_groups()
        tick: list[tuple[TickEntry, Trajectory]] = []
        for traj in list(self.waiting):
            if len(tick) == self.world_size:
                break
            gid = traj.group_id
            if gid not in open_now and len(open_now) >= self.max_open_groups:
                continue  # held until a group closes
            open_now.add(gid)
            self.waiting.remove(traj)
            self.handed[gid] = self.handed.get(gid, 0) + 1
            entry = TickEntry(len(tick), gid, traj.trajectory_id, traj.reward)
            tick.append((entry, traj))
        return tick

    @property
    def pending(self) -> bool:
        return bool(self.waiting)


class TurnTickPlanner:
    """OPD turns over ranks that hold whole groups, with the batch gradient sharded: a tick
    hands each rank at most one of its turns (the earliest waiting), and every rank flushes
    the sharded gradient after it, so no whole gradient waits past one turn. A rank's turns
    keep their arrival order (a trajectory's turns are on one rank, in order)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.waiting: list[tuple[int, Any]] = []

    def add(self, rank: int, payload: Any) -> None:
        self.waiting.append((rank, payload))

    def next_tick(self) -> list[tuple[TickEntry, Any]]:
        taken: dict[int, Any] = {}
        for item in list(self.waiting):
            rank, payload = item
            if rank not in taken:
                taken[rank] = payload
                self.waiting.remove(item)
        return [(TickEntry(r, "", "", 0.0), taken[r]) for r in sorted(taken)]

    @property
    def pending(self) -> bool:
        return bool(self.waiting)


@dataclass
class _SharedGroup:
    spec: GroupSpec
    ids: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    shift: float | None = None
    #: This rank's trajectories' scores S_i.
    scores: dict[str, float] = field(default_factory=dict)
    #: This rank's rows of x1 and x2 (float32, or the accumulator dtype).
    x1: list[torch.Tensor] | None = None
    x2: list[torch.Tensor] | None = None
    #: On a rank that ran some of the group: its prompt's proxies and their statistics.
    prefix: SharedPrefix | None = None
    p1: list[torch.Tensor] | None = None
    p2: list[torch.Tensor] | None = None


class SharedGroupsGRPOLearner(StreamingGRPOLearner):
    """One rank of the shared-groups GRPO learner (module docstring). Needs ``reducer`` and
    ``sharded_grad`` set before the first batch; takes trajectories through ``run_tick``."""

    def _on_begin(self) -> None:
        super()._on_begin()
        self._shared: dict[str, _SharedGroup] = {}
        self._stats |= {"ticks": 0, "stat_reductions": 0}

    def _on_submit(self, traj: Trajectory) -> None:
        raise LearnerRefusal(
            f"trajectory {traj.trajectory_id!r}: shared groups take trajectories in ticks "
            "(run_tick), not one rank at a time"
        )

    def _local_group_count(self) -> int:
        # Every rank registers every group; rank 0 counts them.
        return len(self._groups) if self._rank() == 0 else 0

    def _rank(self) -> int:
        return int(getattr(self.sharded_grad, "rank", 0))

    def run_tick(self, entries: Sequence[TickEntry], mine: Sequence[Trajectory]) -> None:
        """Every rank, with the same ``entries``: this rank's backward (``mine``: the entry
        with its rank, at most one), then the tick's reductions and its groups' closes."""
        if self.sharded_grad is None or self.reducer is None:
            raise LearnerRefusal("shared groups need a reducer and a sharded batch gradient")
        rank = self._rank()
        refusal: Exception | None = None
        grads: list[torch.Tensor | None] | None = None
        centred = 0.0
        own: Trajectory | None = None
        try:
            own = self._accept_tick(entries, mine, rank)
            if own is not None:
                group = self._shared[own.group_id]
                if group.prefix is None and len(group.spec.prompt_ids) > 1:
                    group.prefix = SharedPrefix(
                        self.model, group.spec.prompt_ids[:-1], keep_graph=False
                    )
                score, grads = self._score_and_grad(own, group.prefix)
                group.scores[own.trajectory_id] = score
                centred = own.reward - (group.shift or 0.0)
        except Exception as exc:  # every rank learns of it in the next collective
            refusal = exc
        refusing = self.reducer.refusing_ranks(refusal is not None, self.device)
        if refusal is not None:
            raise refusal
        if refusing:
            raise PeerRefusal(
                f"learner rank(s) {refusing} refused a tick of trajectories "
                f"{[e.trajectory_id for e in entries][:5]} (their errors say why)"
            )
        self._stats["ticks"] += int(rank == 0)  # counters are summed over ranks: once
        n_params = len(self.params)
        touched = sorted({e.group_id for e in entries})
        for gid in touched:
            group = self._shared[gid]
            if group.x1 is None or group.x2 is None:
                group.x1 = self.sharded_grad.zeros_like_shards()  # type: ignore[attr-defined]
                group.x2 = self.sharded_grad.zeros_like_shards()  # type: ignore[attr-defined]
            here = own is not None and own.group_id == gid and grads is not None
            param_grads: list[torch.Tensor | None] = (
                list(grads[:n_params]) if here else [None] * n_params  # type: ignore[index]
            )
            # x1 = sum (r_i - shift) grad S_i: nothing to add when every centred reward of
            # the tick's entries in this group is 0 (its first trajectory's always is).
            weighted = any(e.reward != group.shift for e in entries if e.group_id == gid)
            self.sharded_grad.reduce_into(param_grads, group.x2, keep=weighted)  # type: ignore[attr-defined]
            if weighted:
                coeff = centred if here else 0.0
                self.sharded_grad.reduce_into(param_grads, group.x1, coeff)  # type: ignore[attr-defined]
            self._stats["stat_reductions"] += 1 + int(weighted)
            if here and group.prefix is not None:
                self._accumulate_proxies(group, grads[n_params:], centred)  # type: ignore[index]
        del grads
        for gid in touched:
            if len(self._shared[gid].rewards) == self._shared[gid].spec.size:
                self._close_shared(gid)

    def _accept_tick(
        self, entries: Sequence[TickEntry], mine: Sequence[Trajectory], rank: int
    ) -> Trajectory | None:
        """Check the tick, count this rank's source, mark every entry done; returns it."""
        expected = [e.trajectory_id for e in entries if e.rank == rank]
        if len(expected) > 1:
            raise LearnerRefusal(f"rank {rank}: a tick hands a rank one trajectory: {expected}")
        if sorted(t.trajectory_id for t in mine) != expected:
            raise LearnerRefusal(
                f"rank {rank}: the tick names trajectories {expected} for this rank, got "
                f"{[t.trajectory_id for t in mine]}"
            )
        own = mine[0] if mine else None
        for entry in entries:
            if own is not None and entry.trajectory_id == own.trajectory_id:
                if own.reward != entry.reward or own.group_id != entry.group_id:
                    raise LearnerRefusal(
                        f"trajectory {own.trajectory_id!r}: the tick's reward or group "
                        "differs from the trajectory's"
                    )
                self._check_reward(own)
                self._accept_whole(own)
            else:
                self._accept_other(entry)
        for entry in entries:
            group = self._shared.get(entry.group_id)
            if group is None:
                group = self._shared[entry.group_id] = _SharedGroup(self._groups[entry.group_id])
                peak = max(self._stats["peak_open_groups"], len(self._shared))
                self._stats["peak_open_groups"] = peak
            if group.shift is None:
                group.shift = entry.reward
            group.ids.append(entry.trajectory_id)
            group.rewards.append(entry.reward)
        return own

    def _accept_other(self, entry: TickEntry) -> None:
        """Another rank's trajectory: registered, not seen before, its reward finite."""
        tid = entry.trajectory_id
        done = self._done.get(entry.group_id)
        if done is None:
            raise LearnerRefusal(f"trajectory {tid!r}: group {entry.group_id!r} is not registered")
        if tid in done or len(done) >= self._groups[entry.group_id].size:
            raise LearnerRefusal(f"trajectory {tid!r} submitted twice or past its group's size")
        if not math.isfinite(entry.reward):
            raise LearnerRefusal(f"trajectory {tid!r}: reward {entry.reward} is not finite")
        self._mark_done(entry.group_id, tid)

    def _accumulate_proxies(
        self, group: _SharedGroup, grads: Sequence[torch.Tensor | None], centred: float
    ) -> None:
        if group.p1 is None or group.p2 is None:
            assert group.prefix is not None
            proxies = group.prefix.proxies
            group.p1 = [torch.zeros_like(t, dtype=self.accum_dtype) for t in proxies]
            group.p2 = [torch.zeros_like(t, dtype=self.accum_dtype) for t in proxies]
        for p1, p2, g in zip(group.p1, group.p2, grads, strict=True):
            if g is not None:
                g_acc = g.to(self.accum_dtype)
                p2.add_(g_acc)
                p1.add_(g_acc, alpha=centred)

    def _close_shared(self, gid: str) -> None:
        """Every rank: a x1 + b x2 of its rows into its batch-gradient rows; the prompt
        adjoints' combination replayed where they are, the replays reduce-scattered."""
        group = self._shared.pop(gid)
        shift = group.shift or 0.0
        objective = sum(
            a * group.scores[tid]
            for a, tid in zip(advantages(group.rewards), group.ids, strict=True)
            if tid in group.scores
        )
        self._objective_sum += objective
        self._stats["groups_closed"] += int(self._rank() == 0)
        coeff_x1, coeff_x2 = close_coefficients(group.rewards, shift)
        if coeff_x1 == 0.0 and coeff_x2 == 0.0:  # uniform rewards: every rank skips alike
            return
        assert group.x1 is not None
        assert group.x2 is not None
        shards = self.sharded_grad.shards  # type: ignore[union-attr]
        for shard, x1, x2 in zip(shards, group.x1, group.x2, strict=True):
            shard.add_(x1.mul_(coeff_x1).add_(x2, alpha=coeff_x2))
        group.x1 = group.x2 = None
        if len(group.spec.prompt_ids) <= 1:
            return  # no prompt before the last token: nothing to replay on any rank
        replay: list[torch.Tensor | None] = [None] * len(self.params)
        if group.prefix is not None and group.p1 is not None and group.p2 is not None:
            adjoints = [
                p1.mul_(coeff_x1).add_(p2, alpha=coeff_x2)
                for p1, p2 in zip(group.p1, group.p2, strict=True)
            ]
            replay = list(group.prefix.replay(adjoints, self.params))
            self._stats["prefix_replays"] += 1
        group.prefix = None
        group.p1 = group.p2 = None
        self.sharded_grad.reduce_into(replay)  # type: ignore[union-attr]

    def _pending_work(self) -> str:
        if self._shared:
            return f"{len(self._shared)} shared group(s) open: {sorted(self._shared)[:5]}"
        return super()._pending_work()

    def live_statistics_bytes(self) -> int:
        """Bytes of this rank's rows of the open groups' statistics and their whole
        prompt-adjoint statistics."""
        total = 0
        for group in self._shared.values():
            for buffers in (group.x1, group.x2, group.p1, group.p2):
                total += sum(t.numel() * t.element_size() for t in buffers or [])
        return total


def stream_shared_groups(
    learner: SharedGroupsGRPOLearner,
    sources: Sequence[Trajectory],
    specs: Mapping[str, GroupSpec],
    *,
    max_open_groups: int,
    burst: int = 1,
    on_tick: Callable[[], None] | None = None,
) -> list[list[TickEntry]]:
    """Begin a batch on this rank's ``learner`` and run ``sources`` through it in ticks.

    For a process that sees the whole batch (benchmarks, checks, tests): every rank plans
    the same ticks from the same arrival order, ``burst`` landing between plannings (the
    runtime plans whenever the last tick is done); ``on_tick`` is called after each tick.
    Returns the ticks' entries."""
    world = dist.get_world_size()
    if learner.reducer is None:
        learner.reducer = ProcessGroupReducer()
    learner.begin_batch(dict(specs))
    planner = TickPlanner(world, max_open_groups, {g: s.size for g, s in specs.items()})
    rank = dist.get_rank()
    ticks: list[list[TickEntry]] = []
    for start in range(0, len(sources), burst):
        for traj in sources[start : start + burst]:
            planner.add(traj)
        while tick := planner.next_tick():
            entries = [entry for entry, _ in tick]
            mine = [traj for entry, traj in tick if entry.rank == rank]
            learner.run_tick(entries, mine)
            ticks.append(entries)
            if on_tick is not None:
                on_tick()
    if planner.pending:
        raise LearnerRefusal(f"{len(planner.waiting)} trajectory(ies) never fit a tick")
    return ticks


__all__ = [
    "SharedGroupsGRPOLearner",
    "TickEntry",
    "TickPlanner",
    "TurnTickPlanner",
    "stream_shared_groups",
]
