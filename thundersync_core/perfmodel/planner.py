"""Allocation planner: split N devices between rollout, learner (and OPD teacher) engines.

Inputs (``PlanConfig``): N devices, batch B, a roofline decode latency per engine step

    latency(b) = max(floor, compute_per_seq * b)     (b sequences decoding on the engine)

memory-bound at small b, compute-bound at large b; learner tokens/s per device; a response
length distribution (lognormal body + stragglers, in tokens); max staleness M; optionally a
teacher that scores every token (OPD).

Batch lengths are the midpoint quantiles of each mixture component (B(1-p) body samples,
Bp stragglers), so the plan is deterministic. A batch on E engines is dealt round-robin by
length and decoded with continuous batching (at most ``max_concurrency`` per engine): each
decode step of an engine takes latency(active sequences), so a straggler tail decodes at
the memory-bound floor while the rest of the engine sits idle.

Per schedule, with R(E) the batch's decode time on E engines, L(n) = tokens/(rate n) the
learner work on n devices, T(n) the teacher's, S = optimizer + publication:

- sync (colocated, all N devices take each phase in turn): step = R(N) + T(N) + L(N) + S.
- thundersync (split r + l (+ t) = N): releases are the samples' decode completions; the
  teacher (if any) and then the learner serve them as work-conserving FIFO queues;
  step = last learner finish + S.
- async (one-step-off): the stages overlap across consecutive batches;
  step = max(R(r) + P, T(t), L(l) + S), staleness 1, P = publish_s: the engines stop to
  load each published version while the learner sends it.
- pipeline (in-flight): engines decode continuously with c sequences each; by Little's law
  generation delivers g(c) = E c / (mean_len latency(c)) samples/s, which grows with c up
  to the compute-bound knee floor/compute_per_seq and is flat after it. The capacity is
  the largest g(c) for c <= min(max_concurrency, ceil((M + 1) B / E)) (the staleness
  window bounds the in-flight work); in-flight updates pause decoding for P per version,
  so generation sustains g = B / (B / capacity + P); the learner consumes
  l = B / (L(l) + S); step = B / min(g, l, teacher rate). Engines run at the smallest c
  that keeps up with the slowest stage: same throughput, shortest decode times, hence the
  least staleness.

Pruning rules (stated so a reader can check them):
- rate matching (async, pipeline): keep a split only if min(rates)/max(rates) >= 1 - tol,
  rates being each stage's capacity on its devices: the faster stages then idle (or run
  below capacity) at most a fraction tol of the time.
  A faster producer only fills the queue (and raises staleness); a faster consumer idles.
- staleness (async, pipeline): async's lag is 1; the pipeline's is estimated as
  ceil(longest sample's decode time / step), the updates published while it decodes
  (queueing adds nothing in a rate-matched split); both must be <= M.
Feasible rows are ranked by samples/s (equivalently steps/h at fixed B).

Simplifications: colocated sync switches phases for free; prefill is ignored; learner and
teacher throughput scale linearly with devices; async generation is batch-synchronous (a
batch starts when the previous one ends), which keeps its stragglers on the critical path;
sources are whole samples.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from thundersync_core.perfmodel.config import PlanConfig, ResponseConfig, RooflineConfig
from thundersync_core.perfmodel.fifo import fifo_finish


@dataclass(frozen=True)
class PlanRow:
    """One (schedule, split) candidate; ``reason`` says why it was pruned, if it was."""

    schedule: str
    rollout_devices: int
    learner_devices: int
    teacher_devices: int
    step_s: float
    samples_per_s: float
    steps_per_h: float
    generation_samples_per_s: float
    learner_samples_per_s: float
    teacher_samples_per_s: float | None
    engine_concurrency: int
    max_lag: int
    feasible: bool
    reason: str = ""
    speedup_vs_sync: float = math.nan


def response_lengths(responses: ResponseConfig, batch_size: int) -> np.ndarray:
    """Midpoint quantiles of the body and the straggler component, in tokens (sorted)."""
    n_strag = round(batch_size * responses.straggler_prob)
    body = _lognormal_midpoints(responses, batch_size - n_strag)
    strag = _lognormal_midpoints(responses, n_strag) + responses.straggler_extra_tokens
    return np.sort(np.concatenate([body, strag]))


def _lognormal_midpoints(responses: ResponseConfig, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0)
    z = np.array([NormalDist().inv_cdf((i - 0.5) / n) for i in range(1, n + 1)])
    return responses.median_tokens * np.exp(responses.sigma * z)


def decode_engine(lengths: list[float], roofline: RooflineConfig) -> list[float]:
    """Completion times of one engine's queue under continuous batching (input order)."""
    done_s = [0.0] * len(lengths)
    active: list[tuple[float, int]] = []
    steps_done, clock_s, next_i = 0.0, 0.0, 0
    while next_i < len(lengths) or active:
        while next_i < len(lengths) and len(active) < roofline.max_concurrency:
            heapq.heappush(active, (steps_done + max(lengths[next_i], 1.0), next_i))
            next_i += 1
        finish_steps = active[0][0]
        clock_s += (finish_steps - steps_done) * roofline.step_latency_s(len(active))
        steps_done = finish_steps
        while active and active[0][0] <= steps_done:
            done_s[heapq.heappop(active)[1]] = clock_s
    return done_s


