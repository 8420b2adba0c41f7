"""The checks a toyterm verifier runs inside the task's environment, on the agent's outputs.

This file is copied verbatim into every task's ``tests/test_outputs.py``, followed by that
task's ``CHECKS`` list, so it must run on a bare ``python3`` with the standard library only
(pytest is not guaranteed in Harbor images). Every expected value travels in ``CHECKS``,
inside ``/tests``, which the agent can neither read during its episode nor change: nothing
under ``/app`` is trusted except the outputs under check, and outputs are read without
following symlinks. Text comparisons forgive trailing newlines and nothing else.

``main`` (called by ``test_outputs.py``) exits 0 only when there is at least one check and
every check passed; any exception a check raises (an unreadable file, a crashing script)
counts as a failure.
"""

from __future__ import annotations

# Only what every run needs is imported here: a verifier runs once per graded episode, and
# the modules a few checks need (tarfile, subprocess, ...) are imported by those checks.
# typing, collections.abc and signal (which imports enum) would be 12 of the 22 ms a bare
# `python3 -I -S` spends before the checks start on the 2-core box; annotations are never
# evaluated here (postponed), so their names are imported for type checkers only.
import os
import stat
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any

ROOT = "/app"
# Per hidden-input case: generous for a shell one-liner, short enough to bound the verifier.
PROGRAM_TIMEOUT_S = 20
_GZIP_MAGIC = b"\x1f\x8b"
_SHOWN_CHARS = 120
# SIGKILL's number on Linux, the same on every architecture (see the imports above).
_SIGKILL = 9


class CheckFailed(Exception):
    """An output differs from what the task asked for; the message says how."""


def _show(text: str) -> str:
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")


def _read_regular(root: str, rel: str) -> bytes:
    path = os.path.join(root, rel)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise CheckFailed(f"{rel} does not exist") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckFailed(f"{rel} is not a regular file")
    with open(path, "rb") as handle:
        return handle.read()


