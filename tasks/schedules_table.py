"""The experiment's schedule table: per schedule, the step figures and the dev scores.

Read from each run folder (``metrics.jsonl``, ``summary.json``), so it can be rebuilt for
any finished experiment. Per schedule (runs of several seeds pooled):

- median step wall and its speedup over the baseline's (``sync``) median;
- median learner tail (learner work left after the last reward) and that as a share of the
  baseline's median tail: what overlap hid;
- the share of scored tokens sampled by an older policy than the one they trained
  (``staleness_tokens`` lag >= 1), and on how many steps new weights reached trajectories
  mid-flight (``inflight_swaps`` > 0);
- dev pass rate before and after training, with a 95% interval over tasks (samples of one
  task are not independent, so the standard error is over per-task rates) and the paired
  count of tasks that gained or lost solved samples against the run's own start;
- the learner the schedule ran (``learner_name``, from the run's resolved config) and on
  how many steps its mean reward equals the baseline's (a thundersync run from the same
  start with the same seeds samples exactly what sync samples while their updates agree).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from thundersync_core.config import TrainConfig

__all__ = [
    "dev_interval",
    "learner_name",
    "paired_counts",
    "schedule_rows",
    "schedules_markdown",
]


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _summary(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def learner_name(config: TrainConfig) -> str:
    """What the run's learner was, in the config's terms: ``batched`` (sync's padded
    whole-batch learner) or ``per-source``, with its packs and summation order."""
    return config.learner_label


def _learner(run_dir: Path) -> str | None:
    """The learner of the run's resolved config (None: no config, or one this version of
    the config no longer reads)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    try:
        return learner_name(TrainConfig.model_validate(yaml.safe_load(path.read_text()) or {}))
    except ValidationError:
        return None


def _same_rewards(
    records: Sequence[Mapping[str, Any]], baseline: Sequence[Mapping[str, Any]]
) -> int | None:
    """Steps whose mean reward equals the baseline's at the same step (None: no rewards)."""
    ours = {r["step"]: r["reward_mean"] for r in records if "reward_mean" in r}
    theirs = {r["step"]: r["reward_mean"] for r in baseline if "reward_mean" in r}
    common = set(ours) & set(theirs)
    return sum(ours[k] == theirs[k] for k in common) if common else None


def dev_interval(dev: Mapping[str, Any]) -> tuple[float, float] | None:
    """95% normal interval of the pass rate, its standard error over per-task rates."""
    solved, samples = dev.get("solved") or {}, int(dev.get("samples") or 0)
    if len(solved) < 2 or samples < 1:
        return None
    rates = [n / samples for n in solved.values()]
    mean = statistics.fmean(rates)
    half = 1.96 * statistics.stdev(rates) / math.sqrt(len(rates))
    return max(mean - half, 0.0), min(mean + half, 1.0)


def paired_counts(before: Mapping[str, Any], after: Mapping[str, Any]) -> tuple[int, int]:
    """Tasks with more solved samples after than before, and with fewer."""
    a, b = before.get("solved") or {}, after.get("solved") or {}
    common = set(a) & set(b)
    return sum(b[t] > a[t] for t in common), sum(b[t] < a[t] for t in common)


def _stale_share(records: Sequence[Mapping[str, Any]]) -> float | None:
    stale = total = 0
    for record in records:
        for lag, count in (record.get("staleness_tokens") or {}).items():
            total += count
            stale += count if int(lag) >= 1 else 0
    return stale / total if total else None


