"""Rewards from a trajectory's sandbox: SWE-style pytest grading and Harbor verifiers.

The policy is an optimizer: whatever the agent could touch is treated as hostile, and a
reward comes only from a run that nothing of the agent's outlives or precedes. Both
graders first call ``Sandbox.begin_verification``: no process the agent started is alive
afterwards, and /tmp (the agent's $HOME, hence any user site-packages) and /logs are
empty. On Docker, SWE grading moves the workdir into a fresh container from the image,
which also drops what the agent, root in its container, did to the image's interpreter.

``grade_swe`` (a repository with a bug, FAIL_TO_PASS and PASS_TO_PASS pytest node ids):
  1. rewrites the pristine test files (re-creating deleted ones) and puts the test
     harness back as it was before the agent ran: every ``conftest.py``, pytest/tox/
     setup.cfg/pyproject configuration (``pytest.ini``, ``pytest.toml`` and their dotted
     forms), ``sitecustomize.py``/``usercustomize.py`` and the ``__init__.py`` of test
     folders (any of them can run code or rewrite outcomes); new ones are deleted;
  2. refuses an empty diff: if no file outside the tests and harness differs from the
     snapshot taken before the agent ran (``snapshot_workdir``), the reward is 0;
  3. runs pytest from the sandbox's pinned interpreter (``Sandbox.python``) with the user
     site off, loading pytest, its built-in plugins and the JUnit writer before the
     working folder enters ``sys.path`` (so a ``pytest.py``, ``_pytest/`` or ``xml/`` in
     the repository cannot stand in for them), ``addopts`` and plugin autoloading off,
     and ``--junitxml`` into a fresh folder under /logs that did not exist while the
     agent ran. Each node id's outcome is read from that XML; console text is never
     parsed. Reward 1 iff every FAIL_TO_PASS and PASS_TO_PASS test passed; a test missing
     from the report, skipped or errored counts as failed.

``grade_terminal`` (a Harbor-format task folder): with ``[verifier] workdir_only = true``
in task.toml (the checks look at /app alone) the verifier gets a fresh environment that
carries only the workdir, as SWE grading does; otherwise the rest of the filesystem stays
(the checks may look at installed packages, say), so on Docker a verifier there runs on
what the agent, root in its container, left of the image. It installs the task's pristine ``tests/``
at ``/tests`` (read-only inside the local sandbox), runs ``bash /tests/test.sh`` with the
task's verifier timeout, Python's user site off and the working folder kept out of
``sys.path`` (``PYTHONSAFEPATH``), and reads ``/logs/verifier/reward.txt`` (a float) or
``reward.json`` (``{"reward": x}``). Missing, garbled or non-finite rewards, a verifier
that timed out or died of a signal (something it ran killed it, say) give 0 with the
reason.

What no in-sandbox grader can stop: code under test runs inside the test process (and a
terminal task's checks may run the agent's programs), so it could patch the runner or
write the report itself. Such code lies in the agent's diff, where audits see it.
"""

from __future__ import annotations

import inspect
import json
import math
import tomllib
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from xml.etree import ElementTree

from thundersync_core.rollout.sandbox.base import (
    LOGS_DIR,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxPathError,
)

__all__ = [
    "HARNESS_FILE_NAMES",
    "PYTEST_BOOTSTRAP",
    "PYTEST_ENV",
    "GradeResult",
    "GraderError",
    "WorkdirSnapshot",
    "grade_swe",
    "grade_terminal",
    "junit_key",
    "parse_junit",
    "pytest_argv",
    "snapshot_workdir",
]

