"""Discrete-event simulation of a whole run under the four schedules.

Model (one learner queue, disjoint rollout slots; every schedule sees the same trajectory
draws, indexed j = 0, 1, ..., batch b holding j in [bB, (b+1)B)):

- Rollout: ``rollout_slots`` trajectories run at once; a freed slot takes the next admitted
  trajectory (continuous batching). A trajectory is ``turns`` x (generation, tool call).
- Sources: a trajectory (released at its end) or, with ``source_granularity: turn`` (OPD),
  each turn (released when its generation ends; its backward overlaps the tool call).
  Learner service of a source = learner_s_per_source + learner_s_per_token * tokens.
- Suffix of an update: optimizer_s + publish_s, on the learner; the engines' reload pause
  is neglected. Update u consumes batch u and publishes version u + 1.

Per schedule (G_b: the time batch b may start; E_u: end of update u, E_-1 = 0):

- sync:        G_b = E_{b-1}; update b starts after the batch's last release.
- thundersync: G_b = E_{b-1}; update b serves sources FIFO as released (work-conserving).
- async:       one-step-off with batch-synchronous generation:
               G_b = max(batch b-1 done, E_{b-2}), so batch b uses theta_{b-1} (lag 1)
               and the steady step is max(R, L + S).
- pipeline:    continuous generation with in-flight weight updates. Trajectory j may start
               while (started - dropped) < (v_pub + max_staleness + 1) B, v_pub the live
               version; the learner takes completed trajectories in completion order, B per
               update, serving each as it arrives. Tokens carry the version live when they
               were generated; a trajectory whose oldest token would be more than
               max_staleness versions behind its update is dropped (and counted), so the
               bound holds for every trained token. Sources are whole trajectories here.

With max_staleness = 0 the pipeline reduces exactly to thundersync (trajectory sources).
Outputs per update: step time E_u - E_{u-1}, tail (learner work left after the update's last
release), learner idle fraction 1 - (service + suffix)/step; per run: rollout utilisation,
tokens and samples by version lag. ``sampling: midpoint`` replaces random draws by the
midpoint quantiles (i - 1/2)/B of each batch (randomly permuted), the analytic module's
finite-source approximation.
"""

from __future__ import annotations

import heapq
import itertools
import math
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cache
from statistics import NormalDist
from typing import Any

import numpy as np

from thundersync_core.perfmodel.config import SCHEDULES, DurationConfig, Schedule, SimConfig
from thundersync_core.perfmodel.fifo import fifo_finish


@dataclass(frozen=True)
class Block:
    """One batch of B trajectory draws: [B, turns] arrays, ``duration_s`` is [B]."""

    gen_s: np.ndarray
    tool_s: np.ndarray
    tokens: np.ndarray
    gen_end_offset_s: np.ndarray
    duration_s: np.ndarray


def _lognormal_quantiles(median_s: float, sigma: float, n: int) -> np.ndarray:
    z = np.array([NormalDist().inv_cdf((i - 0.5) / n) for i in range(1, n + 1)])
    return median_s * np.exp(sigma * z)


def _draw_body(d: DurationConfig, n: int, rng: np.random.Generator, midpoint: bool) -> np.ndarray:
    if midpoint:
        if d.body == "uniform":
            q = d.low_s + (d.high_s - d.low_s) * (np.arange(1, n + 1) - 0.5) / n
        else:
            q = _lognormal_quantiles(d.median_s, d.sigma, n)
        return rng.permutation(q)
    if d.body == "uniform":
        return rng.uniform(d.low_s, d.high_s, n)
    return d.median_s * np.exp(d.sigma * rng.standard_normal(n))


def _draw_tool(d: DurationConfig, n: int, rng: np.random.Generator, midpoint: bool) -> np.ndarray:
    if d.tool_latency_s == 0.0:
        return np.zeros(n)
    if midpoint:
        return rng.permutation(_lognormal_quantiles(d.tool_latency_s, d.tool_sigma, n))
    return d.tool_latency_s * np.exp(d.tool_sigma * rng.standard_normal(n))


def _draw_stragglers(
    d: DurationConfig, n: int, rng: np.random.Generator, midpoint: bool
) -> np.ndarray:
    if midpoint:
        mask = np.zeros(n, dtype=bool)
        mask[rng.permutation(n)[: round(n * d.straggler_prob)]] = True
        return mask
    return rng.random(n) < d.straggler_prob


