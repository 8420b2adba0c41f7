"""The bubblewrap sandbox against real processes: isolation, limits, cleanup, file safety.

Every hostile command carries a unique marker in its command line, so the host can be
scanned afterwards for anything it left running (the scan only looks; it kills nothing).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from thundersync_core.rollout.sandbox import (
    SandboxLimits,
    SandboxPathError,
    SandboxUnavailable,
    open_sandbox,
)
from thundersync_core.rollout.sandbox.local import ROOT_PREFIX, LocalSandbox, sweep_orphans
from thundersync_core.rollout.sandbox.output import elision_marker

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("bwrap") is None,
        reason="bwrap not installed (Debian package 'bubblewrap'; `make test` installs it as root)",
    ),
]

# Time allowed past a timeout for killing the namespace and collecting the output.
KILL_SLACK_S = 3.0


@pytest.fixture
def sandbox():
    box = open_sandbox("local", limits=SandboxLimits(timeout_s=20))
    yield box
    box.close()


def marker() -> str:
    return f"tsmark{uuid.uuid4().hex}"


def processes_with(text: str) -> list[psutil.Process]:
    return [
        proc
        for proc in psutil.process_iter(["cmdline"])
        if any(text in part for part in proc.info["cmdline"] or ())
    ]


def assert_no_process_left(text: str, uid: int | None) -> None:
    """No host process mentions ``text`` or runs as the sandbox's uid (after ~2 s to die)."""
    deadline = time.monotonic() + 2.0
    while True:
        left = processes_with(text)
        if uid is not None:
            left += [p for p in psutil.process_iter(["uids"]) if p.info["uids"].real == uid]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"stray processes: {[(p.pid, p.info) for p in left]}"


def test_only_workdir_tmp_and_logs_are_writable(sandbox):
    name = marker()
    targets = ["/etc", "/root", "/work", "/usr", "/", "/tests", "/opt", sys.prefix]
    script = "; ".join(f"touch {t}/{name} 2>/dev/null && echo WROTE {t}" for t in targets)
    result = sandbox.exec(f"{script}; touch /app/a /tmp/b /logs/c && echo writable-ok")
    assert "WROTE" not in result.stdout
    assert "writable-ok" in result.stdout
    for target in targets:
        assert not Path(target, name).exists()
    assert (sandbox.host_workdir / "a").exists()


def test_tmp_is_private_both_ways(sandbox, tmp_path):
    name = marker()
    host_file = Path("/tmp") / f"{name}-host"
    host_file.write_text("host")
    try:
        result = sandbox.exec(f"echo in > /tmp/{name}; ls /tmp; test -e {host_file} || echo unseen")
    finally:
        host_file.unlink()
    assert "unseen" in result.stdout
    assert not (Path("/tmp") / name).exists()


def test_pid_namespace_hides_host_processes(sandbox):
    result = sandbox.exec("echo $$; ls /proc | grep -c '^[0-9]'")
    own_pid, visible = (int(line) for line in result.stdout.split())
    assert own_pid <= 3
    assert visible < 10
    assert psutil.pid_exists(1)  # the host has far more processes than the sandbox sees


def test_commands_hold_no_capabilities_and_an_unprivileged_uid(sandbox):
    result = sandbox.exec("id -u; grep CapEff /proc/self/status")
    uid_line, caps_line = result.stdout.splitlines()
    if os.geteuid() == 0:
        assert int(uid_line) == sandbox.uid != 0
    assert caps_line.split()[1] == "0000000000000000"


def test_fork_bomb_is_stopped_and_leaves_nothing(sandbox):
    name = marker()
    timeout = 3.0
    bomb = f": {name}; bomb() {{ bomb | bomb & }}; bomb; sleep 60"
    result = sandbox.exec(bomb, timeout_s=timeout)
    assert result.timed_out
    assert result.killed_reason == "timeout"
    assert result.exit_code is None
    assert result.duration_s < timeout + KILL_SLACK_S
    assert_no_process_left(name, sandbox.uid)