def batch_completions(lengths: np.ndarray, engines: int, config: PlanConfig) -> np.ndarray:
    """Completion time of each sample when the batch is dealt to ``engines`` engines."""
    rng = np.random.default_rng(config.seed)
    order = np.argsort(-lengths, kind="stable")
    done_s = np.empty(len(lengths))
    for e in range(engines):
        mine = order[e::engines]
        mine = mine[rng.permutation(len(mine))]
        done_s[mine] = decode_engine(lengths[mine].tolist(), config.sampling)
    return done_s


class _Planner:
    def __init__(self, config: PlanConfig) -> None:
        self.c = config
        self.lengths = response_lengths(config.responses, config.batch_size)
        self.tokens_per_sample = self.lengths + config.responses.prompt_tokens
        self.batch_tokens = float(self.tokens_per_sample.sum())
        self.suffix_s = config.learner.optimizer_s + config.learner.publish_s
        self._rollout_cache: dict[int, np.ndarray] = {}

    def engines(self, devices: int) -> int:
        return devices // self.c.sampling.devices_per_engine

    def completions(self, devices: int) -> np.ndarray:
        if devices not in self._rollout_cache:
            engines = self.engines(devices)
            self._rollout_cache[devices] = batch_completions(self.lengths, engines, self.c)
        return self._rollout_cache[devices]

    def batch_concurrency(self, devices: int) -> int:
        """Sequences an engine starts with when a whole batch is dealt to ``devices``."""
        per_engine = math.ceil(self.c.batch_size / self.engines(devices))
        return min(self.c.sampling.max_concurrency, per_engine)

    def learner_s(self, devices: int) -> float:
        return self.batch_tokens / (self.c.learner.tokens_per_s_per_device * devices)

    def teacher_s(self, devices: int) -> float:
        if self.c.teacher is None or devices == 0:
            return 0.0
        return self.batch_tokens / (self.c.teacher.tokens_per_s_per_device * devices)

    def splits(self) -> list[tuple[int, int, int]]:
        """(rollout, learner, teacher) device counts that use all N devices."""
        n, step = self.c.devices, self.c.sampling.devices_per_engine
        teachers = [0]
        if self.c.teacher is not None:
            teachers = [self.c.teacher.devices] if self.c.teacher.devices else list(range(1, n))
        return [
            (r, n - t - r, t) for t in teachers for r in range(step, n - t, step) if n - t - r >= 1
        ]

    def _row(self, schedule: str, split: tuple[int, int, int], step_s: float, **kw: Any) -> PlanRow:
        rollout, learner, teacher = split
        b = self.c.batch_size
        kw.setdefault("engine_concurrency", self.batch_concurrency(rollout))
        return PlanRow(
            schedule=schedule,
            rollout_devices=rollout,
            learner_devices=learner,
            teacher_devices=teacher,
            step_s=step_s,
            samples_per_s=b / step_s,
            steps_per_h=3600.0 / step_s,
            **kw,
        )

    def sync(self) -> PlanRow:
        n = self.c.devices
        rollout_s = float(self.completions(n).max())
        learner_s = self.learner_s(n) + self.suffix_s
        teacher_s = self.teacher_s(n)
        b = self.c.batch_size
        return self._row(
            "sync",
            (n, n, n if self.c.teacher else 0),
            rollout_s + teacher_s + learner_s,
            generation_samples_per_s=b / rollout_s,
            learner_samples_per_s=b / learner_s,
            teacher_samples_per_s=b / teacher_s if teacher_s else None,
            max_lag=0,
            feasible=True,
        )

    def _rates(self, generation_s: float, split: tuple[int, int, int]) -> dict[str, Any]:
        """Samples/s each stage sustains on its devices (teacher None without a teacher)."""
        _, learner, teacher = split
        b = self.c.batch_size
        teacher_s = self.teacher_s(teacher)
        return {
            "generation_samples_per_s": b / generation_s,
            "learner_samples_per_s": b / (self.learner_s(learner) + self.suffix_s),
            "teacher_samples_per_s": b / teacher_s if teacher_s else None,
        }

    def thundersync(self, split: tuple[int, int, int]) -> PlanRow:
        rollout, learner, teacher = split
        completion_s = self.completions(rollout)
        order = np.argsort(completion_s, kind="stable")
        release_s = completion_s[order].tolist()
        tokens = self.tokens_per_sample[order]
        if self.c.teacher is not None and teacher:
            teacher_rate = self.c.teacher.tokens_per_s_per_device * teacher
            release_s = list(fifo_finish(release_s, (tokens / teacher_rate).tolist()).finish_s)
        service_s = (tokens / (self.c.learner.tokens_per_s_per_device * learner)).tolist()
        step_s = fifo_finish(release_s, service_s).last_finish_s + self.suffix_s
        return self._row(
            "thundersync",
            split,
            step_s,
            **self._rates(float(completion_s.max()), split),
            max_lag=0,
            feasible=True,
        )

    def _prune_reason(self, rates: dict[str, Any], max_lag: int) -> str:
        values = [v for v in rates.values() if v is not None]
        balance = min(values) / max(values)
        floor = 1.0 - self.c.rate_tolerance
        reasons = []
        if balance < floor:
            reasons.append(f"rate mismatch: slowest/fastest stage = {balance:.2f} < {floor:.2f}")
        if max_lag > self.c.max_staleness:
            reasons.append(f"staleness {max_lag} > max_staleness {self.c.max_staleness}")
        return "; ".join(reasons)

    def one_step_off(self, split: tuple[int, int, int]) -> PlanRow:
        rollout, learner, teacher = split
        rollout_s = float(self.completions(rollout).max()) + self.c.learner.publish_s
        step_s = max(rollout_s, self.teacher_s(teacher), self.learner_s(learner) + self.suffix_s)
        rates = self._rates(rollout_s, split)
        reason = self._prune_reason(rates, 1)
        return self._row(
            "async", split, step_s, **rates, max_lag=1, feasible=not reason, reason=reason
        )

    def generation_rate(self, engines: int, concurrency: int) -> float:
        """Little's law: ``concurrency`` in flight per engine, each taking mean_len steps."""
        latency_s = self.c.sampling.step_latency_s(concurrency)
        return engines * concurrency / (float(self.lengths.mean()) * latency_s)

    def pipeline(self, split: tuple[int, int, int]) -> PlanRow:
        engines = self.engines(split[0])
        window = math.ceil((self.c.max_staleness + 1) * self.c.batch_size / engines)
        candidates = range(1, min(self.c.sampling.max_concurrency, window) + 1)
        capacity = max(self.generation_rate(engines, c) for c in candidates)
        generation_s = self.c.batch_size / capacity + self.c.learner.publish_s
        rates = self._rates(generation_s, split)
        slowest = min(v for v in rates.values() if v is not None)
        # Run at the smallest concurrency that keeps up: same throughput, least staleness.
        needed = self.c.batch_size / (self.c.batch_size / slowest - self.c.learner.publish_s)
        concurrency = next(
            (c for c in candidates if self.generation_rate(engines, c) >= needed * (1 - 1e-9)),
            candidates[-1],
        )
        step_s = self.c.batch_size / slowest
        decode_max_s = float(self.lengths.max()) * self.c.sampling.step_latency_s(concurrency)
        max_lag = math.ceil(decode_max_s / step_s)
        reason = self._prune_reason(rates, max_lag)
        return self._row(
            "pipeline",
            split,
            step_s,
            **rates,
            engine_concurrency=concurrency,
            max_lag=max_lag,
            feasible=not reason,
            reason=reason,
        )


