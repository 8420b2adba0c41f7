"""The four execution schedules, each a short driver over the shared roles.

Add a schedule by writing a module with ``run(ctx, start, end)`` and an entry here.
"""

from __future__ import annotations

from collections.abc import Callable

from thundersync_core.schedules import one_step_off, pipeline, stream, sync
from thundersync_core.schedules.base import RunContext, StepOutcome

DRIVERS: dict[str, Callable[[RunContext, int, int], None]] = {
    "sync": sync.run,
    "thundersync": stream.run,
    "async": one_step_off.run,
    "pipeline": pipeline.run,
}

__all__ = ["DRIVERS", "RunContext", "StepOutcome"]