def schedule_rows(
    runs: Sequence[Mapping[str, Any]], baseline: str = "sync"
) -> list[dict[str, Any]]:
    """One row per schedule, in the order the runs came; ``runs`` hold ``schedule`` and
    ``run_dir``."""
    by_schedule: dict[str, list[Path]] = {}
    for run in runs:
        by_schedule.setdefault(run["schedule"], []).append(Path(run["run_dir"]))
    rows = []
    for schedule, dirs in by_schedule.items():
        records = [r for d in dirs for r in _records(d)]
        summaries = [_summary(d) for d in dirs]
        walls = [r["step_wall_s"] for r in records]
        tails = [r["learner_tail_s"] for r in records]
        befores = [s["dev_before"] for s in summaries if "dev_before" in s]
        afters = [s["dev_after"] for s in summaries if "dev_after" in s]
        pairs = [paired_counts(b, a) for b, a in zip(befores, afters, strict=False)]
        learners = sorted({name for d in dirs if (name := _learner(d))})
        rows.append(
            {
                "schedule": schedule,
                "runs": len(dirs),
                "learner": "; ".join(learners) or None,
                "steps": len(records),
                "median_step_wall_s": statistics.median(walls) if walls else None,
                "median_tail_s": statistics.median(tails) if tails else None,
                "stale_token_share": _stale_share(records),
                "inflight_swap_steps": sum(r.get("inflight_swaps", 0) > 0 for r in records),
                "inflight_swaps": sum(r.get("inflight_swaps", 0) for r in records),
                "dev_before": statistics.fmean(b["pass_rate"] for b in befores)
                if befores
                else None,
                "dev_after": statistics.fmean(a["pass_rate"] for a in afters) if afters else None,
                "dev_after_interval": dev_interval(afters[0]) if len(afters) == 1 else None,
                "dev_tasks": afters[0].get("tasks") if afters else None,
                "dev_samples": afters[0].get("samples") if afters else None,
                "tasks_gained": sum(p[0] for p in pairs) if pairs else None,
                "tasks_lost": sum(p[1] for p in pairs) if pairs else None,
            }
        )
    base = next((r for r in rows if r["schedule"] == baseline), None)
    base_records = (
        [r for d in by_schedule[baseline] for r in _records(d)] if base is not None else []
    )
    for row in rows:
        if len(by_schedule[row["schedule"]]) == 1 and base and base["runs"] == 1:
            row["same_rewards_steps"] = _same_rewards(
                _records(by_schedule[row["schedule"]][0]), base_records
            )
        else:
            row["same_rewards_steps"] = None  # several seeds: steps do not pair up
        row["speedup"] = _ratio(base and base["median_step_wall_s"], row["median_step_wall_s"])
        row["tail_share_of_baseline"] = _ratio(row["median_tail_s"], base and base["median_tail_s"])
    return rows


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _steps_cell(count: int | None, row: Mapping[str, Any]) -> str:
    return "-" if count is None else f"{count}/{row['steps']}"


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def schedules_markdown(rows: Sequence[Mapping[str, Any]], baseline: str = "sync") -> str:
    lines = [
        f"| schedule | steps | median step s | speedup vs {baseline} | median tail s | "
        f"tail / {baseline}'s | stale tokens | steps with in-flight swaps | dev before | "
        f"dev after (95% CI) | tasks +/- | learner | steps with {baseline}'s reward |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        interval = row["dev_after_interval"]
        after = _cell(row["dev_after"], ".1%")
        if interval is not None:
            after += f" ({interval[0]:.1%}-{interval[1]:.1%})"
        gained, lost = row["tasks_gained"], row["tasks_lost"]
        lines.append(
            f"| {row['schedule']} | {row['steps']} | {_cell(row['median_step_wall_s'], '.2f')} | "
            f"{_cell(row['speedup'], '.2f')}x | {_cell(row['median_tail_s'], '.2f')} | "
            f"{_cell(row['tail_share_of_baseline'], '.0%')} | "
            f"{_cell(row['stale_token_share'], '.0%')} | "
            f"{row['inflight_swap_steps']}/{row['steps']} | {_cell(row['dev_before'], '.1%')} | "
            f"{after} | {'-' if gained is None else f'+{gained}/-{lost}'} | "
            f"{row.get('learner') or '-'} | {_steps_cell(row.get('same_rewards_steps'), row)} |"
        )
    first = next((r for r in rows if r["dev_tasks"]), None)
    if first is not None:
        lines += [
            "",
            f"Dev: {first['dev_tasks']} tasks x {first['dev_samples']} samples; the interval "
            "is over per-task pass rates; tasks +/- counts tasks with more/fewer solved "
            "samples than before training (same sampling seeds).",
        ]
    return "\n".join(lines) + "\n"
