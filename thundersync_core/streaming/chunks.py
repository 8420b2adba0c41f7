"""Key/value chunks of a trajectory, handed to later chunks as detached leaf proxies.

A chunk is a run of consecutive positions whose keys/values were computed together. Later
chunks attend to the *proxies* (detached leaves with requires_grad) of every earlier chunk,
so a backward stops at the proxies and leaves the adjoint there; each chunk keeps an
adjoint ledger (accumulator dtype) that is replayed through the chunk once, by recomputing
its forward (no activation graph is kept between turns).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class KVChunk:
    input_ids: tuple[int, ...]
    proxies: list[torch.Tensor]  # [k0, v0, k1, v1, ...], detached leaves
    ledger: list[torch.Tensor] | None = None

    @staticmethod
    def from_kv(input_ids: Sequence[int], kv_flat: Sequence[torch.Tensor]) -> KVChunk:
        return KVChunk(tuple(input_ids), [t.detach().requires_grad_(True) for t in kv_flat])

    def add_adjoint(self, grads: Sequence[torch.Tensor | None], dtype: torch.dtype) -> None:
        if all(g is None for g in grads):
            return
        if self.ledger is None:
            self.ledger = [torch.zeros_like(p, dtype=dtype) for p in self.proxies]
        for acc, g in zip(self.ledger, grads, strict=True):
            if g is not None:
                acc.add_(g.to(dtype))

    @property
    def nbytes(self) -> int:
        tensors = self.proxies + (self.ledger or [])
        return sum(t.numel() * t.element_size() for t in tensors)


def cache_over(proxy_lists: Sequence[Sequence[torch.Tensor]]) -> DynamicCache:
    """A fresh cache whose layer l holds the concatenated proxies of every given chunk."""
    if not proxy_lists:
        return DynamicCache()
    n_flat = len(proxy_lists[0])
    pairs = []
    for i in range(0, n_flat, 2):
        keys = torch.cat([p[i] for p in proxy_lists], dim=-2)
        values = torch.cat([p[i + 1] for p in proxy_lists], dim=-2)
        pairs.append((keys, values))
    return DynamicCache(ddp_cache_data=pairs)
