"""A work-conserving FIFO server: the learner queue every part of the model shares.

Sources arrive at ``release_s`` and need ``service_s`` of learner time. The server works
whenever work is waiting and serves in release order (ties keep input order):

    finish_i = max(finish_{i-1}, release_i) + service_i,   finish_0 = start_s

Equivalently, the last finish is the largest, over arrival times s, of s plus all work
released at or after s (the Lindley recursion unrolled); the analytic module uses that form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class QueueResult:
    """Finish times in release order, the last finish and the time the server sat idle."""

    finish_s: tuple[float, ...]
    last_finish_s: float
    busy_s: float
    idle_s: float


def fifo_finish(
    release_s: Sequence[float], service_s: Sequence[float], start_s: float = 0.0
) -> QueueResult:
    """Serve sources in release order from ``start_s``; idle time counts from ``start_s``."""
    if len(release_s) != len(service_s):
        raise ValueError(f"release_s has {len(release_s)} entries, service_s {len(service_s)}")
    order = sorted(range(len(release_s)), key=lambda i: release_s[i])
    clock_s = start_s
    idle_s = 0.0
    finish_by_order = []
    for i in order:
        if release_s[i] > clock_s:
            idle_s += release_s[i] - clock_s
            clock_s = release_s[i]
        clock_s += service_s[i]
        finish_by_order.append(clock_s)
    return QueueResult(
        finish_s=tuple(finish_by_order),
        last_finish_s=clock_s,
        busy_s=float(sum(service_s)),
        idle_s=idle_s,
    )