class TrajectoryPool:
    """Trajectory draws by index; block b comes from its own seeded stream, so any schedule
    that asks for trajectory j gets the same one."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self._block = cache(self._make_block)

    def block(self, b: int) -> Block:
        return self._block(b)

    def _make_block(self, b: int) -> Block:
        c, d = self.config, self.config.durations
        rng = np.random.default_rng([c.seed, b])
        midpoint = c.sampling == "midpoint"
        n, turns = c.batch_size, d.turns
        gen_s_BT = np.stack([_draw_body(d, n, rng, midpoint) for _ in range(turns)], axis=1)
        tool_s_BT = np.stack([_draw_tool(d, n, rng, midpoint) for _ in range(turns)], axis=1)
        gen_s_BT[:, -1] += d.straggler_extra_s * _draw_stragglers(d, n, rng, midpoint)
        turn_s_BT = gen_s_BT + tool_s_BT
        gen_end_offset_s_BT = np.cumsum(turn_s_BT, axis=1) - tool_s_BT
        return Block(
            gen_s=gen_s_BT,
            tool_s=tool_s_BT,
            tokens=gen_s_BT * d.decode_tokens_per_s,
            gen_end_offset_s=gen_end_offset_s_BT,
            duration_s=turn_s_BT.sum(axis=1),
        )

    def trajectory(self, j: int) -> tuple[Block, int]:
        return self.block(j // self.config.batch_size), j % self.config.batch_size

    def service_s(self, tokens: float, n_sources: int) -> float:
        c = self.config
        return c.learner_s_per_source * n_sources + c.learner_s_per_token * tokens


@dataclass(frozen=True)
class UpdateRecord:
    end_s: float
    step_s: float
    tail_s: float
    busy_s: float


@dataclass
class ScheduleRun:
    """What one schedule did over the run."""

    schedule: str
    updates: list[UpdateRecord] = field(default_factory=list)
    tokens_by_lag: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    samples_by_lag: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    rollout_busy_s: float = 0.0
    dropped_samples: int = 0

    def record(
        self, work_end_s: float, suffix_s: float, last_release_s: float, busy_s: float
    ) -> None:
        """Close an update whose learner work ended at ``work_end_s`` (plain floats kept)."""
        prev_end_s = self.updates[-1].end_s if self.updates else 0.0
        end_s = float(work_end_s) + suffix_s
        tail_s = float(work_end_s - last_release_s)
        self.updates.append(
            UpdateRecord(end_s, end_s - prev_end_s, tail_s, float(busy_s) + suffix_s)
        )

    def summary(self, config: SimConfig) -> dict[str, Any]:
        steady = self.updates[config.warmup_steps :]
        steady_s = sum(u.step_s for u in steady)
        total_s = self.updates[-1].end_s
        return {
            "total_s": total_s,
            "steady_step_s": steady_s / len(steady),
            "step_s": [u.step_s for u in self.updates],
            "tail_s": [u.tail_s for u in self.updates],
            "learner_idle_fraction": max(0.0, 1.0 - sum(u.busy_s for u in steady) / steady_s),
            "rollout_utilization": self.rollout_busy_s / (config.rollout_slots * total_s),
            "samples_per_s": config.batch_size * len(steady) / steady_s,
            "dropped_samples": self.dropped_samples,
            "staleness": {
                "tokens_by_lag": {str(k): v for k, v in sorted(self.tokens_by_lag.items())},
                "samples_by_lag": {str(k): v for k, v in sorted(self.samples_by_lag.items())},
            },
        }


def _batch_sources(
    pool: TrajectoryPool, b: int, start_s_B: np.ndarray
) -> tuple[list[float], list[float]]:
    """Release times and services of batch b's sources, given its trajectories' starts."""
    block = pool.block(b)
    if pool.config.source_granularity == "turn":
        release_s = (start_s_B[:, None] + block.gen_end_offset_s).ravel()
        service_s = [pool.service_s(float(t), 1) for t in block.tokens.ravel()]
        return release_s.tolist(), service_s
    release_s = start_s_B + block.duration_s
    tokens_B = block.tokens.sum(axis=1)
    turns = block.tokens.shape[1]
    return release_s.tolist(), [pool.service_s(t, turns) for t in tokens_B]


def _rollout_batch(pool: TrajectoryPool, b: int, gate_s: float) -> np.ndarray:
    """Start times of batch b's trajectories: continuous batching over the slots from G_b."""
    duration_s_B = pool.block(b).duration_s
    free_s = [gate_s] * min(pool.config.rollout_slots, len(duration_s_B))
    start_s_B = np.empty(len(duration_s_B))
    for i, duration_s in enumerate(duration_s_B):
        start_s_B[i] = heapq.heappop(free_s)
        heapq.heappush(free_s, start_s_B[i] + duration_s)
    return start_s_B


