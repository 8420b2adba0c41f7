"""Predict each schedule's step time from a recorded release trace.

Trace format (written by the training stage; times in seconds since the step start):

    {"suffix_s": 0.4, "rollout_start_s": 0.0,
     "ranks": [{"sources": [{"release_s": 1.2, "service_s": 0.3, "id": "g0/0"}, ...]}],
     "measured": {"sync_step_s": 10.0, "thundersync_step_s": 6.0}}      (optional)

``release_s``: when the source's inputs were fixed; ``service_s``: learner time to process it
on its rank. With r the learner ranks and t_max the last release over all ranks:

    sync:        step = t_max + max_r sum_{i in r} service_i + suffix
    thundersync: per rank, FIFO work-conserving queue in release order from the step start,
                 finish_i = max(finish_{i-1}, release_i) + service_i;
                 step = max_r finish_last(r) + suffix

Reported per schedule: the step, the tail (step end - t_max - suffix: learner work left
after the last release) and the learner idle fraction, 1 - (sum of service + ranks·suffix)
/ (ranks·step): the share of rank-time spent neither on sources nor on the suffix.

With ``measured``: predicted speedup = sync/thundersync predicted steps, measured speedup
from the measured steps, relative error = (predicted - measured) / measured (the one
convention of the bench and the sweep too). A sync step's trace predicts thundersync out of
sample: it holds the release times and the learner's per-source times, measured without
thundersync running.

Contention (optional, ``"contention": {"learner_slowdown": c}``, measured by the bench
without thundersync: the learner's service of fixed sources beside a rollout over the same
alone). Under thundersync the learner works while the rollout runs, on the same machine:
its service runs c times slower until the last release. Sync overlaps nothing, so its
prediction is unchanged.

Open-group cap (optional, ``"max_open_groups": m`` and a ``"group"`` per source): the
streaming GRPO learner holds a source whose group is not open while m groups are, until a
group's last member is served (``fifo.grouped_finish``); sync hands its learner the whole
batch after the last release, so the cap costs it nothing.

The analytic cross-check uses, per rank, rho_r = (rank work)/R and the rank's release lag
D_r behind uniform release over [rollout_start, t_max] (units of R), and reports the tail
bounds [max_r [rho_r - 1]⁺, max_r max(rho_r D_r, rho_r - 1 + D_r)] R of the analytic module,
which the FIFO tail must respect.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from thundersync_core.perfmodel.analytic import tail_bounds
from thundersync_core.perfmodel.fifo import QueueResult, fifo_finish, grouped_finish


class TraceFormatError(ValueError):
    """A trace that does not follow the format; the message names the file and the field."""


def _number(value: Any, field: str, *, minimum: float = 0.0) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < minimum:
        raise TraceFormatError(f"{field}: must be a non-negative number, got {value!r}")
    return float(value)


def _validate_source(source: Any, field: str, rollout_start_s: float) -> dict[str, Any]:
    if not isinstance(source, dict):
        raise TraceFormatError(f"{field}: must be an object")
    for key in ("release_s", "service_s"):
        if key not in source:
            raise TraceFormatError(f"{field}.{key}: missing")
    release_s = _number(source["release_s"], f"{field}.release_s")
    if release_s < rollout_start_s:
        raise TraceFormatError(
            f"{field}.release_s: {release_s} is before rollout_start_s {rollout_start_s}"
        )
    service_s = _number(source["service_s"], f"{field}.service_s")
    source_id = source.get("id", field)
    if not isinstance(source_id, str):
        raise TraceFormatError(f"{field}.id: must be a string, got {source_id!r}")
    group = source.get("group")
    if group is not None and not isinstance(group, str):
        raise TraceFormatError(f"{field}.group: must be a string, got {group!r}")
    return {"release_s": release_s, "service_s": service_s, "id": source_id, "group": group}


def _validate_measured(measured: Any) -> dict[str, float]:
    if not isinstance(measured, dict):
        raise TraceFormatError("measured: must be an object")
    out = {}
    for key in ("sync_step_s", "thundersync_step_s"):
        if key in measured:
            out[key] = _number(measured[key], f"measured.{key}")
            if out[key] == 0.0:
                raise TraceFormatError(f"measured.{key}: must be positive, got 0")
    return out


def _validate_contention(contention: Any) -> dict[str, float]:
    if not isinstance(contention, dict):
        raise TraceFormatError("contention: must be an object")
    value = _number(contention.get("learner_slowdown", 1.0), "contention.learner_slowdown")
    if value == 0.0:
        raise TraceFormatError("contention.learner_slowdown: must be positive, got 0")
    return {"learner_slowdown": value}


def validate_trace(trace: Any) -> dict[str, Any]:
    """Return a normalised copy of the trace or raise TraceFormatError naming the field."""
    if not isinstance(trace, dict):
        raise TraceFormatError("trace: must be a JSON object")
    if "suffix_s" not in trace:
        raise TraceFormatError("suffix_s: missing")
    suffix_s = _number(trace["suffix_s"], "suffix_s")
    rollout_start_s = _number(trace.get("rollout_start_s", 0.0), "rollout_start_s")
    ranks = trace.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise TraceFormatError("ranks: must be a non-empty list")
    clean_ranks = []
    for r, rank in enumerate(ranks):
        if not isinstance(rank, dict) or not isinstance(rank.get("sources"), list):
            raise TraceFormatError(f"ranks[{r}].sources: must be a list")
        clean_ranks.append(
            [
                _validate_source(source, f"ranks[{r}].sources[{i}]", rollout_start_s)
                for i, source in enumerate(rank["sources"])
            ]
        )
    if not any(clean_ranks):
        raise TraceFormatError("ranks: no rank has any source")
    out: dict[str, Any] = {
        "suffix_s": suffix_s,
        "rollout_start_s": rollout_start_s,
        "ranks": clean_ranks,
    }
    if "measured" in trace:
        out["measured"] = _validate_measured(trace["measured"])
    out["contention"] = _validate_contention(trace.get("contention", {}))
    cap = trace.get("max_open_groups")
    if cap is not None:
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            raise TraceFormatError(f"max_open_groups: must be an integer >= 1, got {cap!r}")
        for r, sources in enumerate(clean_ranks):
            for i, source in enumerate(sources):
                if source["group"] is None:
                    raise TraceFormatError(
                        f"ranks[{r}].sources[{i}].group: missing (max_open_groups is set)"
                    )
    out["max_open_groups"] = cap
    return out


def _release_lag(sources: list[dict[str, Any]], start_s: float, rollout_s: float) -> float:
    """D = sup_t ((t - start)/R - F(t⁻)) over the rank's work-release curve F, in [0, 1]."""
    work_s = sum(s["service_s"] for s in sources)
    if work_s == 0.0 or rollout_s == 0.0:
        return 0.0
    released_s = 0.0
    lag = 0.0
    for source in sorted(sources, key=lambda s: s["release_s"]):
        uniform = (source["release_s"] - start_s) / rollout_s
        lag = max(lag, uniform - released_s / work_s)
        released_s += source["service_s"]
    return min(max(lag, 0.0), 1.0)


