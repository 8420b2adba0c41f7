"""Half-open integer intervals [start, end) and operations on lists of them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Interval:
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start > self.end:
            raise ValueError(f"interval start {self.start} is after its end {self.end}")

    @property
    def length(self) -> int:
        return self.end - self.start

    def is_empty(self) -> bool:
        return self.start == self.end

    def contains(self, point: int) -> bool:
        return self.start <= point < self.end

    def overlaps(self, other: Interval) -> bool:
        """Whether the two share at least one point; touching intervals do not."""
        return self.start < other.end and other.start < self.end

    def intersection(self, other: Interval) -> Interval | None:
        start = max(self.start, other.start)
        end = min(self.end, other.end)
        if start >= end:
            return None
        return Interval(start, end)

    def shift(self, offset: int) -> Interval:
        return Interval(self.start + offset, self.end + offset)

    def split(self, point: int) -> tuple[Interval, Interval]:
        """[start, point) and [point, end); ``point`` must lie within the interval."""
        if not self.start <= point <= self.end:
            raise ValueError(f"split point {point} outside [{self.start}, {self.end})")
        return Interval(self.start, point), Interval(point, self.end)


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points; touching intervals join."""
    merged: list[Interval] = []
    for interval in sorted(intervals):
        if interval.is_empty():
            continue
        if merged and interval.start <= merged[-1].end:
            last = merged[-1]
            merged[-1] = Interval(last.start, max(last.end, interval.end))
        else:
            merged.append(interval)
    return merged


def total_length(intervals: Iterable[Interval]) -> int:
    """Points covered by at least one interval."""
    return sum(interval.length for interval in merge(intervals))


def gaps(intervals: Iterable[Interval], within: Interval) -> list[Interval]:
    """The parts of ``within`` that no interval covers, in order."""
    found = []
    cursor = within.start
    for interval in merge(intervals):
        if interval.end <= cursor:
            continue
        if interval.start >= within.end:
            break
        if interval.start > cursor:
            found.append(Interval(cursor, interval.start))
        cursor = max(cursor, interval.end)
    if cursor < within.end:
        found.append(Interval(cursor, within.end))
    return found


def subtract(base: Interval, removed: Iterable[Interval]) -> list[Interval]:
    """``base`` minus every removed interval: the gaps they leave in it."""
    return gaps(removed, within=base)
