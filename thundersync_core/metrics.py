"""Step metrics of the training stage: timeline, idle fraction, learner tail, MFU, staleness.

All times are wall-clock seconds (``time.time()``) taken on one host, so intervals recorded
by different roles can be compared. For a step that starts at t0 (rollout start) and ends at
t1 (new weights acknowledged by the rollout engines):

- ``step_wall_s`` = t1 - t0;
- busy seconds of a role = the length of the union of its busy intervals inside [t0, t1];
- ``learner_idle_fraction`` = 1 - learner busy / step wall;
- ``learner_tail_s`` = end of the optimizer step - the last release (the last reward for
  GRPO, the last teacher score for OPD): learner work left after the rollout stage;
- ``mfu`` = learner FLOPs / (step wall x learner peak FLOP/s). Learner FLOPs come from a
  ledger of tokens forwarded and backpropagated, at 2N FLOPs per token forward and 4N per
  token backward (N parameters; the attention term is left out, small at these lengths);
- ``staleness_tokens`` = scored tokens by (learner version - version that sampled them).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from thundersync_core.batch import Trajectory

Interval = tuple[float, float]


def union_seconds(
    intervals: Iterable[Interval], start: float = -1e300, end: float = 1e300
) -> float:
    """Length of the union of ``intervals`` clipped to [start, end]."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in intervals if b > a)
    total, cur_a, cur_b = 0.0, None, None
    for a, b in clipped:
        if b <= a:
            continue
        if cur_b is None or a > cur_b:
            if cur_b is not None and cur_a is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_a is not None and cur_b is not None:
        total += cur_b - cur_a
    return total


@dataclass
class FlopLedger:
    """Learner FLOPs: 2N per token forwarded, 4N per token backpropagated."""

    n_params: int
    forward_tokens: int = 0
    backward_tokens: int = 0

    def add(self, *, forward: int, backward: int) -> None:
        self.forward_tokens += forward
        self.backward_tokens += backward

    @property
    def flops(self) -> float:
        return (
            2.0 * self.n_params * self.forward_tokens + 4.0 * self.n_params * self.backward_tokens
        )

    def reset(self) -> None:
        self.forward_tokens = self.backward_tokens = 0


def measure_peak_flops(seconds: float = 0.5, size: int = 512) -> float:
    """Float32 GEMM FLOP/s on the calling thread's cores: the CPU's practical peak."""
    import torch  # noqa: PLC0415 - keeps this module light for orchestration

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return 2.0 * size**3 * n / (time.perf_counter() - t0)


def turn_token_versions(traj: Trajectory) -> list[tuple[int, int]]:
    """(version that sampled it, scored tokens) for each action turn of ``traj``."""
    versions = (traj.metadata or {}).get("turn_versions") or [traj.policy_version]
    actions = [s for s in traj.segments if s.kind == "action"]
    return [(int(v), sum(seg.scored)) for v, seg in zip(versions, actions, strict=False)]


def staleness_tokens(
    token_versions: Iterable[tuple[int, int]], learner_version: int
) -> dict[str, int]:
    """Tokens by lag: ``token_versions`` yields (version that sampled them, token count)."""
    hist: dict[str, int] = {}
    for version, count in token_versions:
        lag = str(learner_version - version)
        hist[lag] = hist.get(lag, 0) + count
    return dict(sorted(hist.items(), key=lambda kv: int(kv[0])))


@dataclass
class StepTimeline:
    """What one step's roles did and when; ``summary`` turns it into the step record."""

    step: int
    start_s: float
    end_s: float = 0.0
    learner_done_s: float = 0.0
    releases_s: list[float] = field(default_factory=list)
    learner: list[Interval] = field(default_factory=list)
    rollout: list[Interval] = field(default_factory=list)
    verify: list[Interval] = field(default_factory=list)
    publication: Interval = (0.0, 0.0)

    def summary(self) -> dict[str, float]:
        wall = self.end_s - self.start_s
        learner_busy = union_seconds(self.learner, self.start_s, self.end_s)
        last_release = max(self.releases_s, default=self.start_s)
        return {
            "step_wall_s": wall,
            "rollout_busy_s": union_seconds(self.rollout, self.start_s, self.end_s),
            "verify_busy_s": union_seconds(self.verify, self.start_s, self.end_s),
            "learner_busy_s": learner_busy,
            "learner_idle_fraction": 1.0 - learner_busy / wall if wall > 0 else 0.0,
            "learner_tail_s": max(self.learner_done_s - last_release, 0.0),
            "rollout_stage_s": last_release - self.start_s,
            "publication_s": self.publication[1] - self.publication[0],
        }


def rollout_intervals(events: Sequence[Mapping[str, Any]]) -> tuple[list[Interval], list[Interval]]:
    """(generation, verification) intervals from an agent trajectory's event list."""
    gen, verify = [], []
    opened: dict[str, float] = {}
    for event in events:
        kind, t = str(event["event"]), float(event["time"])
        if kind in ("generate_start", "exec_start", "grade_start"):
            opened[kind.split("_", maxsplit=1)[0]] = t
        elif kind in ("generate_end", "exec_end") and kind.split("_", maxsplit=1)[0] in opened:
            gen.append((opened.pop(kind.split("_", maxsplit=1)[0]), t))
        elif kind == "reward" and "grade" in opened:
            verify.append((opened.pop("grade"), t))
    return gen, verify


def peak_rss_bytes(pid: int | None = None, *, children: bool = True) -> int:
    """Resident memory of a process (and its children): a role's memory right now."""
    import psutil  # noqa: PLC0415

    proc = psutil.Process(pid)
    procs = [proc, *(proc.children(recursive=True) if children else [])]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total
