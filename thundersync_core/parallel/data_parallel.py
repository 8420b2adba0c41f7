"""Exact data parallelism for the streaming learner: the barrier's reduction and group routing.

Each of W learner ranks holds whole groups (a GRPO group's sufficient statistics and its
shared-prompt adjoint, an OPD group's turns and prompt ledger live on one rank) and
accumulates their gradients *unscaled*, exactly as one process would. The batch gradient
is linear in the per-group terms, so

    grad = c * sum_ranks sum_{g on rank} grad_g,   c = 1/G_total or 1/N_tok_total,

and the barrier sums the unscaled accumulators and the scalars c depends on over ranks
(``ProcessGroupReducer``) before c is applied once. Averaging per-rank *means* instead would
weight a rank's groups by 1/G_rank: wrong whenever ranks hold unequal group counts.

Routing (``GroupAssigner``): a group goes to a rank when its first source arrives, to the
rank with the least predicted work assigned so far in the batch (tokens of the first source
times the group size; ties to the lowest rank), so the assignment is a pure function of the
arrival order. Every later source of the group (OPD: every turn) follows it there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from thundersync_core.batch import Trajectory, Turn
from thundersync_core.streaming.base import GroupSpec, LearnerBase

#: Scalars of a batch, summed in float64: counts stay exact below 2**53.
SCALAR_DTYPE = torch.float64


class ProcessGroupReducer:
    """The barrier's reduction over a torch.distributed process group (gloo or NCCL)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    def all_reduce(self, grads: list[torch.Tensor], scalars: dict[str, float]) -> dict[str, float]:
        # One collective per accumulator keeps the transient memory at one tensor; the
        # scalars travel in one float64 vector.
        for grad in grads:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group)
        names = sorted(scalars)
        device = grads[0].device if grads else torch.device("cpu")
        values_S = torch.tensor([scalars[n] for n in names], dtype=SCALAR_DTYPE, device=device)
        dist.all_reduce(values_S, op=dist.ReduceOp.SUM, group=self.group)
        return dict(zip(names, values_S.tolist(), strict=True))

    def refusing_ranks(self, refused: bool, device: torch.device) -> list[int]:
        world = dist.get_world_size(self.group)
        flags_W = torch.zeros(world, dtype=torch.int32, device=device)
        flags_W[dist.get_rank(self.group)] = int(refused)
        dist.all_reduce(flags_W, op=dist.ReduceOp.SUM, group=self.group)
        return [rank for rank, flag in enumerate(flags_W.tolist()) if flag]


@dataclass
class GroupAssigner:
    """Which rank holds each group of the batch in progress."""

    world_size: int
    rank_of: dict[str, int] = field(default_factory=dict)
    work_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        self.reset()

    def reset(self) -> None:
        """A new batch: no group is assigned, no work is outstanding."""
        self.rank_of = {}
        self.work_tokens = [0] * self.world_size

    def assign(self, group_id: str, first_source_tokens: int, group_size: int) -> tuple[int, bool]:
        """(rank, newly assigned): the group's rank, choosing one on its first source."""
        if group_id in self.rank_of:
            return self.rank_of[group_id], False
        rank = min(range(self.world_size), key=lambda r: (self.work_tokens[r], r))
        self.rank_of[group_id] = rank
        self.work_tokens[rank] += max(first_source_tokens, 1) * group_size
        return rank, True

    def groups_on(self, rank: int) -> list[str]:
        return [g for g, r in self.rank_of.items() if r == rank]


def predicted_tokens(source: Trajectory | Turn) -> int:
    """Tokens a source puts through the learner: its prompt and every segment so far."""
    return len(source.prompt_ids) + sum(len(s.ids) for s in source.segments)


def stream_rank_share(
    learner: LearnerBase,
    sources: Iterable[Trajectory | Turn],
    specs: Mapping[str, GroupSpec],
    *,
    rank: int,
    world_size: int,
    forced: Mapping[str, int] | None = None,
) -> list[str]:
    """Begin a batch on this rank's ``learner`` and feed it its share of ``sources``.

    For a process that sees the whole batch (benchmarks, checks, tests): every rank runs
    the same assigner over the same arrival order, so the ranks agree on the split without
    talking. ``forced`` pins groups to ranks. Returns this rank's groups in arrival order.
    """
    assigner = GroupAssigner(world_size)
    assigner.rank_of.update(forced or {})
    learner.reducer = ProcessGroupReducer()
    learner.begin_batch({})
    mine: list[str] = []
    for source in sources:
        gid = source.group_id
        owner, _ = assigner.assign(gid, predicted_tokens(source), specs[gid].size)
        if owner != rank:
            continue
        if gid not in mine:
            mine.append(gid)
            learner.add_groups({gid: specs[gid]})
        if isinstance(source, Turn):
            learner.submit_turn(source)  # type: ignore[attr-defined]
        else:
            learner.submit(source)  # type: ignore[attr-defined]
    return mine


def init_process_group(
    backend: str, *, rank: int, world_size: int, address: str, port: int, timeout_s: float
) -> None:
    """Join the learner's process group; every collective fails after ``timeout_s``."""
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


__all__ = [
    "GroupAssigner",
    "ProcessGroupReducer",
    "default_backend",
    "init_process_group",
    "predicted_tokens",
    "stream_rank_share",
]
