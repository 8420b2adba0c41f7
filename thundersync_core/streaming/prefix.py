"""Boundary adjoints for a shared prefix (a group's prompt).

The prefix is forwarded once and its per-layer keys/values kept with their graph. Every
later segment attends to *detached leaf proxies* of those keys/values, so its backward stops
at the proxies and leaves the gradient on them (the adjoint) instead of re-entering the
prefix. The caller accumulates adjoints in a ledger and calls ``replay`` once, which
backpropagates the ledger through the prefix into the parameters: one prefix backward per
group instead of one per trajectory, with the same result by linearity of the chain rule.

``keep_graph=False`` keeps only the keys/values, not the prefix's graph: ``replay`` forwards
the prefix again with its graph and backpropagates through that (one more prefix forward per
group, and no prefix activations held while the group is open).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from thundersync_core.policy.logprobs import cache_from_flat, prefix_key_values


class SharedPrefix:
    def __init__(
        self, model: PreTrainedModel, prefix_ids: Sequence[int], *, keep_graph: bool = True
    ) -> None:
        device = next(model.parameters()).device
        self._ids_T = torch.tensor(list(prefix_ids), dtype=torch.long, device=device)
        self._model = model
        self.keep_graph = keep_graph
        with torch.set_grad_enabled(keep_graph and torch.is_grad_enabled()):
            kv = prefix_key_values(model, self._ids_T)
        self._kv_flat: list[torch.Tensor] | None = [t for pair in kv for t in pair]
        self.proxies = [t.detach().requires_grad_(True) for t in self._kv_flat]
        if not keep_graph:
            self._kv_flat = []  # replayed by a new forward
        self.n_tokens = len(prefix_ids)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.proxies)

    def cache(self) -> DynamicCache:
        """A fresh cache over the proxies; later tokens append to it, never to the proxies."""
        return cache_from_flat(self.proxies)

    def cache_for_rows(self, rows: int) -> DynamicCache:
        """A fresh cache over the proxies for a batch of ``rows`` continuations (a pack); the
        gradient of every row lands on the one proxy."""
        return cache_from_flat([p.expand(rows, *p.shape[1:]) for p in self.proxies])

    def replay(
        self, adjoints: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor | None, ...]:
        """Backpropagate accumulated adjoints through the prefix once; frees its graph."""
        if self._kv_flat is None:
            raise RuntimeError("prefix already replayed: its graph is freed")
        kv, self._kv_flat = self._kv_flat, None
        if not self.keep_graph:
            kv = [t for pair in prefix_key_values(self._model, self._ids_T) for t in pair]
        return backward_adjoints(kv, adjoints, params)

    def release(self) -> None:
        """Drop the prefix graph without replaying (all adjoints are zero)."""
        self._kv_flat = None


def backward_adjoints(
    outputs: Sequence[torch.Tensor],
    adjoints: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of sum_i <adjoint_i, output_i> with respect to ``params``.

    An output that does not depend on any trainable parameter (a layer's keys when only
    later layers or other projections carry LoRA adapters) has no graph and contributes
    nothing; it is left out rather than refused."""
    pairs = [(t, a.to(t.dtype)) for t, a in zip(outputs, adjoints, strict=True) if t.requires_grad]
    if not pairs:
        return (None,) * len(params)
    return torch.autograd.grad(
        [t for t, _ in pairs], list(params), grad_outputs=[a for _, a in pairs], allow_unused=True
    )