def _batch_gate_s(schedule: Schedule, b: int, ends_s: list[float], done_s: list[float]) -> float:
    if schedule == "async":
        return max(done_s[b - 1] if b >= 1 else 0.0, ends_s[b - 2] if b >= 2 else 0.0)
    return ends_s[b - 1] if b >= 1 else 0.0


def _run_batch_schedule(pool: TrajectoryPool, schedule: Schedule) -> ScheduleRun:
    """sync, thundersync and async: one batch per update, computed step by step (exact)."""
    c = pool.config
    run = ScheduleRun(schedule)
    done_s: list[float] = []
    for b in range(c.steps):
        ends_s = [u.end_s for u in run.updates]
        gate_s = _batch_gate_s(schedule, b, ends_s, done_s)
        start_s_B = _rollout_batch(pool, b, gate_s)
        release_s, service_s = _batch_sources(pool, b, start_s_B)
        done_s.append(max(release_s))
        learner_free_s = ends_s[-1] if ends_s else 0.0
        if schedule == "thundersync":
            work_end_s = fifo_finish(release_s, service_s, start_s=learner_free_s).last_finish_s
        else:
            work_end_s = max(done_s[-1], learner_free_s) + sum(service_s)
        run.record(work_end_s, c.suffix_s, done_s[-1], sum(service_s))
        lag = b - bisect_right(ends_s, gate_s)
        block = pool.block(b)
        run.tokens_by_lag[lag] += float(block.tokens.sum())
        run.samples_by_lag[lag] += c.batch_size
        run.rollout_busy_s += float(block.duration_s.sum())
    return run


class _Pipeline:
    """Event loop of the in-flight pipeline: completions and publications on one heap."""

    _PUBLISH, _COMPLETE = 0, 1

    def __init__(self, pool: TrajectoryPool) -> None:
        self.pool, self.c = pool, pool.config
        self.run = ScheduleRun("pipeline")
        self.events: list[tuple[float, int, int, int]] = []
        self.order = itertools.count()
        self.free_slots = self.c.rollout_slots
        self.started = 0
        self.version_live = 0
        self.start_s: dict[int, float] = {}
        self.start_version: dict[int, int] = {}
        self.publish_s: list[float] = []
        self.learner_free_s = 0.0
        self.chunk: list[tuple[float, float]] = []

    def _admissible(self) -> bool:
        live = self.started - self.run.dropped_samples
        return live < (self.version_live + self.c.max_staleness + 1) * self.c.batch_size

    def _try_start(self, now_s: float) -> None:
        while self.free_slots > 0 and self._admissible():
            j = self.started
            block, i = self.pool.trajectory(j)
            self.start_s[j], self.start_version[j] = now_s, self.version_live
            self.free_slots -= 1
            self.started += 1
            end_s = now_s + float(block.duration_s[i])
            heapq.heappush(self.events, (end_s, next(self.order), self._COMPLETE, j))

    def _token_lags(self, j: int, update: int) -> dict[int, float]:
        """Tokens of trajectory j by version lag: generation split at publication times."""
        block, i = self.pool.trajectory(j)
        lags: dict[int, float] = defaultdict(float)
        for k in range(block.gen_s.shape[1]):
            gen_s = float(block.gen_s[i, k])
            if gen_s <= 0.0:
                continue
            end_s = self.start_s[j] + float(block.gen_end_offset_s[i, k])
            a_s = end_s - gen_s
            cuts = [a_s] + [p for p in self.publish_s if a_s < p < end_s] + [end_s]
            for x_s, y_s in itertools.pairwise(cuts):
                version = bisect_right(self.publish_s, x_s)
                lags[update - version] += float(block.tokens[i, k]) * (y_s - x_s) / gen_s
        return lags

    def _on_complete(self, now_s: float, j: int) -> None:
        self.free_slots += 1
        block, i = self.pool.trajectory(j)
        self.run.rollout_busy_s += float(block.duration_s[i])
        update = len(self.run.updates)
        if update - self.start_version[j] > self.c.max_staleness:
            self.run.dropped_samples += 1
            return
        for lag, tokens in self._token_lags(j, update).items():
            self.run.tokens_by_lag[lag] += tokens
        self.run.samples_by_lag[update - self.start_version[j]] += 1
        service_s = self.pool.service_s(float(block.tokens[i].sum()), block.tokens.shape[1])
        self.learner_free_s = max(self.learner_free_s, now_s) + service_s
        self.chunk.append((now_s, service_s))
        if len(self.chunk) == self.c.batch_size:
            busy_s = sum(s for _, s in self.chunk)
            self.run.record(self.learner_free_s, self.c.suffix_s, now_s, busy_s)
            self.learner_free_s = self.run.updates[-1].end_s
            self.publish_s.append(self.learner_free_s)
            event = (self.learner_free_s, next(self.order), self._PUBLISH, -1)
            heapq.heappush(self.events, event)
            self.chunk = []

    def simulate(self) -> ScheduleRun:
        self._try_start(0.0)
        while len(self.run.updates) < self.c.steps:
            if not self.events:
                raise RuntimeError("pipeline simulation stalled with no pending event")
            now_s, _, kind, j = heapq.heappop(self.events)
            if kind == self._PUBLISH:
                self.version_live += 1
            else:
                self._on_complete(now_s, j)
            self._try_start(now_s)
        self._clip_rollout_busy()
        return self.run

    def _clip_rollout_busy(self) -> None:
        """Count only the part of still-running trajectories inside the simulated horizon."""
        horizon_s = self.run.updates[-1].end_s
        for end_s, _, kind, j in self.events:
            if kind == self._COMPLETE:
                self.run.rollout_busy_s += max(0.0, min(end_s, horizon_s) - self.start_s[j])