# Files through which a repository configures or extends pytest and Python start-up.
HARNESS_FILE_NAMES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "pytest.toml",
        ".pytest.toml",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "sitecustomize.py",
        "usercustomize.py",
    }
)
# An ``__init__.py`` below one of these is imported by collection before any test runs.
_TEST_DIR_NAMES = frozenset({"tests", "test", "testing"})
_SKIPPED_DIRS = (".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".tox")
# Grader scratch folders live under /logs, which begin_verification empties.
_GRADER_DIR_PREFIX = "grader-"
# pytest as ``python -m pytest`` runs it, except that pytest, its built-in plugins and the
# JUnit writer are imported before the working folder is put on sys.path: a module of the
# repository can then not stand in for them. The user site is off (``-s``); no ``-I``,
# which older interpreters of SWE images lack and which would drop PYTHONHASHSEED.
PYTEST_BOOTSTRAP = """\
import importlib, os, sys
sys.path[:] = [p for p in sys.path if p not in ('', '.', os.getcwd())]
import pytest
from _pytest.config import default_plugins
for name in default_plugins:
    importlib.import_module('_pytest.' + name)
sys.path.insert(0, os.getcwd())
sys.exit(pytest.main(sys.argv[1:]))
"""
PYTEST_ENV = {
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
}
_SNAPSHOT_TIMEOUT_S = 120.0
_DEFAULT_VERIFIER_TIMEOUT_S = 600.0
# Python in a verifier: no user site-packages, no working folder on sys.path.
_VERIFIER_ENV = {"PYTHONNOUSERSITE": "1", "PYTHONSAFEPATH": "1"}
# Shells report death by signal N as exit status 128 + N.
_SIGNAL_STATUS = 128
_OUTCOME_ORDER = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
_SHOWN_IDS = 5


class GraderError(RuntimeError):
    """A grader failed for a reason of its own, not the agent's: no reward can be given.

    Rolling out stops naming the task and trajectory; a 0 here would teach the policy
    that a correct answer was wrong.
    """


@dataclass(frozen=True)
class GradeResult:
    reward: float
    reason: str
    details: dict[str, Any] = field(default_factory=dict)


# -- workdir snapshots ----------------------------------------------------------------------


@dataclass(frozen=True)
class WorkdirSnapshot:
    """A workdir's content before the agent ran: per-file digests and the harness files."""

    digests: Mapping[str, str]
    harness: Mapping[str, bytes]


def _tree_digests(root: str, skipped_dirs: Sequence[str]) -> dict[str, str]:
    """Relative path -> sha256 of every file below ``root`` (symlinks by their target).

    Runs inside the sandbox as standalone source, hence the local imports.
    """
    import hashlib  # noqa: PLC0415
    import os  # noqa: PLC0415
    import stat  # noqa: PLC0415

    digests = {}
    for folder, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skipped_dirs]
        for name in dirnames + filenames:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                digests[rel] = "symlink:" + os.readlink(path)
            elif stat.S_ISREG(mode) and not name.endswith(".pyc"):
                digest = hashlib.sha256()
                with open(path, "rb") as handle:
                    for chunk in iter(lambda: handle.read(1 << 20), b""):
                        digest.update(chunk)
                digests[rel] = digest.hexdigest()
    return digests


def workdir_digests(sandbox: Sandbox, *, python: str | None = None) -> dict[str, str]:
    """``_tree_digests`` of the workdir, computed in the sandbox and read back as a file.

    ``-I -S``: the interpreter ignores the environment, the working folder and
    site-packages, so files the agent placed cannot run in it.
    """
    folder = _grader_folder()
    script = (
        "from __future__ import annotations\n"
        + inspect.getsource(_tree_digests)
        + "\nimport json, os, sys\nos.makedirs(sys.argv[1], exist_ok=True)\n"
        + "with open(os.path.join(sys.argv[1], 'digests.json'), 'w') as out:\n"
        + f"    json.dump(_tree_digests('.', {_SKIPPED_DIRS!r}), out)\n"
    )
    run = sandbox.exec(
        [python or sandbox.python, "-I", "-S", "-c", script, f"{LOGS_DIR}/{folder}"],
        timeout_s=_SNAPSHOT_TIMEOUT_S,
    )
    try:
        if run.exit_code != 0:
            raise SandboxError(f"hashing the workdir failed: {_describe(run)}")
        digests = json.loads(sandbox.read_log(f"{folder}/digests.json"))
    finally:
        _remove_grader_folder(sandbox, folder)
    if not isinstance(digests, dict):
        raise SandboxError(f"workdir digests are not an object: {type(digests).__name__}")
    return digests


def _grader_folder() -> str:
    """A fresh name under /logs for one grader step's files."""
    return _GRADER_DIR_PREFIX + uuid.uuid4().hex


def _remove_grader_folder(sandbox: Sandbox, folder: str) -> None:
    sandbox.exec(["rm", "-rf", "--", f"{LOGS_DIR}/{folder}"], timeout_s=_SNAPSHOT_TIMEOUT_S)


