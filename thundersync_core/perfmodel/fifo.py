"""A work-conserving FIFO server: the learner queue every part of the model shares.

Sources arrive at ``release_s`` and need ``service_s`` of learner time. The server works
whenever work is waiting and serves in release order (ties keep input order):

    finish_i = max(finish_{i-1}, release_i) + service_i,   finish_0 = start_s

Equivalently, the last finish is the largest, over arrival times s, of s plus all work
released at or after s (the Lindley recursion unrolled); the analytic module uses that form.

With ``slowdown`` c (> 1: slower) the server works at rate 1/c until ``slow_until_s`` (the learner
beside a rollout that shares the machine's memory and caches) and at full rate after: a
source that starts at s with service w finishes at s + c·w if that is before the switch T,
else at T + w - (T - s)/c (what is left of it at full rate), or at s + w when s >= T.

``grouped_finish`` adds the streaming GRPO learner's open-group cap: a source whose group
is not open while ``max_open_groups`` groups are waits (held, in arrival order) until a
group closes (its last member served); then the held sources that can go are served first,
before the next arrival, as the learner does.
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
    #: (start, end) of each service, in the order served.
    intervals: tuple[tuple[float, float], ...] = ()


def fifo_finish(
    release_s: Sequence[float],
    service_s: Sequence[float],
    start_s: float = 0.0,
    *,
    slowdown: float = 1.0,
    slow_until_s: float = 0.0,
) -> QueueResult:
    """Serve sources in release order from ``start_s``; idle time counts from ``start_s``.

    ``busy_s`` is the wall time the server worked (the sum of services when nothing is
    slowed)."""
    if len(release_s) != len(service_s):
        raise ValueError(f"release_s has {len(release_s)} entries, service_s {len(service_s)}")
    return _queue(
        release_s, service_s, None, 0, start_s, slowdown=slowdown, slow_until_s=slow_until_s
    )


def grouped_finish(
    release_s: Sequence[float],
    service_s: Sequence[float],
    groups: Sequence[str],
    max_open_groups: int,
    start_s: float = 0.0,
    *,
    slowdown: float = 1.0,
    slow_until_s: float = 0.0,
) -> QueueResult:
    """``fifo_finish`` with at most ``max_open_groups`` groups open at once (finish times in
    release order). A group's size is how many of ``groups`` name it."""
    if not len(release_s) == len(service_s) == len(groups):
        raise ValueError(
            f"release_s, service_s and groups have {len(release_s)}, {len(service_s)} and "
            f"{len(groups)} entries"
        )
    if max_open_groups < 1:
        raise ValueError(f"max_open_groups must be >= 1, got {max_open_groups}")
    return _queue(
        release_s,
        service_s,
        groups,
        max_open_groups,
        start_s,
        slowdown=slowdown,
        slow_until_s=slow_until_s,
    )


def _queue(
    release_s: Sequence[float],
    service_s: Sequence[float],
    groups: Sequence[str] | None,
    max_open_groups: int,
    start_s: float,
    *,
    slowdown: float,
    slow_until_s: float,
) -> QueueResult:
    """The one server loop; ``groups`` None: no cap."""
    if not slowdown > 0.0:
        raise ValueError(f"slowdown must be positive, got {slowdown}")
    size: dict[str, int] = {}
    for g in groups or ():
        size[g] = size.get(g, 0) + 1
    order = sorted(range(len(release_s)), key=lambda i: release_s[i])
    rank = {i: n for n, i in enumerate(order)}
    served: dict[str, int] = {}
    open_groups: set[str] = set()
    held: list[int] = []
    finish = [start_s] * len(order)
    intervals: list[tuple[float, float]] = []
    clock_s, idle_s, busy_s = start_s, 0.0, 0.0

    def admissible(i: int) -> bool:
        return groups is None or groups[i] in open_groups or len(open_groups) < max_open_groups

    def process(i: int) -> None:
        nonlocal clock_s, busy_s
        begin_s = clock_s
        clock_s = _serve(clock_s, service_s[i], slowdown, slow_until_s)
        busy_s += clock_s - begin_s
        intervals.append((begin_s, clock_s))
        finish[rank[i]] = clock_s
        if groups is None:
            return
        group = groups[i]
        open_groups.add(group)
        served[group] = served.get(group, 0) + 1
        if served[group] == size[group]:
            open_groups.discard(group)

    for i in order:
        if release_s[i] > clock_s:
            idle_s += release_s[i] - clock_s
            clock_s = release_s[i]
        if not admissible(i):
            held.append(i)
            continue
        process(i)
        while (admitted := next((j for j in held if admissible(j)), None)) is not None:
            held.remove(admitted)
            process(admitted)
    if held:
        raise ValueError(f"{len(held)} sources never admitted (more groups than can close)")
    return QueueResult(
        finish_s=tuple(finish),
        last_finish_s=clock_s,
        busy_s=busy_s if slowdown != 1.0 else float(sum(service_s)),
        idle_s=idle_s,
        intervals=tuple(intervals),
    )


def _serve(start_s: float, service_s: float, slowdown: float, slow_until_s: float) -> float:
    """When a source of ``service_s`` started at ``start_s`` finishes."""
    if slowdown == 1.0 or start_s >= slow_until_s:
        return start_s + service_s
    slowed_end_s = start_s + slowdown * service_s
    if slowed_end_s <= slow_until_s:
        return slowed_end_s
    return slow_until_s + service_s - (slow_until_s - start_s) / slowdown