def plan(config: PlanConfig) -> dict[str, Any]:
    """Every candidate row, the feasible ones ranked by throughput, and the winner."""
    planner = _Planner(config)
    sync_row = planner.sync()
    rows: list[PlanRow] = []
    for schedule in config.schedules:
        if schedule == "sync":
            rows.append(sync_row)
            continue
        build = {
            "thundersync": planner.thundersync,
            "async": planner.one_step_off,
            "pipeline": planner.pipeline,
        }[schedule]
        rows.extend(build(split) for split in planner.splits())
    rows = [_with_speedup(row, sync_row.step_s) for row in rows]
    ranked = sorted((r for r in rows if r.feasible), key=lambda r: -r.samples_per_s)
    pruned = [r for r in rows if not r.feasible]
    return {
        "config": config.model_dump(),
        "batch": _batch_profile(planner),
        "sync_step_s": sync_row.step_s,
        "ranked": [asdict(r) for r in ranked],
        "pruned": [asdict(r) for r in pruned],
        "best_per_schedule": _best_per_schedule(ranked),
        "winner": asdict(ranked[0]) if ranked else None,
    }


def _with_speedup(row: PlanRow, sync_step_s: float) -> PlanRow:
    return PlanRow(**{**asdict(row), "speedup_vs_sync": sync_step_s / row.step_s})


