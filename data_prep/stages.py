"""Named stages with counts that reconcile: every record in is kept, filtered or quarantined.

``StageLog.apply`` runs one filter over a list and records, per pool and stage, how many
records came in, how many were kept, filtered (with a count per reason) and quarantined.
``check`` asserts in = kept + filtered + quarantined for every stage and that each stage
takes in exactly what the previous one kept.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from data_prep.schema import Quarantined

Item = TypeVar("Item")


@dataclass
class StageCount:
    pool: str
    stage: str
    n_in: int
    kept: int
    filtered: int
    quarantined: int
    reasons: dict[str, int] = field(default_factory=dict)

    def row(self) -> dict[str, object]:
        return {
            "pool": self.pool,
            "stage": self.stage,
            "in": self.n_in,
            "kept": self.kept,
            "filtered": self.filtered,
            "quarantined": self.quarantined,
            "reasons": dict(sorted(self.reasons.items())),
        }


@dataclass
class StageLog:
    counts: list[StageCount] = field(default_factory=list)
    quarantine: list[Quarantined] = field(default_factory=list)
    filtered: list[dict[str, str]] = field(default_factory=list)

    def loaded(self, pool: str, n_in: int, kept: int, quarantined: Sequence[Quarantined]) -> None:
        self.quarantine.extend(quarantined)
        reasons = Counter(q.reason.split(":")[0] for q in quarantined)
        self.counts.append(StageCount(pool, "load", n_in, kept, 0, len(quarantined), dict(reasons)))

    def apply(
        self,
        pool: str,
        stage: str,
        items: Sequence[Item],
        reject: Callable[[Item], str | None],
        key: Callable[[Item], str],
    ) -> list[Item]:
        """Keep the items ``reject`` returns None for; record the others with its reason."""
        kept, reasons = [], Counter[str]()
        for item in items:
            reason = reject(item)
            if reason is None:
                kept.append(item)
            else:
                reasons[reason.split(":")[0]] += 1
                self.filtered.append(
                    {"pool": pool, "stage": stage, "id": key(item), "reason": reason}
                )
        self.counts.append(
            StageCount(pool, stage, len(items), len(kept), len(items) - len(kept), 0, dict(reasons))
        )
        return kept

    def check(self) -> None:
        previous: dict[str, int] = {}
        for c in self.counts:
            if c.n_in != c.kept + c.filtered + c.quarantined:
                raise AssertionError(f"{c.pool}/{c.stage}: counts do not reconcile: {c.row()}")
            if c.pool in previous and c.stage != "load" and c.n_in != previous[c.pool]:
                raise AssertionError(
                    f"{c.pool}/{c.stage}: took {c.n_in} records, previous stage kept "
                    f"{previous[c.pool]}"
                )
            previous[c.pool] = c.kept

    def table(self) -> list[dict[str, object]]:
        return [c.row() for c in self.counts]