def test_background_processes_die_with_the_command(sandbox):
    name = marker()
    result = sandbox.exec(f"(sleep 300; : {name}) & echo started")
    assert result.exit_code == 0
    assert result.duration_s < 5
    assert_no_process_left(name, uid=None)


def test_endless_loop_is_stopped_at_the_timeout(sandbox):
    name = marker()
    result = sandbox.exec(f": {name}; while :; do :; done", timeout_s=2)
    assert result.timed_out
    assert result.duration_s < 2 + KILL_SLACK_S
    assert_no_process_left(name, sandbox.uid)


def test_cpu_limit_kills_a_spinning_command():
    with open_sandbox("local", limits=SandboxLimits(cpu_s=1, timeout_s=20)) as box:
        result = box.exec("while :; do :; done")
    assert not result.timed_out
    assert result.killed_reason == "cpu"
    assert result.duration_s < 10


def test_a_gigabyte_of_output_is_bounded_fast_and_in_little_memory(sandbox):
    budget = sandbox.limits.output_bytes
    tracemalloc.start()
    try:
        result = sandbox.exec("head -c 1000000000 /dev/zero | tr '\\0' a", timeout_s=60)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.exit_code == 0
    assert result.stdout_bytes == 1_000_000_000
    assert result.output_truncated
    assert len(result.stdout) <= budget + len(elision_marker(result.stdout_bytes))
    assert result.stdout.startswith("a" * (budget // 2))
    assert result.stdout.endswith("a" * (budget // 2))
    assert f"[... {1_000_000_000 - budget} bytes elided ...]" in result.stdout
    assert peak < 16 * 2**20, f"the reader held {peak} bytes at peak"
    assert result.duration_s < 30


def test_workdir_persists_across_calls_and_is_removed_on_close():
    box = LocalSandbox(SandboxLimits(timeout_s=10))
    box.exec("mkdir -p src && echo 41 > src/n && chmod 000 src")
    result = box.exec("chmod 755 src && cat src/n")
    assert result.stdout == "41\n"
    box.exec("chmod 000 src")  # the host must still be able to remove it
    host_root = box.host_workdir.parent
    box.close()
    box.close()
    assert not host_root.exists()


# A process that opens a sandbox, writes a file in it, says where it is, and waits to die.
OPENS_AND_WAITS = """
import sys, time
from thundersync_core.rollout.sandbox.base import SandboxLimits
from thundersync_core.rollout.sandbox.local import LocalSandbox
box = LocalSandbox(SandboxLimits(timeout_s=10))
box.exec("chmod 700 . && echo left > behind")
print(box.host_workdir.parent, flush=True)
time.sleep(600)
"""


def test_a_killed_owners_sandbox_folder_is_swept_and_a_live_ones_kept(tmp_path):
    env = os.environ | {"TMPDIR": str(tmp_path)}
    child = subprocess.Popen(
        [sys.executable, "-c", OPENS_AND_WAITS], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        orphan = Path(child.stdout.readline().strip())
    finally:
        child.kill()  # SIGKILL: no finalizer runs
        child.wait()
    assert (orphan / "work" / "behind").exists()
    legacy = tmp_path / f"{ROOT_PREFIX}legacy"  # no owner file: another version's
    legacy.mkdir()
    stray = tmp_path / "not-a-sandbox"
    stray.mkdir()
    tempfile.tempdir = str(tmp_path)
    try:
        live = LocalSandbox(SandboxLimits(timeout_s=10))  # its first sandbox here sweeps
        assert live.host_workdir.parent.parent == tmp_path
        assert not orphan.exists()
        assert sweep_orphans(tmp_path) == []  # the live one is held
        assert live.host_workdir.exists()
        assert legacy.exists()
        assert stray.exists()
        live.close()
    finally:
        tempfile.tempdir = None
    assert not live.host_workdir.exists()


# In a session whose controlling terminal is the pty on descriptor argv[2]: type into it,
# write to it, from the sandbox (or, "plain", from an ordinary child: the harness's control).
ON_A_TERMINAL = """
import fcntl, os, subprocess, sys, termios
os.setsid()
fcntl.ioctl(int(sys.argv[2]), termios.TIOCSCTTY, 0)
os.close(int(sys.argv[2]))
forge = (
    "echo WRITTEN > /dev/tty; "
    "python3 -c 'import fcntl, os, termios; fd = os.open(\\"/dev/tty\\", os.O_RDWR); "
    "[fcntl.ioctl(fd, termios.TIOCSTI, c) for c in (b\\"T\\", b\\"Y\\", b\\"P\\")]'; "
    "echo RAN"
)
if sys.argv[1] == "plain":
    subprocess.run(["bash", "-c", forge], stdin=subprocess.DEVNULL)
else:
    from thundersync_core.rollout.sandbox.base import SandboxLimits
    from thundersync_core.rollout.sandbox.local import LocalSandbox
    box = LocalSandbox(SandboxLimits(timeout_s=20))
    result = box.exec(forge)
    print(result.stdout, end="")
    print(result.stderr, file=sys.stderr)
    box.close()
"""


def _read_all(fd: int) -> bytes:
    seen = b""
    os.set_blocking(fd, False)
    try:
        while chunk := os.read(fd, 4096):
            seen += chunk
    except (BlockingIOError, OSError):  # nothing more, or EIO once the other side closed
        pass
    return seen


def _terminal_sees(how: str) -> tuple[bytes, bytes, str]:
    """(what was written to, what was typed into) a pty that a command run ``how`` holds
    as its controlling terminal, and what the sandboxed command printed."""
    import termios  # noqa: PLC0415

    master, slave = os.openpty()
    try:
        attrs = termios.tcgetattr(slave)
        attrs[3] &= ~(termios.ECHO | termios.ICANON)  # typed bytes readable as they come
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        run = subprocess.run(
            [sys.executable, "-c", ON_A_TERMINAL, how, str(slave)],
            pass_fds=(slave,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            check=True,
            timeout=60,
        )
        return _read_all(master), _read_all(slave), run.stdout
    finally:
        os.close(master)
        os.close(slave)


def test_a_command_cannot_reach_the_callers_terminal():
    # Commands share the caller's session (below): its controlling terminal must stay out
    # of reach, or a command could type (TIOCSTI) into the shell that started training.
    written, typed, _ = _terminal_sees("plain")
    assert b"WRITTEN" in written  # the harness sees what reaches the terminal
    tiocsti = Path("/proc/sys/dev/tty/legacy_tiocsti")
    if not tiocsti.exists() or tiocsti.read_text().strip() == "1":
        assert typed == b"TYP"
    written, typed, printed = _terminal_sees("sandbox")
    assert printed == "RAN\n"  # the forgery ran in the sandbox
    assert b"WRITTEN" not in written
    assert typed == b""


def test_a_command_shares_its_callers_scheduling_group_and_niceness(sandbox):
    # A session of its own would make each command its own autogroup, as heavy to the
    # scheduler as the whole training process, whatever the niceness of the role.
    # /proc/self/autogroup reads empty for a process in the kernel's default group (no
    # session was made on the way from pid 1, as in some containers); the command must
    # then read it empty too.
    result = sandbox.exec('nice; echo "group=$(cat /proc/self/autogroup 2>/dev/null)"')
    assert result.exit_code == 0, result
    niceness, group = result.stdout.splitlines()
    assert int(niceness) == os.nice(0)
    if Path("/proc/self/autogroup").exists():
        assert group == "group=" + Path("/proc/self/autogroup").read_text().strip()


def test_files_stdin_and_env_round_trip(sandbox, tmp_path):
    (tmp_path / "proj" / "pkg").mkdir(parents=True)
    (tmp_path / "proj" / "pkg" / "mod.py").write_text("X = 1\n")
    (tmp_path / "proj" / "run.sh").write_text("echo ran\n")
    (tmp_path / "proj" / "run.sh").chmod(0o755)
    sandbox.copy_in(tmp_path / "proj")
    sandbox.copy_in(tmp_path / "proj" / "run.sh", "renamed.sh")
    sandbox.write_file("data/blob.bin", bytes(range(256)))
    result = sandbox.exec(
        "cat pkg/mod.py; ./run.sh; ./renamed.sh; echo $GREETING; cat -",
        env={"GREETING": "hi"},
        stdin="from stdin",
    )
    assert result.stdout == "X = 1\nran\nran\nhi\nfrom stdin"
    assert sandbox.read_file("data/blob.bin") == bytes(range(256))
    sandbox.exec("echo changed > pkg/mod.py")
    assert sandbox.read_file("pkg/mod.py") == b"changed\n"


def test_symlinks_planted_in_the_workdir_never_lead_the_host_out(sandbox):
    target = Path(f"/tmp/{marker()}")
    target.write_text("host secret")
    try:
        sandbox.exec(f"ln -s {target} leak; ln -s {target.parent} dirlink")
        with pytest.raises(SandboxPathError, match="symlink"):
            sandbox.read_file("leak")
        with pytest.raises(SandboxPathError, match="dirlink"):
            sandbox.write_file("dirlink/evil", "x")
        sandbox.write_file("leak", "replaced")
        assert target.read_text() == "host secret"
        assert sandbox.read_file("leak") == b"replaced"
        assert not (target.parent / "evil").exists()
    finally:
        target.unlink()


def test_logs_and_tests_folders(sandbox, tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "check.sh").write_text("echo checked > /logs/verifier/out\n")
    sandbox.exec("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt")
    sandbox.clear_logs("verifier")
    with pytest.raises(FileNotFoundError):
        sandbox.read_log("verifier/reward.txt")
    assert sandbox.install_tests(tmp_path / "t") == "/tests"
    result = sandbox.exec("bash /tests/check.sh; echo x > /tests/check.sh || echo readonly")
    assert "readonly" in result.stdout
    assert sandbox.read_log("verifier/out") == b"checked\n"
    assert sandbox.host_logs_dir.joinpath("verifier", "out").is_file()


def test_ro_binds_expose_host_paths_read_only(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "f").write_text("visible")
    with open_sandbox("local", ro_binds=[shared]) as box:
        result = box.exec(f"cat {shared}/f; touch {shared}/g 2>/dev/null || echo denied")
    assert result.stdout == "visible" + "denied\n"
    with pytest.raises(SandboxPathError, match="ro_binds"):
        open_sandbox("local", ro_binds=[tmp_path / "missing"])


def test_missing_bubblewrap_is_reported_by_package_name(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        LocalSandbox()


def test_a_bubblewrap_that_cannot_start_is_refused_at_open(monkeypatch, tmp_path):
    # Probed once per binary and process: a working bwrap earlier in the session must not
    # vouch for another one.
    with open_sandbox("local") as box:
        assert box.exec("echo up").stdout == "up\n"
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    before = set(Path(tempfile.gettempdir()).glob("thundersync-sandbox-*"))
    with pytest.raises(SandboxUnavailable, match=r"could not start a sandbox.*namespace"):
        LocalSandbox()
    assert set(Path(tempfile.gettempdir()).glob("thundersync-sandbox-*")) <= before


def test_cli_prints_one_json_result(tmp_path):
    (tmp_path / "hello.txt").write_text("hello from the host\n")
    cmd = [sys.executable, "-m", "thundersync_core.rollout.sandbox.cli", "exec"]
    cmd += ["--timeout", "10", "--workdir-from", str(tmp_path), "--", "cat", "hello.txt"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["stdout"] == "hello from the host\n"
    assert result["exit_code"] == 0
    assert result["timed_out"] is False


def test_concurrent_sandboxes_are_separate():
    def run(index: int) -> tuple[int | None, str]:
        with open_sandbox("local") as box:
            box.write_file("n.txt", str(index))
            # Each sandbox sees only its own marker in its private /tmp.
            result = box.exec(
                "touch /tmp/mark-$RANDOM; sleep 0.2; cat n.txt; ls /tmp | grep -c mark"
            )
            return box.uid, result.stdout

    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(pool.map(run, range(4)))
    assert [stdout for _uid, stdout in outcomes] == [f"{i}1\n" for i in range(4)]
    if os.geteuid() == 0:
        assert len({uid for uid, _stdout in outcomes}) == 4