def _best_per_schedule(ranked: list[PlanRow]) -> dict[str, dict[str, Any]]:
    best: dict[str, dict[str, Any]] = {}
    for row in ranked:
        best.setdefault(row.schedule, asdict(row))
    return best


def _batch_profile(planner: _Planner) -> dict[str, Any]:
    """How the batch decodes with every device on rollout: where sync's time goes."""
    done_s = np.sort(planner.completions(planner.c.devices))
    p99_s = float(done_s[math.ceil(0.99 * len(done_s)) - 1])
    return {
        "mean_response_tokens": float(planner.lengths.mean()),
        "max_response_tokens": float(planner.lengths.max()),
        "sync_rollout_s": float(done_s[-1]),
        "sync_rollout_p99_s": p99_s,
        "sync_straggler_tail_s": float(done_s[-1]) - p99_s,
    }


def format_table(result: dict[str, Any]) -> str:
    """The ranked table, a summary of the pruned rows and the winner, as text."""
    head = (
        f"{'rank':>4} {'schedule':<12}{'roll':>5}{'learn':>6}{'teach':>6}{'step_s':>9}"
        f"{'samples/s':>10}{'steps/h':>9}{'vs_sync':>8}{'gen/s':>8}{'learn/s':>8}{'lag':>4}"
    )
    lines = [head]
    for rank, row in enumerate(result["ranked"], start=1):
        lines.append(
            f"{rank:>4} {row['schedule']:<12}{row['rollout_devices']:>5}"
            f"{row['learner_devices']:>6}{row['teacher_devices']:>6}{row['step_s']:>9.1f}"
            f"{row['samples_per_s']:>10.2f}{row['steps_per_h']:>9.1f}"
            f"{row['speedup_vs_sync']:>7.2f}x{row['generation_samples_per_s']:>8.2f}"
            f"{row['learner_samples_per_s']:>8.2f}{row['max_lag']:>4}"
        )
    batch = result["batch"]
    lines.append(
        f"sync rollout on all devices: {batch['sync_rollout_s']:.1f} s "
        f"(99% of samples by {batch['sync_rollout_p99_s']:.1f} s, "
        f"last 1% {batch['sync_straggler_tail_s']:.1f} s more)"
    )
    lines.extend(
        f"pruned {row['schedule']} {row['rollout_devices']}/{row['learner_devices']}"
        f"/{row['teacher_devices']}: {row['reason']}"
        for row in result["pruned"]
    )
    winner = result["winner"]
    if winner is None:
        lines.append("winner: none (every candidate was pruned)")
    else:
        lines.append(
            f"winner: {winner['schedule']} with {winner['rollout_devices']} rollout / "
            f"{winner['learner_devices']} learner / {winner['teacher_devices']} teacher devices: "
            f"{winner['step_s']:.1f} s/step, {winner['samples_per_s']:.2f} samples/s, "
            f"predicted {winner['speedup_vs_sync']:.2f}x over sync "
            f"({result['sync_step_s']:.1f} s/step)"
        )
    return "\n".join(lines)