def snapshot_workdir(sandbox: Sandbox, *, python: str | None = None) -> WorkdirSnapshot:
    """Take this before the agent runs; ``grade_swe`` compares and restores against it."""
    digests = workdir_digests(sandbox, python=python)
    harness = {
        path: sandbox.read_file(path)
        for path, digest in digests.items()
        if _is_harness(path) and not digest.startswith("symlink:")
    }
    return WorkdirSnapshot(digests=digests, harness=harness)


def _is_harness(relpath: str) -> bool:
    path = PurePosixPath(relpath)
    if path.name == "__init__.py":
        return any(part in _TEST_DIR_NAMES for part in path.parts[:-1])
    return path.name in HARNESS_FILE_NAMES


# -- SWE-style grading ------------------------------------------------------------------------


def junit_key(node_id: str) -> tuple[str, str]:
    """The (classname, name) pytest writes to JUnit XML for a node id.

    ``tests/test_x.py::TestK::test_y[a::b]`` -> (``tests.test_x.TestK``, ``test_y[a::b]``).
    Parameters may contain ``::``, so they are split off first.
    """
    address, bracket, params = node_id.partition("[")
    names = address.split("::")
    if len(names) < 2 or not names[0].endswith(".py"):
        raise ValueError(f"test id {node_id!r} is not a pytest node id 'path/to/file.py::name'")
    module = names[0].removesuffix(".py").replace("/", ".")
    return ".".join([module, *names[1:-1]]), names[-1] + bracket + params


def parse_junit(xml_bytes: bytes) -> dict[tuple[str, str], str]:
    """(classname, name) -> passed / skipped / failed / error; the worst entry of a test wins.

    A test can appear twice (an error in teardown after a passing call), hence "worst".
    """
    outcomes: dict[tuple[str, str], str] = {}
    for case in ElementTree.fromstring(xml_bytes).iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        tags = {child.tag for child in case}
        outcome = next((t for t in ("error", "failure", "skipped") if t in tags), "passed")
        outcome = "failed" if outcome == "failure" else outcome
        if _OUTCOME_ORDER[outcome] >= _OUTCOME_ORDER.get(outcomes.get(key, "passed"), 0):
            outcomes[key] = outcome
    return outcomes


def grade_swe(
    sandbox: Sandbox,
    *,
    baseline: WorkdirSnapshot,
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    test_files: Mapping[str, bytes],
    timeout_s: float = 600.0,
    python: str | None = None,
    pytest_args: Sequence[str] = (),
) -> GradeResult:
    """Reward 1.0 iff the agent's change makes FAIL_TO_PASS pass without breaking PASS_TO_PASS.

    ``test_files`` maps workdir-relative paths to their pristine bytes; ``baseline`` is
    ``snapshot_workdir`` from before the agent ran. ``python`` defaults to the sandbox's
    pinned interpreter. ``pytest_args`` can re-enable plugins a repository needs
    (``-p name``): autoloading is off because the agent could install one. Ends the
    agent's phase of ``sandbox`` (``begin_verification``).
    """
    if not fail_to_pass:
        raise ValueError("grade_swe: fail_to_pass is empty; the task needs a failing test")
    test_ids = [*fail_to_pass, *pass_to_pass]
    keys = {test_id: junit_key(test_id) for test_id in test_ids}
    python = python or sandbox.python
    sandbox.begin_verification(fresh=True)
    try:
        for path, content in test_files.items():
            sandbox.write_file(path, content)
    except (SandboxError, IsADirectoryError) as exc:
        return GradeResult(0.0, f"could not restore the pristine tests: {exc}")
    try:
        current = workdir_digests(sandbox, python=python)
        restored = _restore_harness(sandbox, baseline, current, protected=set(test_files))
    except (SandboxPathError, IsADirectoryError) as exc:
        return GradeResult(0.0, f"could not restore the test harness: {exc}")
    except SandboxError as exc:
        return GradeResult(0.0, f"could not inspect the workdir: {exc}")
    changed = _changed_paths(baseline.digests, current, ignored=set(test_files))
    details: dict[str, Any] = {"changed_files": changed[:50], "restored_harness": restored}
    if not changed:
        return GradeResult(0.0, "empty diff: no file outside the tests was changed", details)
    files = sorted({test_id.split("::", 1)[0] for test_id in test_ids})
    outcomes, run, report_error = _run_pytest(sandbox, files, timeout_s, python, pytest_args)
    results = {test_id: outcomes.get(keys[test_id], "missing") for test_id in test_ids}
    details |= {
        "fail_to_pass": {t: results[t] for t in fail_to_pass},
        "pass_to_pass": {t: results[t] for t in pass_to_pass},
        "pytest": {k: v for k, v in run.to_json().items() if k not in ("stdout", "stderr")},
    }
    if report_error:
        return GradeResult(0.0, report_error, details)
    return _verdict(fail_to_pass, pass_to_pass, results, details)


