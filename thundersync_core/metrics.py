"""Step metrics of the training stage: timeline, idle fraction, learner tail, MFU, staleness.

All times are wall-clock seconds (``time.time()``) taken on one host, so intervals recorded
by different roles can be compared. For a step that starts at t0 (rollout start) and ends at
t1 (new weights acknowledged by the rollout engines):

- ``step_wall_s`` = t1 - t0;
- busy seconds of a role = the length of the union of its busy intervals inside [t0, t1];
- ``learner_idle_fraction`` = 1 - learner busy / step wall;
- ``learner_tail_s`` = end of the optimizer step - the last release (the last reward for
  GRPO, the last teacher score for OPD; under one-step-off, the last reward of the batch
  rolling out during the step): learner work left after the rollout stage;
- ``mfu`` = learner FLOPs / (step wall x learner peak FLOP/s). Learner FLOPs come from a
  ledger of tokens forwarded and backpropagated, at 2N FLOPs per token forward and 4N per
  token backward (N parameters; the attention term is left out, small at these lengths);
- ``staleness_tokens`` = scored tokens by (learner version - version that sampled them).
- ``inflight_swaps`` = trajectories whose turns more than one policy version sampled.

Every second of a step is named once (``StepTimeline.breakdown``, the ``wall_*_s`` fields,
which sum to ``step_wall_s``). Each instant goes to the first of these that is under way:

    generation    an engine call for some episode
    grading       a verifier or test run (grade start to reward)
    sandbox       a tool command, or a sandbox being set up (task copied in) or removed
    optimizer     the barrier: normalisation, clipping, the optimizer step
    publication   the new weights written and loaded into the engine
    tail          learner work after the last release, before the barrier
    learner       learner work while no episode is generating, grading or executing
    overhead      none of these (scheduling, transfers, bookkeeping)

so learner work hidden under rollouts is counted as the rollout's time: what the wall
would be without it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
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


def measure_peak_flops(
    seconds: float = 0.5, size: int = 512, *, device: str = "cpu", dtype: str = "float32"
) -> float:
    """GEMM FLOP/s in ``dtype`` on ``device``: on the CPU, the calling thread's cores."""
    import torch  # noqa: PLC0415 - keeps this module light for orchestration

    on_gpu = device != "cpu"
    size = max(size, 4096) if on_gpu else size
    kind = getattr(torch, dtype)
    a = torch.randn(size, size, device=device, dtype=kind)
    b = torch.randn(size, size, device=device, dtype=kind)

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize(device)

    a @ b  # warm-up
    sync()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
        if on_gpu and n % 8 == 0:
            sync()
    sync()
    return 2.0 * size**3 * n / (time.perf_counter() - t0)


def turn_token_versions(traj: Trajectory) -> list[tuple[int, int]]:
    """(version that sampled it, scored tokens) for each action turn of ``traj``."""
    versions = (traj.metadata or {}).get("turn_versions") or [traj.policy_version]
    actions = [s for s in traj.segments if s.kind == "action"]
    return [(int(v), sum(seg.scored)) for v, seg in zip(versions, actions, strict=False)]


def generated_tokens(trajectories: Iterable[Trajectory]) -> int:
    """Tokens the engine sampled for ``trajectories`` (their action segments)."""
    return sum(len(s.ids) for t in trajectories for s in t.segments if s.kind == "action")


def inflight_swaps(trajectories: Iterable[Trajectory]) -> int:
    """Trajectories that new weights reached mid-trajectory: their turns were sampled by
    more than one policy version (the pipeline schedule's in-flight updates)."""
    return sum(
        len({int(v) for v in (t.metadata or {}).get("turn_versions") or ()}) > 1
        for t in trajectories
    )


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
    #: The step's parts (see the module docstring); ``rollout`` is generation + sandbox.
    generation: list[Interval] = field(default_factory=list)
    sandbox: list[Interval] = field(default_factory=list)
    optimizer: Interval = (0.0, 0.0)

    def breakdown(self) -> dict[str, float]:
        """``wall_<part>_s`` for each part of the module docstring; they sum to the wall."""
        last_release = max(self.releases_s, default=self.start_s)
        pub_start, pub_end = self.publication
        written = self.learner_done_s if 0 < self.learner_done_s <= pub_start else pub_start
        layers = [
            ("generation", self.generation),
            ("grading", self.verify),
            ("sandbox", self.sandbox),
            ("optimizer", [self.optimizer]),
            ("publication", [(written, pub_end)]),
            ("tail", [(max(a, last_release), b) for a, b in self.learner]),
            ("learner", [(a, min(b, last_release)) for a, b in self.learner]),
        ]
        return {
            f"wall_{name}_s": s for name, s in partition(self.start_s, self.end_s, layers).items()
        }

    def summary(self) -> dict[str, float]:
        wall = self.end_s - self.start_s
        parts = self.breakdown()
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
            **parts,
            "wall_overhead_fraction": parts["wall_overhead_s"] / wall if wall > 0 else 0.0,
        }


def partition(
    start: float, end: float, layers: Sequence[tuple[str, Sequence[Interval]]]
) -> dict[str, float]:
    """Seconds of [start, end] per layer name, each instant given to the first layer with an
    interval over it, and to ``overhead`` when none has; the values sum to end - start."""
    names = [name for name, _ in layers]
    out = dict.fromkeys([*names, "overhead"], 0.0)
    if end <= start:
        return out
    clipped = [
        [(max(a, start), min(b, end)) for a, b in intervals if min(b, end) > max(a, start)]
        for _, intervals in layers
    ]
    cuts = sorted({start, end, *(t for layer in clipped for iv in layer for t in iv)})
    for a, b in pairwise(cuts):
        mid = (a + b) / 2
        owner = next(
            (name for name, layer in zip(names, clipped, strict=True)
             if any(lo <= mid < hi for lo, hi in layer)),
            "overhead",
        )  # fmt: skip
        out[owner] += b - a
    return out


def episode_intervals(
    events: Sequence[Mapping[str, Any]], open_until: float | None = None
) -> dict[str, list[Interval]]:
    """An agent trajectory's event list as intervals: ``generation`` (engine calls),
    ``sandbox`` (set-up, commands, removal) and ``grading`` (grade start to reward).

    ``open_until``: the list of an episode still under way, read at that time; an interval
    begun and not yet ended runs until then (without it, such an interval is left out)."""
    out: dict[str, list[Interval]] = {"generation": [], "sandbox": [], "grading": []}
    pairs = {
        "setup_start": ("start", "sandbox"),
        "generate_start": ("generate_end", "generation"),
        "exec_start": ("exec_end", "sandbox"),
        "grade_start": ("reward", "grading"),
        "reward": ("closed", "sandbox"),
    }
    ends = {end: (start, part) for start, (end, part) in pairs.items()}
    opened: dict[str, float] = {}
    for event in events:
        kind, t = str(event["event"]), float(event["time"])
        if kind in ends and ends[kind][0] in opened:
            out[ends[kind][1]].append((opened.pop(ends[kind][0]), t))
        if kind in pairs:
            opened[kind] = t
    if open_until is not None:
        for kind, t in opened.items():
            if open_until > t:
                out[pairs[kind][1]].append((t, open_until))
    return out


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
