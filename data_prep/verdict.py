"""The outcome of validating one record: kept or not, and why, in one sentence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Verdict:
    record_id: str
    ok: bool
    reason: str
    details: dict[str, Any] = field(default_factory=dict)