def _restore_harness(
    sandbox: Sandbox, baseline: WorkdirSnapshot, current: Mapping[str, str], protected: set[str]
) -> list[str]:
    """Put harness files back as in ``baseline``; delete new ones. Returns what changed."""
    restored, removed = [], []
    for path in sorted(set(current) | set(baseline.harness)):
        if path in protected or not _is_harness(path):
            continue
        if path in baseline.harness:
            if current.get(path) != baseline.digests[path]:
                sandbox.write_file(path, baseline.harness[path])
                restored.append(path)
        elif path not in baseline.digests:
            removed.append(path)
    if removed:
        sandbox.exec(["rm", "-f", "--", *removed], timeout_s=_SNAPSHOT_TIMEOUT_S)
    return restored + removed


def _changed_paths(
    before: Mapping[str, str], after: Mapping[str, str], ignored: set[str]
) -> list[str]:
    return sorted(
        path
        for path in set(before) | set(after)
        if before.get(path) != after.get(path) and path not in ignored and not _is_harness(path)
    )


def pytest_argv(
    python: str, junit_path: str | None, files: Sequence[str], extra: Sequence[str] = ()
) -> list[str]:
    """The pytest command graders and task generation run (see ``PYTEST_BOOTSTRAP``)."""
    argv = [python, "-s", "-B", "-c", PYTEST_BOOTSTRAP, "-p", "no:cacheprovider"]
    argv += ["-o", "addopts=", "-o", "junit_family=xunit2", "--rootdir", "."]
    if junit_path is not None:
        argv.append(f"--junitxml={junit_path}")
    return [*argv, "-q", *extra, "--", *files]


def _run_pytest(
    sandbox: Sandbox,
    files: Sequence[str],
    timeout_s: float,
    python: str,
    pytest_args: Sequence[str],
) -> tuple[dict[tuple[str, str], str], ExecResult, str | None]:
    """Outcomes from pytest's JUnit report, the run, and why the report is unusable if it is."""
    folder = _grader_folder()
    sandbox.exec(["mkdir", "-p", "--", f"{LOGS_DIR}/{folder}"], timeout_s=_SNAPSHOT_TIMEOUT_S)
    argv = pytest_argv(python, f"{LOGS_DIR}/{folder}/junit.xml", files, pytest_args)
    run = sandbox.exec(argv, timeout_s=timeout_s, env=PYTEST_ENV)
    try:
        return parse_junit(sandbox.read_log(f"{folder}/junit.xml")), run, None
    except FileNotFoundError:
        return {}, run, f"pytest wrote no JUnit report ({_describe(run)})"
    except (ElementTree.ParseError, SandboxPathError) as exc:
        return {}, run, f"pytest's JUnit report is unreadable: {exc}"
    finally:
        _remove_grader_folder(sandbox, folder)


def _verdict(
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    results: Mapping[str, str],
    details: dict[str, Any],
) -> GradeResult:
    still_failing = [t for t in fail_to_pass if results[t] != "passed"]
    regressed = [t for t in pass_to_pass if results[t] != "passed"]
    if not still_failing and not regressed:
        reason = f"all {len(fail_to_pass)} FAIL_TO_PASS and {len(pass_to_pass)} PASS_TO_PASS passed"
        return GradeResult(1.0, reason, details)
    problems = []
    if still_failing:
        problems.append(f"FAIL_TO_PASS not passing: {_show(still_failing, results)}")
    if regressed:
        problems.append(f"PASS_TO_PASS regressed: {_show(regressed, results)}")
    return GradeResult(0.0, "; ".join(problems), details)


def _show(test_ids: Sequence[str], results: Mapping[str, str]) -> str:
    shown = ", ".join(f"{t} ({results[t]})" for t in test_ids[:_SHOWN_IDS])
    more = len(test_ids) - _SHOWN_IDS
    return shown + (f" and {more} more" if more > 0 else "")