def simulate_schedule(config: SimConfig, schedule: Schedule) -> ScheduleRun:
    pool = TrajectoryPool(config)
    if schedule == "pipeline":
        return _Pipeline(pool).simulate()
    return _run_batch_schedule(pool, schedule)


def simulate(config: SimConfig, schedules: tuple[Schedule, ...] = SCHEDULES) -> dict[str, Any]:
    """Summaries of every schedule and each one's steady-state speedup over sync."""
    out: dict[str, Any] = {
        "config": config.model_dump(),
        "profile": duration_profile(config),
        "schedules": {},
    }
    for schedule in schedules:
        out["schedules"][schedule] = simulate_schedule(config, schedule).summary(config)
    if "sync" in out["schedules"]:
        sync_s = out["schedules"]["sync"]["steady_step_s"]
        for summary in out["schedules"].values():
            summary["speedup_vs_sync"] = sync_s / summary["steady_step_s"]
    return out


def talk_straggler_config(**overrides: Any) -> SimConfig:
    """The talk's straggler profile: 99% of samples done in 40 s, the last 1% 80 s more.

    Body: lognormal with median 20 s and sigma 0.22, so even its 99.9th percentile is
    20 exp(0.22 * 3.09) = 39.4 s; 1% stragglers generate 80 s longer. The learner's work per
    batch (about 40 s) balances the body, not the stragglers.
    """
    base: dict[str, Any] = {
        "batch_size": 256,
        "steps": 6,
        "warmup_steps": 1,
        "rollout_slots": 256,
        "durations": DurationConfig(
            median_s=20.0, sigma=0.22, straggler_prob=0.01, straggler_extra_s=80.0
        ),
        # 40 s of learner work for a batch of mean-length (21.3 s, 50 tokens/s) trajectories.
        "learner_s_per_token": 40.0 / (256 * 21.3 * 50.0),
        "optimizer_s": 2.0,
        "publish_s": 1.0,
        "max_staleness": 4,
    }
    base.update(overrides)
    return SimConfig.model_validate(base)


def duration_profile(config: SimConfig) -> dict[str, float]:
    """Quantiles of the drawn trajectory durations over the run's batches (nearest rank)."""
    pool = TrajectoryPool(config)
    ordered = np.sort(np.concatenate([pool.block(b).duration_s for b in range(config.steps)]))

    def at(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])

    quantiles = {"p50_s": 0.5, "p95_s": 0.95, "p98_s": 0.98, "p99_s": 0.99}
    return {name: at(q) for name, q in quantiles.items()} | {"max_s": float(ordered[-1])}
