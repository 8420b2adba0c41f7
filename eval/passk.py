"""pass@k: the unbiased estimator over n attempts per task, averaged over tasks.

For one task with n attempts of which c succeeded, the chance that k attempts drawn
without replacement include at least one success is

    pass@k = 1 - C(n - c, k) / C(n, k)          (exactly 1 when n - c < k)

C(n - c, k) / C(n, k) is computed as the product prod_{i = n-c+1}^{n} (1 - k / i): each
factor lies in [0, 1], so no binomial is ever formed and large n neither overflows nor
loses precision to cancelling huge numbers. The score of a set of tasks is the plain mean
over tasks (every task weighs the same, whatever its n).

A task with fewer than k attempts is refused with its id: dropping it would bias the mean
toward the tasks that happened to finish. Results come as JSONL lines
``{"task_id": str, "attempt": int, "success": bool, ...}`` (extra fields are ignored);
a malformed line is refused naming its line number and field, a repeated
(task_id, attempt) naming both lines.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "AttemptResult",
    "ResultsFormatError",
    "load_results",
    "parse_ks",
    "parse_results",
    "pass_at_k",
    "pass_at_k_by_task",
    "pass_at_k_task",
    "score",
    "task_counts",
]


class ResultsFormatError(ValueError):
    """A results line is malformed; the message names the file, line and field."""


@dataclass(frozen=True)
class AttemptResult:
    task_id: str
    attempt: int
    success: bool


def pass_at_k_task(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with ``n`` attempts and ``c`` successes."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} attempts, got n={n}")
    if n - c < k:
        return 1.0
    all_fail = 1.0
    for i in range(n - c + 1, n + 1):
        all_fail *= 1.0 - k / i
    return 1.0 - all_fail


def task_counts(results: Iterable[AttemptResult]) -> dict[str, tuple[int, int]]:
    """task_id -> (attempts n, successes c), in first-seen order."""
    counts: dict[str, tuple[int, int]] = {}
    for result in results:
        n, c = counts.get(result.task_id, (0, 0))
        counts[result.task_id] = (n + 1, c + int(result.success))
    return counts


def _check_enough(counts: Mapping[str, tuple[int, int]], k: int) -> None:
    short = [(task, n) for task, (n, _) in counts.items() if n < k]
    if short:
        task, n = short[0]
        more = f" (and {len(short) - 1} more tasks)" if len(short) > 1 else ""
        raise ValueError(f"task {task!r} has {n} attempts, fewer than k={k}{more}")


def pass_at_k_by_task(counts: Mapping[str, tuple[int, int]], k: int) -> dict[str, float]:
    """task_id -> pass@k; refuses when any task has fewer than k attempts."""
    _check_enough(counts, k)
    return {task: pass_at_k_task(n, c, k) for task, (n, c) in counts.items()}


def pass_at_k(counts: Mapping[str, tuple[int, int]], k: int) -> float:
    """Mean pass@k over tasks, each task weighted equally."""
    if not counts:
        raise ValueError("pass@k of no tasks is undefined")
    per_task = pass_at_k_by_task(counts, k)
    return sum(per_task.values()) / len(per_task)


def score(results: Sequence[AttemptResult], ks: Sequence[int]) -> dict[str, Any]:
    """``{"pass@k": mean, ..., "n_tasks": int}`` for every k in ``ks``."""
    counts = task_counts(results)
    _check_enough(counts, max(ks, default=1))
    out: dict[str, Any] = {f"pass@{k}": pass_at_k(counts, k) for k in ks}
    out["n_tasks"] = len(counts)
    return out


def parse_ks(text: str) -> list[int]:
    """``"1,3,5"`` -> [1, 3, 5]; each k a positive integer, no repeats."""
    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--k {text!r}: expected comma-separated integers like 1,3,5") from None
    if not ks or any(k < 1 for k in ks) or len(set(ks)) != len(ks):
        raise ValueError(f"--k {text!r}: expected distinct positive integers like 1,3,5")
    return ks


def _field(record: Mapping[str, Any], name: str, kind: type, where: str) -> Any:
    if name not in record:
        raise ResultsFormatError(f"{where}: missing field {name!r}")
    value = record[name]
    # bool is an int in Python; an attempt number of True is a bug, not 1.
    wrong_bool = kind is int and isinstance(value, bool)
    if not isinstance(value, kind) or wrong_bool:
        raise ResultsFormatError(
            f"{where}: field {name!r} must be {kind.__name__}, got {type(value).__name__} "
            f"{value!r:.60}"
        )
    return value


def _parse_line(text: str, where: str) -> AttemptResult:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsFormatError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ResultsFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    task_id = _field(record, "task_id", str, where)
    if not task_id:
        raise ResultsFormatError(f"{where}: field 'task_id' is empty")
    return AttemptResult(
        task_id, _field(record, "attempt", int, where), _field(record, "success", bool, where)
    )


def parse_results(lines: Iterable[str], source: str = "<results>") -> list[AttemptResult]:
    """Parse JSONL lines; blank lines are skipped, line numbers count from 1."""
    results: list[AttemptResult] = []
    first_line: dict[tuple[str, int], int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        result = _parse_line(text, f"{source} line {number}")
        key = (result.task_id, result.attempt)
        if key in first_line:
            raise ResultsFormatError(
                f"{source} line {number}: duplicate (task_id, attempt) {key}, "
                f"first on line {first_line[key]}"
            )
        first_line[key] = number
        results.append(result)
    return results


def load_results(path: Path) -> list[AttemptResult]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--results {path}: no such file")
    with path.open(encoding="utf-8") as handle:
        return parse_results(handle, str(path))
