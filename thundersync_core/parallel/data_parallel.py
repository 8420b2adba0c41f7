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

from collections.abc import Iterable, Mapping, Sequence
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
        device = grads[0].device if grads else _collective_device(self.group)
        values_S = torch.tensor([scalars[n] for n in names], dtype=SCALAR_DTYPE, device=device)
        dist.all_reduce(values_S, op=dist.ReduceOp.SUM, group=self.group)
        return dict(zip(names, values_S.tolist(), strict=True))

    def refusing_ranks(self, refused: bool, device: torch.device) -> list[int]:
        world = dist.get_world_size(self.group)
        flags_W = torch.zeros(world, dtype=torch.int32, device=device)
        flags_W[dist.get_rank(self.group)] = int(refused)
        dist.all_reduce(flags_W, op=dist.ReduceOp.SUM, group=self.group)
        return [rank for rank, flag in enumerate(flags_W.tolist()) if flag]


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor must live for a collective of ``group`` (NCCL: this rank's GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of a dimension of ``n`` that ``rank`` holds: torch.chunk's split,
    which is FSDP2's ``Shard(0)`` (the last ranks' chunks may be shorter, or empty)."""
    size = -(-n // world)
    start = min(rank * size, n)
    return start, min(start + size, n)


class ShardedGradient:
    """The batch gradient held 1/W per rank, in FSDP2's ``Shard(0)`` layout.

    A rank adds its contributions (closed groups, as the learner makes them) to a pending
    whole buffer; ``flush``, called by every rank at the same points of the batch (after
    each group's last source), reduce-scatters the pending buffers into the shards and
    frees them, one parameter at a time. Between flushes a rank holds its shards, and a
    pending gradient only while a contribution waits for the next flush; never the whole
    batch gradient. The sum is the batch gradient of every rank's groups, exactly as the
    whole accumulators' all-reduce at the barrier (up to the order of the float sums).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.dtype = dtype
        self.shapes = [tuple(p.shape) for p in params]
        if any(len(shape) == 0 for shape in self.shapes):
            raise ValueError("a sharded gradient needs parameters of at least one dimension")
        self.device = params[0].device
        self.buckets = _buckets(self.shapes, self.world, torch.finfo(dtype).bits // 8)
        self.shards: list[torch.Tensor] = []
        self.pending: list[torch.Tensor | None] | None = None
        self.reset()

    def reset(self) -> None:
        """A new batch: zero shards, nothing pending."""
        self.shards = []
        for shape in self.shapes:
            start, stop = shard_rows(shape[0], self.world, self.rank)
            rows = (stop - start, *shape[1:])
            self.shards.append(torch.zeros(rows, dtype=self.dtype, device=self.device))
        self.pending = None

    def add(self, grads: Sequence[torch.Tensor | None], coeff: float = 1.0) -> None:
        if self.pending is None:
            self.pending = [None] * len(self.shapes)
        for i, g in enumerate(grads):
            if g is None:
                continue
            current = self.pending[i]
            if current is None:
                self.pending[i] = g.detach().to(self.dtype).mul(coeff)
            else:
                current.add_(g.to(self.dtype), alpha=coeff)

    def flush(self) -> None:
        """Every rank calls, at the same points: the pending buffers, summed over ranks,
        join the shards (a rank with nothing pending sends zeros)."""
        pending = self.pending
        self.pending = None
        self.reduce_into(pending if pending is not None else [None] * len(self.shapes))

    def reduce_into(
        self,
        grads: list[torch.Tensor | None],
        targets: Sequence[torch.Tensor] | None = None,
        coeff: float = 1.0,
        *,
        keep: bool = False,
    ) -> None:
        """Every rank calls with its whole tensors (None: zeros): ``coeff`` times their sum
        over ranks is added to ``targets``, this rank's ``Shard(0)`` rows in the gradient's
        layout (default: the shards). Tensors go in buckets of about ``BUCKET_BYTES`` per
        rank (a larger tensor alone), one reduce-scatter a bucket; unless ``keep``, each of
        ``grads`` is released (set to None) once in its bucket, so no whole float32 copy
        outlives its tensor."""
        rows = self.shards if targets is None else targets
        for bucket in self.buckets:
            # The send buffer: rank r's rows of every tensor of the bucket, rank after rank.
            chunks = [_chunk_elements(self.shapes[i], self.world) for i in bucket]
            width = sum(chunks)
            full = torch.zeros((self.world, width), dtype=self.dtype, device=self.device)
            offset = 0
            for i, chunk in zip(bucket, chunks, strict=True):
                grad = grads[i]
                if not keep:
                    grads[i] = None
                if grad is not None:
                    for r in range(self.world):
                        start, stop = shard_rows(self.shapes[i][0], self.world, r)
                        n = (stop - start) * (chunk // -(-self.shapes[i][0] // self.world))
                        full[r, offset : offset + n].copy_(grad[start:stop].reshape(-1))
                del grad
                offset += chunk
            if coeff != 1.0:
                full.mul_(coeff)
            out = torch.empty(width, dtype=self.dtype, device=self.device)
            dist.reduce_scatter_tensor(out, full.view(-1), group=self.group)
            del full
            offset = 0
            for i, chunk in zip(bucket, chunks, strict=True):
                n = rows[i].numel()
                rows[i].add_(out[offset : offset + n].view_as(rows[i]))
                offset += chunk

    def zeros_like_shards(self) -> list[torch.Tensor]:
        """Zero tensors shaped as this rank's rows (a sharded statistic)."""
        return [torch.zeros_like(shard) for shard in self.shards]

    def nbytes(self) -> int:
        held = [*self.shards, *(t for t in self.pending or [] if t is not None)]
        return sum(t.numel() * t.element_size() for t in held)


#: A reduce-scatter's share of each rank, in bytes (a larger tensor goes alone): few
#: collectives for many small tensors, one tensor's buffers for a large one.
BUCKET_BYTES = 16 << 20


def _chunk_elements(shape: tuple[int, ...], world: int) -> int:
    """Elements of one rank's ``Shard(0)`` chunk, rows rounded up (the padded layout)."""
    rest = 1
    for n in shape[1:]:
        rest *= n
    return -(-shape[0] // world) * rest


def _buckets(shapes: Sequence[tuple[int, ...]], world: int, element: int) -> list[list[int]]:
    """Consecutive tensors grouped while a rank's chunks fit ``BUCKET_BYTES``."""
    buckets: list[list[int]] = []
    size = 0
    for i, shape in enumerate(shapes):
        chunk = _chunk_elements(shape, world) * element
        if buckets and size + chunk <= BUCKET_BYTES:
            buckets[-1].append(i)
            size += chunk
        else:
            buckets.append([i])
            size = chunk
    return buckets


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
    A learner with a sharded gradient flushes it on every rank after each group's last
    trajectory (GRPO), or after every turn (OPD: a tick of one turn), as the learner group
    does.
    """
    routed: dict[str, int] = {}
    assigner = GroupAssigner(world_size)
    assigner.rank_of.update(forced or {})
    learner.reducer = ProcessGroupReducer()
    learner.begin_batch({})
    mine: list[str] = []
    for source in sources:
        gid = source.group_id
        owner, _ = assigner.assign(gid, predicted_tokens(source), specs[gid].size)
        if owner == rank:
            if gid not in mine:
                mine.append(gid)
                learner.add_groups({gid: specs[gid]})
            if isinstance(source, Turn):
                learner.submit_turn(source)  # type: ignore[attr-defined]
            else:
                learner.submit(source)  # type: ignore[attr-defined]
        routed[gid] = routed.get(gid, 0) + 1
        closes = isinstance(source, Turn) or routed[gid] == specs[gid].size
        if learner.sharded_grad is not None and closes:
            learner.sharded_grad.flush()
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
    "ShardedGradient",
    "default_backend",
    "init_process_group",
    "predicted_tokens",
    "shard_rows",
    "stream_rank_share",
]