def _schedule_summary(step_s: float, tail_s: float, busy_s: float, ranks: int) -> dict:
    idle = 1.0 - busy_s / (ranks * step_s) if step_s > 0 else 0.0
    return {"step_s": step_s, "tail_s": tail_s, "learner_idle_fraction": idle}


def _analytic_check(clean: dict[str, Any], last_release_s: float) -> dict[str, Any]:
    start_s = clean["rollout_start_s"]
    rollout_s = last_release_s - start_s
    lower_s = upper_s = 0.0
    per_rank = []
    for sources in clean["ranks"]:
        work_s = sum(s["service_s"] for s in sources)
        rho = work_s / rollout_s if rollout_s > 0 else math.inf
        lag = _release_lag(sources, start_s, rollout_s)
        per_rank.append({"rho": rho, "release_lag": lag})
        if math.isinf(rho):
            lower_s = upper_s = max(upper_s, work_s)
            continue
        bounds = tail_bounds(rho, lag)
        lower_s = max(lower_s, bounds.lower_r * rollout_s)
        upper_s = max(upper_s, bounds.upper_r * rollout_s)
    return {"rollout_s": rollout_s, "ranks": per_rank, "tail_bounds_s": [lower_s, upper_s]}


def predict_from_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """Predicted sync and thundersync steps of one trace (and the error when measured)."""
    clean = validate_trace(trace)
    suffix_s = clean["suffix_s"]
    ranks = clean["ranks"]
    last_release_s = max(s["release_s"] for sources in ranks for s in sources)
    work_s = [sum(s["service_s"] for s in sources) for sources in ranks]
    busy_s = sum(work_s) + len(ranks) * suffix_s

    sync_step_s = last_release_s + max(work_s) + suffix_s
    # Thundersync: each rank's learner queue, served beside the rollout until the last release.
    queues = [_serve_rank(clean, sources, last_release_s) for sources in ranks]
    thundersync_step_s = max(last_release_s, *(q.last_finish_s for q in queues)) + suffix_s
    predicted = sync_step_s / thundersync_step_s if thundersync_step_s > 0 else math.nan
    out: dict[str, Any] = {
        "ranks": len(ranks),
        "sources": sum(len(sources) for sources in ranks),
        "last_release_s": last_release_s,
        "suffix_s": suffix_s,
        "sync": _schedule_summary(sync_step_s, max(work_s), busy_s, len(ranks)),
        "thundersync": _schedule_summary(
            thundersync_step_s,
            thundersync_step_s - suffix_s - last_release_s,
            sum(q.busy_s for q in queues) + len(ranks) * suffix_s,
            len(ranks),
        ),
        "predicted_speedup": predicted,
        "contention": clean["contention"],
        "analytic": _analytic_check(clean, last_release_s),
    }
    measured = clean.get("measured", {})
    if {"sync_step_s", "thundersync_step_s"} <= measured.keys():
        speedup = measured["sync_step_s"] / measured["thundersync_step_s"]
        out["measured"] = {
            **measured,
            "speedup": speedup,
            "speedup_relative_error": (predicted - speedup) / speedup,
            "sync_step_relative_error": (sync_step_s - measured["sync_step_s"])
            / measured["sync_step_s"],
            "thundersync_step_relative_error": (
                (thundersync_step_s - measured["thundersync_step_s"])
                / measured["thundersync_step_s"]
            ),
        }
    return out


