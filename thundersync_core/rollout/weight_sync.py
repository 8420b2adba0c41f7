"""Weight publication by collective: the learner broadcasts each new version to every
engine worker over a torch.distributed group of its own (gloo on CPU, NCCL on GPU).

The group is standalone (a ``TCPStore`` and a process group object, not the default group),
so it lives beside the learner's own data-parallel group and vLLM's. Rank 0 is the learner;
engine workers take ranks 1..N. Both sides agree on the *layout* (parameter names and
shapes in publication order, exchanged once when the group is formed), the engine's dtype
and a byte budget per bucket, and derive the same buckets from them, so a publication
sends only tensor data: each bucket is the concatenation of consecutive parameters cast to
the engine's dtype, broadcast as one flat tensor. A receiver stages every bucket and
loads the weights only once the last has arrived, so an engine never serves a half-loaded
policy; the caller reports the new version after that.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "GroupAddress",
    "Layout",
    "WeightGroup",
    "buckets_of",
    "checksum",
    "digest",
    "layout_of",
    "receive_weights",
    "send_weights",
]

#: (parameter name, shape) in publication order.
Layout = list[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class GroupAddress:
    """Where and how the publication group meets: the learner's node and port (rank 0
    hosts the store), its size, its backend, and how long forming it and each broadcast
    may wait. Plain fields: it crosses Ray and vLLM's ``collective_rpc`` as a dict."""

    backend: str
    host: str
    port: int
    world_size: int
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(
                f"publication group backend must be gloo or nccl, got {self.backend!r}"
            )


class WeightGroup:
    """One member of the publication group (rank 0: the learner)."""

    def __init__(self, address: GroupAddress, rank: int) -> None:
        timeout = timedelta(seconds=address.timeout_s)
        self.address, self.rank = address, rank
        size = address.world_size
        # Kept: the process group talks through the store's connections.
        self.store = dist.TCPStore(address.host, address.port, size, rank == 0, timeout=timeout)
        if address.backend == "gloo":
            self.group: Any = dist.ProcessGroupGloo(self.store, rank, size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(self.store, rank, size, options)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, 0).wait()


def layout_of(named: Iterable[tuple[str, torch.Tensor]]) -> Layout:
    return [(name, tuple(t.shape)) for name, t in named]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def buckets_of(layout: Layout, dtype: torch.dtype, bucket_bytes: int) -> list[list[int]]:
    """Consecutive parameter indices per bucket, each bucket at most ``bucket_bytes`` (a
    parameter larger than the budget travels alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    size = torch.empty((), dtype=dtype).element_size()
    buckets: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, (_, shape) in enumerate(layout):
        nbytes = _numel(shape) * size
        if current and used + nbytes > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(index)
        used += nbytes
    if current:
        buckets.append(current)
    return buckets


def send_weights(
    group: WeightGroup,
    named: Iterable[tuple[str, torch.Tensor]],
    layout: Layout,
    *,
    dtype: torch.dtype,
    bucket_bytes: int,
    device: str | torch.device = "cpu",
) -> int:
    """Broadcast ``named`` (in ``layout``'s order, names checked) bucket by bucket; returns
    the bytes sent. Tensors are read one at a time: a bucket is the only extra copy."""
    items: Iterator[tuple[str, torch.Tensor]] = iter(named)
    sent = 0
    for bucket in buckets_of(layout, dtype, bucket_bytes):
        parts = []
        for index in bucket:
            name, tensor = next(items)
            want, shape = layout[index]
            if name != want or tuple(tensor.shape) != shape:
                raise ValueError(
                    f"publication: parameter {index} is {name!r} {tuple(tensor.shape)}, the "
                    f"engines expect {want!r} {shape}"
                )
            parts.append(tensor.detach().to(device=device, dtype=dtype).reshape(-1))
        flat = torch.cat(parts)
        group.broadcast(flat)
        sent += flat.numel() * flat.element_size()
    if next(items, None) is not None:
        raise ValueError(f"publication: more parameters than the {len(layout)} of the layout")
    return sent


def receive_weights(
    group: WeightGroup,
    layout: Layout,
    *,
    dtype: torch.dtype,
    bucket_bytes: int,
    device: str | torch.device = "cpu",
) -> list[tuple[str, torch.Tensor]]:
    """Every bucket of one publication, unpacked into named tensors (none is loaded here)."""
    staged: list[tuple[str, torch.Tensor]] = []
    for bucket in buckets_of(layout, dtype, bucket_bytes):
        total = sum(_numel(layout[i][1]) for i in bucket)
        flat = torch.empty(total, dtype=dtype, device=device)
        group.broadcast(flat)
        offset = 0
        for index in bucket:
            name, shape = layout[index]
            n = _numel(shape)
            staged.append((name, flat[offset : offset + n].view(shape)))
            offset += n
    return staged


def checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """One hash over every tensor's name and bytes, in order (sender and receivers compare)."""
    total = hashlib.sha256()
    for name, tensor in named:
        total.update(name.encode())
        total.update(digest(tensor).encode())
    return total.hexdigest()


def digest(tensor: torch.Tensor) -> str:
    """A hash of the tensor's bytes (dtype and shape included)."""
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    head = f"{tensor.dtype}/{tuple(tensor.shape)}/".encode()
    return hashlib.sha256(head + data).hexdigest()
