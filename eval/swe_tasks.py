"""SWE-smith-schema instances as agent tasks: a bugged repository to fix in the sandbox.

``SWETask`` satisfies the agent's ``AgentTask`` protocol. ``setup`` copies the clean
repository snapshot into the sandbox, applies the record's bug-introducing ``patch``
(``patch -p1``, or ``git apply`` where patch is missing) and takes the baseline snapshot
the grader compares against; ``grade`` runs the rollout grader ``grade_swe`` (pristine test
files, harness restored, JUnit outcomes, reward 1 iff every FAIL_TO_PASS and PASS_TO_PASS
test passes). One task object serves all k attempts: each sandbox's baseline is kept under
that sandbox until it is graded.

Snapshots are found as the prep stage stores them, ``REPOS/<repo>/<base_commit>``
(``data_prep.validate_swe.repo_snapshot_lookup``); records come from the prep stage's
``swe/{train,dev}.parquet``.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from data_prep.validate_swe import RecordError, parse_test_ids, repo_snapshot_lookup
from thundersync_core.rollout.grading import (
    GradeResult,
    WorkdirSnapshot,
    grade_swe,
    snapshot_workdir,
)
from thundersync_core.rollout.sandbox.base import Sandbox, SandboxError

__all__ = ["SWETask", "load_swe_tasks", "swe_task_from_record"]

_PATCH_TIMEOUT_S = 60.0
INSTRUCTION_FOOTER = (
    "The repository is in the current folder. Fix the bug in the source code so that the "
    "tests pass; do not edit the tests."
)


def _patch_argv() -> list[str]:
    if shutil.which("patch"):
        return ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-r", "-"]
    if shutil.which("git"):
        return ["git", "apply", "-p1", "-"]
    raise RuntimeError("SWE tasks need 'patch' or 'git' on PATH to apply the bug patch")


@dataclass
class SWETask:
    """One instance: its record's fields and the host folder of its clean snapshot."""

    task_id: str
    instruction: str
    repo_dir: Path
    bug_patch: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    test_files: dict[str, bytes]
    grade_timeout_s: float = 120.0
    _baselines: dict[int, WorkdirSnapshot] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def setup(self, sandbox: Sandbox) -> None:
        sandbox.copy_in(self.repo_dir, ".")
        run = sandbox.exec(_patch_argv(), stdin=self.bug_patch, timeout_s=_PATCH_TIMEOUT_S)
        if run.exit_code != 0:
            output = (run.stdout + run.stderr).strip().splitlines()
            last = output[-1] if output else f"exit {run.exit_code}"
            raise SandboxError(f"task {self.task_id}: the bug patch does not apply: {last}")
        baseline = snapshot_workdir(sandbox)
        with self._lock:
            self._baselines[id(sandbox)] = baseline

    def grade(self, sandbox: Sandbox) -> GradeResult:
        with self._lock:
            baseline = self._baselines.pop(id(sandbox), None)
        if baseline is None:
            raise RuntimeError(f"task {self.task_id}: grade() on a sandbox it did not set up")
        return grade_swe(
            sandbox,
            baseline=baseline,
            fail_to_pass=self.fail_to_pass,
            pass_to_pass=self.pass_to_pass,
            test_files=self.test_files,
            timeout_s=self.grade_timeout_s,
        )


def _test_files(repo_dir: Path, test_ids: Sequence[str], task_id: str) -> dict[str, bytes]:
    files = sorted({test.split("::", 1)[0] for test in test_ids})
    for path in files:
        parts = PurePosixPath(path).parts
        if PurePosixPath(path).is_absolute() or ".." in parts:
            raise ValueError(f"record {task_id}: test file {path} is outside the repository")
        if not (repo_dir / path).is_file():
            raise ValueError(f"record {task_id}: test file {path} is not in {repo_dir}")
    return {path: (repo_dir / path).read_bytes() for path in files}


def swe_task_from_record(
    record: Mapping[str, Any], repos_root: Path, *, grade_timeout_s: float = 120.0
) -> SWETask:
    """An ``SWETask`` for one record whose snapshot lies under ``repos_root``."""
    task_id = str(record.get("instance_id") or "")
    if not task_id:
        raise ValueError("SWE record without an instance_id")
    repo_dir = repo_snapshot_lookup(Path(repos_root))(record)
    if repo_dir is None:
        raise FileNotFoundError(
            f"record {task_id}: no snapshot at {repos_root}/{record.get('repo')}/"
            f"{record.get('base_commit')}"
        )
    patch = record.get("patch")
    if not isinstance(patch, str) or not patch.strip():
        raise ValueError(f"record {task_id}: field 'patch' is missing or empty")
    try:
        fail_to_pass = parse_test_ids(record.get("FAIL_TO_PASS"), "FAIL_TO_PASS")
        pass_to_pass = parse_test_ids(record.get("PASS_TO_PASS", []), "PASS_TO_PASS")
    except RecordError as exc:
        raise ValueError(f"record {task_id}: {exc}") from None
    if not fail_to_pass:
        raise ValueError(f"record {task_id}: FAIL_TO_PASS is empty")
    statement = str(record.get("problem_statement") or "").strip()
    return SWETask(
        task_id=task_id,
        instruction=f"{statement}\n\n{INSTRUCTION_FOOTER}".strip(),
        repo_dir=repo_dir,
        bug_patch=patch,
        fail_to_pass=fail_to_pass,
        pass_to_pass=pass_to_pass,
        test_files=_test_files(repo_dir, [*fail_to_pass, *pass_to_pass], task_id),
        grade_timeout_s=grade_timeout_s,
    )


def load_swe_tasks(
    parquet: Path, repos_root: Path | None = None, *, grade_timeout_s: float = 120.0
) -> list[SWETask]:
    """Tasks for every record of a prep-stage parquet file, sorted by instance id.

    ``repos_root`` defaults to the prep layout: ``<prep>/repos`` for ``<prep>/swe/x.parquet``.
    """
    import pyarrow.parquet as pq  # noqa: PLC0415 - only when a parquet pool is evaluated

    parquet = Path(parquet)
    if not parquet.is_file():
        raise FileNotFoundError(f"--swe {parquet}: no such file")
    root = Path(repos_root) if repos_root is not None else parquet.parent.parent / "repos"
    records = pq.read_table(parquet).to_pylist()
    tasks = [swe_task_from_record(r, root, grade_timeout_s=grade_timeout_s) for r in records]
    return sorted(tasks, key=lambda task: task.task_id)
