"""Child processes for CPU-heavy jobs: tcmalloc preloaded where the system has it, output
relayed, a failure named with the child's last lines, the child killed with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from thundersync_core.runtime.child import ChildFailed, child_env, run_child, tcmalloc


def test_the_child_runs_on_tcmalloc_where_the_system_has_it(capsys) -> None:
    probe = "print(any('tcmalloc' in line for line in open('/proc/self/maps')))"
    run_child("the allocator probe", [sys.executable, "-c", probe])
    assert capsys.readouterr().out.strip() == str(tcmalloc() is not None)


def test_an_existing_preload_is_kept_behind_tcmalloc() -> None:
    env = child_env({"LD_PRELOAD": "libfoo.so"})
    assert env["LD_PRELOAD"].split()[-1] == "libfoo.so"
    assert env["THUNDERSYNC_PARENT_PID"] == str(os.getpid())
    if tcmalloc() is not None:
        assert env["LD_PRELOAD"].split()[0] == tcmalloc()
        # Not twice when the caller preloads it already.
        assert child_env({"LD_PRELOAD": env["LD_PRELOAD"]})["LD_PRELOAD"] == env["LD_PRELOAD"]


def test_a_failing_child_is_named_with_its_last_lines(capsys) -> None:
    script = "import sys\nfor i in range(100): print(f'line {i}')\nsys.exit('bad input: x')"
    with pytest.raises(ChildFailed, match=r"the probe failed \(exit 1\)") as caught:
        run_child("the probe", [sys.executable, "-c", script], tail_lines=5)
    message = str(caught.value)
    assert "bad input: x" in message
    assert "line 99" in message
    assert "line 94" not in message  # only the last five lines
    assert "line 0\n" in capsys.readouterr().out  # every line relayed as it came


def test_a_child_dies_with_its_killed_parent(tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    child = textwrap.dedent(
        f"""
        import os, pathlib, time
        from thundersync_core.runtime.child import die_with_parent
        die_with_parent()
        pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))
        time.sleep(120)
        """
    )
    parent = textwrap.dedent(
        f"""
        import sys
        from thundersync_core.runtime.child import run_child
        run_child("the sleeper", [sys.executable, "-c", {child!r}])
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.is_file() or not pid_file.read_text():
            assert proc.poll() is None, "the parent exited early"
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.1)
        child_pid = int(pid_file.read_text())
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while _alive(child_pid):
            assert time.monotonic() < deadline, f"child {child_pid} outlived its parent"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False
