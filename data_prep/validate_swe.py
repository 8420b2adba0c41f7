"""Executable validation of SWE-smith-schema records against a local repository snapshot.

A record is kept only if running it shows what its fields claim. In one local sandbox
holding the clean snapshot:

1. the bug-introducing ``patch`` is applied (``patch -p1``, or ``git apply`` where patch is
   missing) and the rollout grader (``grade_swe``) runs the tests: every FAIL_TO_PASS test
   must fail and every PASS_TO_PASS test must pass;
2. the patch is reverted and the grader runs again: everything must pass, which is exactly
   the reward a perfect fix earns at training time.

Running the production grader rather than a second pytest runner means a validated record
is one the grader can score: same pytest flags, pristine test files, JUnit outcomes only.
The patch may not edit a test file, since the grader restores test files before running.
A pytest run that times out rejects the record: it says nothing about PASS_TO_PASS, and the
grader would spend its whole timeout on every rollout of that instance.
FAIL_TO_PASS and PASS_TO_PASS may be lists or JSON strings of lists (both occur in
published SWE-smith dumps). A verdict's reason is one sentence naming the first offending
test, and its details hold every test's outcome on both trees.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from tqdm import tqdm

from data_prep.schema import test_list
from data_prep.verdict import Verdict
from thundersync_core.rollout.grading import (
    GradeResult,
    WorkdirSnapshot,
    grade_swe,
    junit_key,
    snapshot_workdir,
)
from thundersync_core.rollout.sandbox import Sandbox, SandboxError, SandboxLimits, open_sandbox

__all__ = [
    "RecordError",
    "parse_test_ids",
    "repo_snapshot_lookup",
    "validate_many",
    "validate_record",
]

_DIFF_PATHS = re.compile(r"^(?:---|\+\+\+) (?:a|b)/(.+?)\s*$", re.MULTILINE)
_TOOL_TIMEOUT_S = 60.0

RepoLookup = Callable[[Mapping[str, Any]], Path | None]


class RecordError(ValueError):
    """A record field is missing or malformed; the message starts with the field's name."""


def parse_test_ids(value: object, field: str) -> list[str]:
    """A list of pytest node ids from a list or a JSON string of one."""
    try:
        value = test_list(value)
    except ValueError as exc:
        raise RecordError(f"{field}: {exc}") from None
    for item in value:
        try:
            junit_key(item)
        except ValueError as exc:
            raise RecordError(f"{field}: {exc}") from exc
    return list(value)


def _fields(record: Mapping[str, Any]) -> tuple[str, list[str], list[str]]:
    patch = record.get("patch")
    if not isinstance(patch, str) or not patch.strip():
        raise RecordError("patch: missing or empty")
    fail_to_pass = parse_test_ids(record.get("FAIL_TO_PASS"), "FAIL_TO_PASS")
    pass_to_pass = parse_test_ids(record.get("PASS_TO_PASS", []), "PASS_TO_PASS")
    if not fail_to_pass:
        raise RecordError("FAIL_TO_PASS: empty; an instance needs at least one failing test")
    both = sorted(set(fail_to_pass) & set(pass_to_pass))
    if both:
        raise RecordError(f"PASS_TO_PASS: {both[0]} is also listed in FAIL_TO_PASS")
    return patch, fail_to_pass, pass_to_pass


def _test_files(repo_dir: Path, patch: str, tests: Sequence[str]) -> dict[str, bytes]:
    """Pristine bytes of every test file the ids name; refuses patches that edit them."""
    files = sorted({test.split("::", 1)[0] for test in tests})
    edited = set(_DIFF_PATHS.findall(patch))
    for path in files:
        if path in edited:
            raise RecordError(f"patch: edits the test file {path}")
        if PurePosixPath(path).is_absolute() or ".." in PurePosixPath(path).parts:
            raise RecordError(f"test file {path} is not a relative path inside the repository")
        if not (repo_dir / path).is_file():
            raise RecordError(f"test file {path} is not in the snapshot {repo_dir}")
    return {path: (repo_dir / path).read_bytes() for path in files}