def _decode(data: bytes, rel: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckFailed(f"{rel} is not UTF-8 text") from None


def _read_text(root: str, rel: str) -> str:
    return _decode(_read_regular(root, rel), rel)


def _same_text(actual: str, expected: str) -> bool:
    return actual.rstrip("\n") == expected.rstrip("\n")


def _content_lines(text: str) -> list[str]:
    return text.rstrip("\n").split("\n") if text.rstrip("\n") else []


def _normal_path(line: str) -> str:
    for prefix in ("/app/", "./"):
        line = line.removeprefix(prefix)
    return line


def check_text(root: str, path: str, expected: str) -> None:
    actual = _read_text(root, path)
    if not _same_text(actual, expected):
        raise CheckFailed(f"{path}: expected {_show(expected)}, found {_show(actual)}")


def check_number(root: str, path: str, expected: int) -> None:
    actual = _read_text(root, path).strip()
    if actual != str(expected):
        raise CheckFailed(f"{path}: expected the number {expected}, found {_show(actual)}")


def check_lines(
    root: str, path: str, expected: Sequence[str], unordered: bool = False, paths: bool = False
) -> None:
    """Line by line; ``paths`` accepts ``./x`` and ``/app/x`` for ``x``."""
    actual = _content_lines(_read_text(root, path))
    if paths:
        actual = [_normal_path(line) for line in actual]
    wanted = list(expected)
    if unordered:
        actual, wanted = sorted(actual), sorted(wanted)
    if actual != wanted:
        missing = [line for line in wanted if line not in actual]
        extra = [line for line in actual if line not in wanted]
        raise CheckFailed(
            f"{path}: {len(actual)} lines, expected {len(wanted)}; "
            f"missing {_show(str(missing))}, unexpected {_show(str(extra))}"
        )


def check_absent(root: str, path: str) -> None:
    if os.path.lexists(os.path.join(root, path)):
        raise CheckFailed(f"{path} should not exist")


def check_isdir(root: str, path: str) -> None:
    full = os.path.join(root, path)
    if os.path.islink(full) or not os.path.isdir(full):
        raise CheckFailed(f"{path} is not a directory")


def check_mode(root: str, path: str, mode: int) -> None:
    full = os.path.join(root, path)
    try:
        info = os.lstat(full)
    except FileNotFoundError:
        raise CheckFailed(f"{path} does not exist") from None
    if stat.S_ISLNK(info.st_mode):
        raise CheckFailed(f"{path} is a symlink")
    actual = stat.S_IMODE(info.st_mode)
    if actual != mode:
        raise CheckFailed(f"{path}: mode {actual:o}, expected {mode:o}")


def _tree_files(root: str, path: str) -> dict[str, str]:
    """Relative path -> text of every regular file below ``root/path``; symlinks refused."""
    base = os.path.join(root, path)
    check_isdir(root, path)
    found = {}
    for folder, dirnames, filenames in os.walk(base):
        for name in sorted(dirnames + filenames):
            full = os.path.join(folder, name)
            rel = os.path.relpath(full, base)
            if os.path.islink(full):
                raise CheckFailed(f"{path}/{rel} is a symlink")
            if name in filenames:
                found[rel] = _read_text(base, rel)
    return found


def _compare_files(where: str, actual: Mapping[str, str], expected: Mapping[str, str]) -> None:
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    if missing or extra:
        raise CheckFailed(f"{where}: missing {missing[:5]}, unexpected {extra[:5]}")
    for name in sorted(expected):
        if actual[name] != expected[name]:
            raise CheckFailed(f"{where}/{name}: expected {_show(expected[name])}")


def check_tree(
    root: str, path: str, files: Mapping[str, str], exact: bool = True, missing_ok: bool = False
) -> None:
    """The regular files below ``path`` are exactly ``files``; ``exact=False`` forgives
    trailing newlines in their contents (for files the agent writes itself), and
    ``missing_ok`` accepts an absent folder where no file is expected."""
    if missing_ok and not os.path.lexists(os.path.join(root, path)):
        return
    actual = _tree_files(root, path)
    if not exact:
        actual = {
            name: files[name] if name in files and _same_text(text, files[name]) else text
            for name, text in actual.items()
        }
    _compare_files(path, actual, files)


def check_tar(root: str, path: str, files: Mapping[str, str], gzipped: bool = True) -> None:
    """An archive whose file members are exactly ``files`` (``./`` prefixes forgiven)."""
    import io  # noqa: PLC0415
    import tarfile  # noqa: PLC0415

    data = _read_regular(root, path)
    if gzipped != data.startswith(_GZIP_MAGIC):
        raise CheckFailed(f"{path}: {'not' if gzipped else 'unexpectedly'} gzip-compressed")
    members: dict[str, str] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz" if gzipped else "r:") as archive:
        for member in archive.getmembers():
            name = member.name.removeprefix("./").rstrip("/")
            if member.isdir():
                continue
            if not member.isfile():
                raise CheckFailed(f"{path}: member {name} is not a regular file")
            handle = archive.extractfile(member)
            members[name] = _decode(handle.read() if handle else b"", f"{path}:{name}")
    _compare_files(path, members, files)


def check_gzip(root: str, path: str, expected: str) -> None:
    import gzip  # noqa: PLC0415

    data = _read_regular(root, path)
    if not data.startswith(_GZIP_MAGIC):
        raise CheckFailed(f"{path}: not gzip-compressed")
    actual = _decode(gzip.decompress(data), path)
    if actual != expected:
        raise CheckFailed(f"{path}: decompressed content differs from the original")


def check_json(root: str, path: str, expected: Any) -> None:
    import json  # noqa: PLC0415

    try:
        actual = json.loads(_read_text(root, path))
    except json.JSONDecodeError as exc:
        raise CheckFailed(f"{path}: not valid JSON ({exc})") from None
    if actual != expected:
        raise CheckFailed(f"{path}: expected {_show(json.dumps(expected))}")


def check_csv(root: str, path: str, rows: Sequence[Sequence[str]]) -> None:
    import csv  # noqa: PLC0415
    import io  # noqa: PLC0415

    actual = [row for row in csv.reader(io.StringIO(_read_text(root, path))) if row]
    if actual != [list(row) for row in rows]:
        raise CheckFailed(f"{path}: expected rows {_show(str(rows))}, found {_show(str(actual))}")


def check_program(root: str, script: str, argv: Sequence[str], cases: Sequence[Any]) -> None:
    """Run the agent's ``script`` on inputs it never saw; stdout must match each case.

    A case has ``files`` (written to a fresh folder), ``args`` (``{dir}`` names that
    folder), ``stdin`` and the expected ``stdout``.
    """
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    _read_regular(root, script)
    for number, case in enumerate(cases, 1):
        folder = tempfile.mkdtemp(prefix="toyterm-case-")
        try:
            for name, text in sorted(case["files"].items()):
                target = os.path.join(folder, name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "w", encoding="utf-8") as handle:
                    handle.write(text)
            args = [arg.replace("{dir}", folder) for arg in case["args"]]
            _run_case(number, [*argv, *args], case["stdin"], case["stdout"], folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _run_case(number: int, argv: list[str], stdin: str, expected: str, cwd: str) -> None:
    import subprocess  # noqa: PLC0415

    # Its own session, ended with the case: what the program left running in the
    # background is killed (and what escaped the session, by ``kill_strays``).
    with subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        start_new_session=True,
    ) as proc:
        try:
            stdout_bytes, stderr_bytes = proc.communicate(stdin.encode(), PROGRAM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"hidden case {number}: timed out") from None
        finally:
            _kill_session(proc.pid)
    run = subprocess.CompletedProcess(argv, proc.returncode, stdout_bytes, stderr_bytes)
    stdout = run.stdout.decode("utf-8", errors="replace")
    if run.returncode != 0:
        stderr = run.stderr.decode("utf-8", errors="replace")
        raise CheckFailed(f"hidden case {number}: exit {run.returncode}, stderr {_show(stderr)}")
    if not _same_text(stdout, expected):
        raise CheckFailed(f"hidden case {number}: expected {_show(expected)}, got {_show(stdout)}")


CHECKERS: dict[str, Callable[..., None]] = {
    "text": check_text,
    "number": check_number,
    "lines": check_lines,
    "absent": check_absent,
    "isdir": check_isdir,
    "mode": check_mode,
    "tree": check_tree,
    "tar": check_tar,
    "gzip": check_gzip,
    "json": check_json,
    "csv": check_csv,
    "program": check_program,
}


def run_checks(checks: Sequence[Mapping[str, Any]], root: str = ROOT) -> int:
    """Run every check, print one line each; 0 iff there are checks and all passed."""
    if not checks:
        print("FAIL: no checks")
        return 1
    failures = 0
    for number, check in enumerate(checks, 1):
        params = dict(check)
        kind = params.pop("kind")
        try:
            CHECKERS[kind](root, **params)
        except CheckFailed as exc:
            failures += 1
            print(f"FAIL {number} {kind}: {exc}")
        # The agent's files can make a check crash in any way; that is a failed check.
        except Exception as exc:
            failures += 1
            print(f"FAIL {number} {kind}: {type(exc).__name__}: {exc}")
        else:
            print(f"ok {number} {kind}")
    return 1 if failures else 0


def _kill_session(session_id: int) -> None:
    import contextlib  # noqa: PLC0415

    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(session_id, _SIGKILL)


def _start_time(pid: int) -> int | None:
    """Clock ticks after boot at which ``pid`` started, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat_line = handle.read()
    except OSError:
        return None
    # Field 22; the command name (field 2) may hold spaces, so count after its ')'.
    return int(stat_line.rsplit(b")", 1)[1].split()[19])


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return int(handle.read().rsplit(b")", 1)[1].split()[1])


def _lineage() -> list[int]:
    """This process and its ancestors up to ``test.sh``'s shell ($TOYTERM_VERIFIER_PID).

    Run any other way (by hand, outside a sandbox) it is this process alone: walking on to
    pid 1 would make every process of the machine's session younger than the oldest
    ancestor a stray.
    """
    pid = os.getpid()
    chain = [pid]
    top = os.environ.get("TOYTERM_VERIFIER_PID", "")
    if not top.isdigit():
        return chain
    while pid > 1 and pid != int(top):
        pid = _parent(pid)
        chain.append(pid)
    return chain if pid == int(top) else chain[:1]


def kill_strays() -> list[int]:
    """Kill every process started since the verifier began that is not one of its own.

    The verifier's ancestors up to ``test.sh`` and this process live; anything else that
    started no earlier than the oldest of them came from the checks, that is from the
    agent's programs, and could rewrite the reward after ``test.sh`` writes it. Returns the
    pids signalled.
    """
    lineage = _lineage()
    started = [t for t in map(_start_time, lineage) if t is not None]
    since = min(started)
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in lineage or int(entry) == 1:
            continue
        start = _start_time(int(entry))
        if start is not None and start >= since:
            try:
                os.kill(int(entry), _SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
            killed.append(int(entry))
    return killed


def main(checks: Sequence[Mapping[str, Any]]) -> None:
    """The entry point of a task's ``test_outputs.py``."""
    status = run_checks(checks)
    kill_strays()
    sys.exit(status)
