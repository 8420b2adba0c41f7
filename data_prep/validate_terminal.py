"""Executable validation of Harbor terminal tasks: the verifier must tell work from no work.

A task is kept only if, each in a fresh sandbox prepared by ``TerminalTask.setup``:

1. doing nothing scores 0: the verifier cannot be passed by a no-op (a check that reads
   an input instead of an output, an expected value that equals the initial state);
2. the reference ``solution/solve.sh`` scores 1: the verifier accepts a correct answer
   (its expected values agree with what real tools produce) and the task is solvable
   with the tools the environment has.

The solution script is placed under the sandbox's private ``/tmp``, not in ``/app``, so it
cannot change what a check of ``/app`` sees. Grading is ``grade_terminal``: the pristine
``tests/`` at ``/tests``, the reward read from ``/logs/verifier`` after clearing it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Literal, get_args

from tqdm import tqdm

from data_prep.verdict import Verdict
from thundersync_core.rollout.grading import GradeResult
from thundersync_core.rollout.sandbox import SandboxLimits, open_sandbox
from thundersync_core.rollout.sandbox.base import ExecResult, SandboxError
from thundersync_core.rollout.tasks import TaskFormatError, TerminalTask, load_terminal_task

__all__ = ["main", "validate_many", "validate_task"]

Backend = Literal["local", "docker"]
_SOLUTION_PATH = "/tmp/thundersync-solution/solve.sh"
_TAIL_CHARS = 600


def validate_task(
    task_dir: Path, *, timeout_s: float = 120.0, backend: Backend = "local"
) -> Verdict:
    """Verdict on one task folder: ok iff the no-op scores 0 and the reference scores 1.

    ``timeout_s`` bounds the reference solution's run; the verifier runs under the task's
    ``[verifier] timeout_sec``. A malformed task folder gives a failed verdict naming the
    problem; a sandbox that cannot start raises (that is no fault of the task).
    """
    if backend not in get_args(Backend):
        raise ValueError(f"validate_task: backend must be one of {get_args(Backend)}")
    task_dir = Path(task_dir)
    try:
        task = load_terminal_task(task_dir)
        solution = (task_dir / "solution" / "solve.sh").read_text()
    except (TaskFormatError, FileNotFoundError, UnicodeDecodeError) as exc:
        return Verdict(task_dir.name, False, f"malformed task {task_dir}: {exc}")
    limits = SandboxLimits(timeout_s=timeout_s)
    try:
        noop = _run_and_grade(task, None, limits, backend)
        reference = _run_and_grade(task, solution, limits, backend)
    except ValueError as exc:
        return Verdict(task.task_id, False, f"malformed task {task_dir}: {exc}")
    details = {"noop": noop, "reference": reference}
    problems = []
    if noop["reward"] != 0.0:
        problems.append(
            f"the no-op scores {noop['reward']:g} (the verifier passes without any work)"
        )
    if reference["reward"] != 1.0:
        problems.append(
            f"the reference solution scores {reference['reward']:g} ({_why(reference)})"
        )
    if problems:
        return Verdict(task.task_id, False, f"task {task_dir}: " + "; ".join(problems), details)
    return Verdict(
        task.task_id, True, "no-op scores 0 and the reference solution scores 1", details
    )


def _run_and_grade(
    task: TerminalTask, solution: str | None, limits: SandboxLimits, backend: Backend
) -> dict[str, Any]:
    """Grade a fresh sandbox after running ``solution`` (None: nothing) in /app."""
    start = time.monotonic()
    with open_sandbox(backend, limits=limits) as sandbox:
        task.setup(sandbox)
        run: ExecResult | None = None
        if solution is not None:
            folder = _SOLUTION_PATH.rsplit("/", 1)[0]
            copy = sandbox.exec(f"mkdir -p {folder} && cat > {_SOLUTION_PATH}", stdin=solution)
            if copy.exit_code != 0:
                raise SandboxError(f"task {task.root}: could not copy solve.sh in: {copy.stderr}")
            run = sandbox.exec(["bash", _SOLUTION_PATH])
        grade = task.grade(sandbox)
    return _summary(grade, run, time.monotonic() - start)


def _summary(grade: GradeResult, run: ExecResult | None, wall_s: float) -> dict[str, Any]:
    verifier = grade.details.get("verifier", {})
    summary: dict[str, Any] = {
        "reward": grade.reward,
        "reason": grade.reason,
        "verifier_stdout": str(verifier.get("stdout", ""))[-_TAIL_CHARS:],
        "verifier_stderr": str(verifier.get("stderr", ""))[-_TAIL_CHARS:],
        "wall_s": round(wall_s, 3),
    }
    if run is not None:
        summary["solution"] = {
            "exit_code": run.exit_code,
            "timed_out": run.timed_out,
            "stderr": run.stderr[-_TAIL_CHARS:],
            "duration_s": round(run.duration_s, 3),
        }
    return summary


def _why(result: dict[str, Any]) -> str:
    """The first failed check the verifier printed, else the grader's reason."""
    failed = [line for line in result["verifier_stdout"].splitlines() if line.startswith("FAIL")]
    solution = result.get("solution", {})
    if solution.get("timed_out"):
        return "solve.sh timed out"
    prefix = f"solve.sh exit {solution['exit_code']}; " if solution.get("exit_code") else ""
    return prefix + (failed[0] if failed else str(result["reason"]))


def validate_many(
    task_dirs: Sequence[Path],
    *,
    workers: int = 2,
    timeout_s: float = 120.0,
    backend: Backend = "local",
    progress: bool = True,
) -> list[Verdict]:
    """``validate_task`` for each folder on ``workers`` threads; verdicts in input order.

    Threads suffice: each validation waits on sandboxed subprocesses, not on Python.
    """
    if workers < 1:
        raise ValueError(f"validate_many: workers must be >= 1, got {workers}")
    with (
        ThreadPoolExecutor(max_workers=workers) as pool,
        tqdm(total=len(task_dirs), desc="validate", unit="task", disable=not progress) as bar,
    ):
        futures = [
            pool.submit(validate_task, Path(d), timeout_s=timeout_s, backend=backend)
            for d in task_dirs
        ]
        for _done in as_completed(futures):
            bar.update()
        return [future.result() for future in futures]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep.validate_terminal",
        description="Validate Harbor task folders: no-op scores 0, reference scores 1.",
    )
    parser.add_argument("tasks", type=Path, help="a folder of task folders")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0, help="per solve.sh run, s")
    parser.add_argument("--backend", default="local", choices=["local", "docker"])
    args = parser.parse_args(argv)
    task_dirs = sorted(d for d in args.tasks.iterdir() if d.is_dir())
    start = time.monotonic()
    verdicts = validate_many(
        task_dirs, workers=args.workers, timeout_s=args.timeout, backend=args.backend
    )
    wall_s = time.monotonic() - start
    for verdict in verdicts:
        if not verdict.ok:
            print(f"FAILED {verdict.record_id}: {verdict.reason}", file=sys.stderr)
    passed = sum(v.ok for v in verdicts)
    print(json.dumps({"tasks": len(verdicts), "passed": passed, "wall_s": round(wall_s, 1)}))
    return 0 if passed == len(verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