def _patch_argv(reverse: bool) -> list[str]:
    if shutil.which("patch"):
        direction = ["-R"] if reverse else ["--forward"]
        return ["patch", "-p1", *direction, "--batch", "--no-backup-if-mismatch", "-r", "-"]
    if shutil.which("git"):
        return ["git", "apply", "-p1", *(["-R"] if reverse else []), "-"]
    raise RuntimeError("validating SWE records needs 'patch' or 'git' on PATH")


def _apply(sandbox: Sandbox, patch: str, *, reverse: bool) -> str | None:
    """None when the patch applied, else why not."""
    run = sandbox.exec(_patch_argv(reverse), stdin=patch, timeout_s=_TOOL_TIMEOUT_S)
    if run.exit_code == 0:
        return None
    output = (run.stdout + run.stderr).strip().splitlines()
    return output[-1] if output else f"exit {run.exit_code}"


def _shown(outcome: str) -> str:
    return "not in pytest's report" if outcome == "missing" else outcome


def _first_problem(
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    bugged: Mapping[str, str],
    clean: Mapping[str, str],
) -> str | None:
    for test in fail_to_pass:
        if bugged[test] == "passed":
            return f"FAIL_TO_PASS test {test} passes with the patch applied; it must fail"
    for test in pass_to_pass:
        if bugged[test] != "passed":
            return f"PASS_TO_PASS test {test} fails with the patch applied ({_shown(bugged[test])})"
    for test in fail_to_pass:
        if clean[test] != "passed":
            return (
                f"FAIL_TO_PASS test {test} does not pass on the clean tree ({_shown(clean[test])})"
            )
    for test in pass_to_pass:
        if clean[test] != "passed":
            return (
                f"PASS_TO_PASS test {test} does not pass on the clean tree ({_shown(clean[test])})"
            )
    return None


def _grade(
    sandbox: Sandbox,
    baseline: WorkdirSnapshot,
    tests: tuple[list[str], list[str]],
    test_files: Mapping[str, bytes],
    timeout_s: float,
) -> tuple[dict[str, str] | None, GradeResult]:
    """Each listed test's outcome, or None when pytest timed out or never reported.

    A test missing from a report counts as failed, as the grader counts it: a patch that
    breaks the package's import fails every test through collection errors.
    """
    grade = grade_swe(
        sandbox,
        baseline=baseline,
        fail_to_pass=tests[0],
        pass_to_pass=tests[1],
        test_files=test_files,
        timeout_s=timeout_s,
    )
    if "fail_to_pass" not in grade.details or grade.details["pytest"]["timed_out"]:
        return None, grade
    return {**grade.details["fail_to_pass"], **grade.details["pass_to_pass"]}, grade


def _unusable(grade: GradeResult, timeout_s: float) -> str:
    if grade.details.get("pytest", {}).get("timed_out"):
        return f"pytest timed out after {timeout_s:g} s"
    return grade.reason


def _run_both_trees(
    sandbox: Sandbox,
    patch: str,
    tests: tuple[list[str], list[str]],
    test_files: Mapping[str, bytes],
    timeout_s: float,
) -> tuple[str | None, dict[str, Any]]:
    """(problem or None, details) after grading the bugged, then the clean tree."""
    clean_snapshot = snapshot_workdir(sandbox)
    failure = _apply(sandbox, patch, reverse=False)
    if failure is not None:
        return f"the patch does not apply to the snapshot: {failure}", {}
    bugged_outcomes, bugged = _grade(sandbox, clean_snapshot, tests, test_files, timeout_s)
    if bugged_outcomes is None:
        return f"with the patch applied, {_unusable(bugged, timeout_s)}", {"bugged": bugged.details}
    bugged_snapshot = snapshot_workdir(sandbox)
    failure = _apply(sandbox, patch, reverse=True)
    if failure is not None:
        return f"the patch does not revert cleanly: {failure}", {"bugged": bugged_outcomes}
    clean_outcomes, clean = _grade(sandbox, bugged_snapshot, tests, test_files, timeout_s)
    if clean_outcomes is None:
        details = {"bugged": bugged_outcomes, "clean": clean.details}
        return f"on the clean tree, {_unusable(clean, timeout_s)}", details
    details = {"bugged": bugged_outcomes, "clean": clean_outcomes}
    return _first_problem(*tests, bugged_outcomes, clean_outcomes), details