def _serve_rank(
    clean: dict[str, Any], sources: list[dict[str, Any]], slow_until_s: float
) -> QueueResult:
    """One rank's queue: FIFO, or with the trace's open-group cap."""
    release_s = [s["release_s"] for s in sources]
    service_s = [s["service_s"] for s in sources]
    start_s = clean["rollout_start_s"]
    slowdown = clean["contention"]["learner_slowdown"]
    cap = clean["max_open_groups"]
    if cap is None:
        return fifo_finish(
            release_s, service_s, start_s, slowdown=slowdown, slow_until_s=slow_until_s
        )
    groups = [s["group"] for s in sources]
    try:
        return grouped_finish(
            release_s, service_s, groups, cap, start_s, slowdown=slowdown, slow_until_s=slow_until_s
        )
    except ValueError as exc:
        raise TraceFormatError(f"max_open_groups: {exc}") from exc


def load_trace(path: Path) -> dict[str, Any]:
    """Read a trace file; errors name the file."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{path}: not valid JSON ({exc})") from exc
    return data


def _traces_in(path: Path, data: Any) -> list[tuple[str, Any]]:
    """One trace file, or the sync release traces a bench (``sync_release_traces``) or a
    sweep (``benches``) report holds, each named ``FILE#step K`` or ``FILE#KEY=V/step K``."""
    if isinstance(data, dict) and isinstance(data.get("benches"), list):
        return [
            (f"{path}#{data.get('key')}={bench.get('value')}/step {k}", trace)
            for bench in data["benches"]
            for k, trace in enumerate(bench.get("sync_release_traces") or [])
        ]
    if isinstance(data, dict) and isinstance(data.get("sync_release_traces"), list):
        return [(f"{path}#step {k}", t) for k, t in enumerate(data["sync_release_traces"])]
    return [(str(path), data)]


def predict_files(paths: list[Path]) -> dict[str, Any]:
    """Predictions for several trace files and, with two or more measured, the mean error."""
    per_file = {}
    for path in paths:
        for name, trace in _traces_in(path, load_trace(path)):
            try:
                per_file[name] = predict_from_trace(trace)
            except TraceFormatError as exc:
                message = str(exc)
                prefix = "" if message.startswith(str(path)) else f"{name}: "
                raise TraceFormatError(prefix + message) from exc
    out: dict[str, Any] = {"files": per_file}
    errors = [p["measured"]["speedup_relative_error"] for p in per_file.values() if "measured" in p]
    if len(per_file) > 1:
        out["mean_speedup_relative_error"] = sum(errors) / len(errors) if errors else None
        out["mean_abs_speedup_relative_error"] = (
            sum(abs(e) for e in errors) / len(errors) if errors else None
        )
        out["measured_files"] = len(errors)
    return out