def _describe(run: ExecResult) -> str:
    status = "timed out" if run.timed_out else f"exit {run.exit_code}"
    return f"{status}; stderr: {run.stderr.strip()[-500:]}"


# -- Harbor terminal tasks ----------------------------------------------------------------


def grade_terminal(
    sandbox: Sandbox, task_dir: Path, *, timeout_s: float | None = None
) -> GradeResult:
    """Run a Harbor task's verifier (``tests/test.sh``) and read the reward it writes.

    ``timeout_s`` defaults to ``[verifier] timeout_sec`` in task.toml, else 600 s. Ends the
    agent's phase of ``sandbox`` (``begin_verification``).
    """
    tests = Path(task_dir) / "tests"
    if not (tests / "test.sh").is_file():
        raise FileNotFoundError(f"task {task_dir}: missing tests/test.sh")
    default_timeout, workdir_only = _verifier_settings(Path(task_dir))
    timeout = timeout_s if timeout_s is not None else default_timeout
    sandbox.begin_verification(fresh=workdir_only)
    tests_dir = sandbox.install_tests(tests)
    run = sandbox.exec(["bash", f"{tests_dir}/test.sh"], timeout_s=timeout, env=_VERIFIER_ENV)
    details = {"verifier": run.to_json()}
    if run.timed_out:
        return GradeResult(0.0, f"verifier timed out after {timeout:g} s", details)
    if run.exit_code is not None and _SIGNAL_STATUS < run.exit_code <= _SIGNAL_STATUS + 64:
        # A verifier's last word is its reward file; one killed mid-way (by a program of
        # the agent's it ran, say) may not have written it, leaving a planted one.
        signal_number = run.exit_code - _SIGNAL_STATUS
        return GradeResult(0.0, f"the verifier died of signal {signal_number}", details)
    reward, reason = _read_reward(sandbox)
    return GradeResult(reward, reason, details)


def _verifier_settings(task_dir: Path) -> tuple[float, bool]:
    """``[verifier]`` of task.toml: ``timeout_sec`` (600 s) and ``workdir_only`` (false)."""
    config_path = task_dir / "task.toml"
    if not config_path.is_file():
        return _DEFAULT_VERIFIER_TIMEOUT_S, False
    try:
        config = tomllib.loads(config_path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{config_path}: not valid TOML ({exc})") from exc
    verifier = config.get("verifier", {})
    value = verifier.get("timeout_sec", _DEFAULT_VERIFIER_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{config_path}: [verifier] timeout_sec must be a positive number")
    workdir_only = verifier.get("workdir_only", False)
    if not isinstance(workdir_only, bool):
        raise ValueError(f"{config_path}: [verifier] workdir_only must be true or false")
    return float(value), workdir_only


def _read_reward(sandbox: Sandbox) -> tuple[float, str]:
    for name, parse in (("reward.txt", _parse_reward_text), ("reward.json", _parse_reward_json)):
        try:
            raw = sandbox.read_log(f"verifier/{name}")
        except FileNotFoundError:
            continue
        except SandboxPathError as exc:
            return 0.0, f"/logs/verifier/{name} is not a plain file: {exc}"
        return parse(raw)
    return 0.0, "the verifier wrote no /logs/verifier/reward.txt or reward.json"


def _parse_reward_text(raw: bytes) -> tuple[float, str]:
    try:
        value = float(raw.decode("utf-8").strip())
    except (UnicodeDecodeError, ValueError):
        return 0.0, f"/logs/verifier/reward.txt is not a number: {raw[:80]!r}"
    return _finite(value, "reward.txt")


def _parse_reward_json(raw: bytes) -> tuple[float, str]:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return 0.0, f"/logs/verifier/reward.json is not JSON: {raw[:80]!r}"
    value = data.get("reward") if isinstance(data, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0, f"/logs/verifier/reward.json has no numeric 'reward': {raw[:80]!r}"
    return _finite(float(value), "reward.json")


def _finite(value: float, name: str) -> tuple[float, str]:
    if not math.isfinite(value):
        return 0.0, f"/logs/verifier/{name} holds a non-finite reward ({value})"
    return value, f"reward {value:g} from /logs/verifier/{name}"