def validate_record(
    record: Mapping[str, Any], repo_dir: Path, *, timeout_s: float = 300.0
) -> Verdict:
    """Verdict on one record whose clean repository snapshot is the folder ``repo_dir``."""
    record_id = str(record.get("instance_id") or "<record without instance_id>")
    try:
        patch, fail_to_pass, pass_to_pass = _fields(record)
        test_files = _test_files(Path(repo_dir), patch, [*fail_to_pass, *pass_to_pass])
    except RecordError as exc:
        return Verdict(record_id, False, str(exc))
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=2048, cpu_s=int(timeout_s) + 1)
    try:
        with open_sandbox("local", limits=limits, workdir_from=Path(repo_dir)) as sandbox:
            tests = (fail_to_pass, pass_to_pass)
            problem, details = _run_both_trees(sandbox, patch, tests, test_files, timeout_s)
    except SandboxError as exc:
        return Verdict(record_id, False, f"the sandbox failed: {exc}")
    if problem is not None:
        return Verdict(record_id, False, problem, details)
    reason = (
        f"{len(fail_to_pass)} FAIL_TO_PASS fail with the patch and pass without it; "
        f"{len(pass_to_pass)} PASS_TO_PASS pass on both trees"
    )
    return Verdict(record_id, True, reason, details)


def repo_snapshot_lookup(repos_root: Path) -> RepoLookup:
    """Records -> ``repos_root/<repo>/<base_commit>`` when that folder exists, else None."""

    def lookup(record: Mapping[str, Any]) -> Path | None:
        repo, base_commit = record.get("repo"), record.get("base_commit")
        if not isinstance(repo, str) or not isinstance(base_commit, str):
            return None
        if ".." in PurePosixPath(repo).parts or "/" in base_commit or base_commit in ("", ".."):
            return None
        path = Path(repos_root) / repo / base_commit
        return path if path.is_dir() else None

    return lookup


def _unavailable(record: Mapping[str, Any], record_id: str, path: Path | None) -> Verdict:
    where = f"{record.get('repo')}@{record.get('base_commit')}"
    shown = where if path is None else f"{where} ({path} is not a folder)"
    return Verdict(record_id, False, f"repository snapshot unavailable: {shown}")


def validate_many(
    records: Sequence[Mapping[str, Any]],
    repo_dir_for: RepoLookup,
    *,
    workers: int = 2,
    timeout_s: float = 300.0,
    progress: bool = True,
) -> list[Verdict]:
    """One verdict per record, in input order; records run in parallel sandboxes."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")

    def one(index: int) -> Verdict:
        record = records[index]
        record_id = str(record.get("instance_id") or f"<record {index}>")
        path = repo_dir_for(record)
        if path is None or not Path(path).is_dir():
            return _unavailable(record, record_id, path)
        verdict = validate_record(record, Path(path), timeout_s=timeout_s)
        return Verdict(record_id, verdict.ok, verdict.reason, verdict.details)

    with (
        ThreadPoolExecutor(max_workers=workers, thread_name_prefix="validate-swe") as pool,
        tqdm(total=len(records), desc="validate", unit="record", disable=not progress) as bar,
    ):
        futures = [pool.submit(one, index) for index in range(len(records))]
        for future in futures:
            future.add_done_callback(lambda _done: bar.update(1))
        return [future.result() for future in futures]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep.validate_swe", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--records", type=Path, required=True, help="JSONL of SWE-smith records")
    parser.add_argument("--repos", type=Path, required=True, help="snapshots at <repo>/<commit>")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per pytest run")
    args = parser.parse_args(argv)
    lines = args.records.read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    started = time.monotonic()
    verdicts = validate_many(
        records, repo_snapshot_lookup(args.repos), workers=args.workers, timeout_s=args.timeout
    )
    rejected = {verdict.record_id: verdict.reason for verdict in verdicts if not verdict.ok}
    summary = {
        "records": len(verdicts),
        "ok": len(verdicts) - len(rejected),
        "seconds": round(time.monotonic() - started, 1),
        "rejected": rejected,
    }
    print(json.dumps(summary, indent=2))
    return 0 if not rejected else 1


if __name__ == "__main__":
    sys.exit(main())
