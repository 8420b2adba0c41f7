"""The escape and limit probes every sandbox backend must hold, run on each of them.

Each probe acts as an agent's command would. Leftover processes are looked for where they
would run: on the host for the local backend (its commands are host processes under a
private uid), inside the container for Docker (whose processes the host may not see
with a remote daemon). Backend-only checks (uids, capabilities, pid namespaces, the
daemon's API) stay in test_sandbox_local.py and test_sandbox_docker.py.
"""

from __future__ import annotations

import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.integration.test_grading import CHECK, make_task
from thundersync_core.rollout.grading import grade_terminal
from thundersync_core.rollout.sandbox import Sandbox, SandboxLimits, open_sandbox
from thundersync_core.rollout.sandbox.base import SandboxUnavailable
from thundersync_core.rollout.sandbox.output import elision_marker

pytestmark = pytest.mark.integration

BACKENDS = ["local", "docker"]
# Time allowed past a timeout for killing everything and collecting the output (Docker's
# API adds a second exec for the kill).
KILL_SLACK_S = 8.0
# Docker's output travels through the daemon's API; 100 MB proves the bound holds while
# keeping the test short on a slow daemon (the local backend's gigabyte test is its own).
OUTPUT_BYTES = 100_000_000
MAX_PROCESSES = 64


def open_box(backend: str, **limits) -> Sandbox:
    try:
        return open_sandbox(backend, limits=SandboxLimits(**{"timeout_s": 20, **limits}))
    except SandboxUnavailable as exc:
        if backend == "local" and shutil.which("bwrap") is not None:
            raise
        pytest.skip(f"{backend} sandbox unavailable: {exc}")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def box(backend) -> Iterator[Sandbox]:
    with open_box(backend, max_processes=MAX_PROCESSES) as sandbox:
        yield sandbox


def marker() -> str:
    return f"tsmark{uuid.uuid4().hex}"


def leftovers(box: Sandbox, text: str) -> list[str]:
    """Processes still running whose command line holds ``text`` (after ~2 s to die)."""
    deadline = time.monotonic() + 2.0
    while True:
        if hasattr(box, "uid"):  # local: host processes
            found = [
                f"{proc.pid} {proc.info['cmdline']}"
                for proc in psutil.process_iter(["cmdline"])
                if any(text in part for part in proc.info["cmdline"] or ())
            ]
        else:
            # "[x]" matches x, so the pattern does not match this command's own processes.
            pattern = f"{text[:-1]}[{text[-1]}]"
            listing = box.exec(f"grep -l '{pattern}' /proc/[0-9]*/cmdline 2>/dev/null || true")
            found = listing.stdout.split()
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_no_network_not_even_the_hosts_loopback(box):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # the server answers from the host, so a failure inside means isolation
        probe = (
            "import socket\n"
            "for host, port in [('127.0.0.1', PORT), ('1.1.1.1', 53), ('10.0.0.1', 80)]:\n"
            "    try:\n"
            "        socket.create_connection((host, port), timeout=2).close()\n"
            "        print('CONNECTED', host)\n"
            "    except OSError:\n"
            "        print('blocked', host)\n"
            "try:\n"
            "    print('RESOLVED', socket.getaddrinfo('pypi.org', 443))\n"
            "except OSError:\n"
            "    print('dns blocked')\n"
        ).replace("PORT", str(port))
        result = box.exec(["python3", "-c", probe])
    assert result.exit_code == 0, result.stderr
    assert "CONNECTED" not in result.stdout
    assert "RESOLVED" not in result.stdout
    assert result.stdout.count("blocked") == 4, result.stdout


def test_host_files_are_out_of_reach(box, tmp_path):
    host_file = tmp_path / "host.txt"
    host_file.write_text("host\n")
    result = box.exec(f"echo owned > {host_file}; rm -f {host_file}; cat {host_file}")
    assert "host" not in result.stdout
    assert host_file.read_text() == "host\n"


def test_a_timed_out_command_leaves_nothing_running(box):
    name = marker()
    loop = f"while :; do : {name}; done"
    command = f"({loop}) & setsid sh -c '{loop}' & {loop}"
    result = box.exec(command, timeout_s=2)
    assert result.timed_out
    assert result.killed_reason == "timeout"
    assert result.duration_s < 2 + KILL_SLACK_S
    assert leftovers(box, name) == []


def test_a_fork_bomb_is_stopped_and_leaves_nothing(box):
    name = marker()
    result = box.exec(f": {name}; bomb() {{ bomb | bomb & }}; bomb; sleep 60", timeout_s=3)
    assert result.timed_out
    assert result.duration_s < 3 + KILL_SLACK_S
    assert leftovers(box, name) == []


def test_the_process_count_is_capped(box):
    result = box.exec(
        f"n=0; for i in $(seq {4 * MAX_PROCESSES}); do sleep 30 & n=$((n+1)); done 2>/dev/null;"
        " sleep 1; ls /proc | grep -c '^[0-9]'",
        timeout_s=10,
    )
    running = [int(line) for line in result.stdout.split() if line.isdigit()]
    # The cap stops the loop's forks well before all of them ran (some may stop the
    # final count too: then nothing could be counted, which also shows the cap).
    assert not running or running[-1] <= MAX_PROCESSES + 8, result.stdout


def test_output_is_bounded(box):
    result = box.exec(f"head -c {OUTPUT_BYTES} /dev/zero | tr '\\0' a", timeout_s=120)
    budget = box.limits.output_bytes
    assert result.exit_code == 0
    assert result.stdout_bytes == OUTPUT_BYTES
    assert result.output_truncated
    assert len(result.stdout) <= budget + len(elision_marker(OUTPUT_BYTES))


def test_a_large_allocation_is_refused(backend):
    with open_box(backend, memory_mb=256) as box:
        result = box.exec(["python3", "-c", "b = b'x' * (2 * 1024**3); print('allocated')"])
    assert result.exit_code != 0
    assert "allocated" not in result.stdout
    assert result.killed_reason == "memory"


@pytest.fixture
def task(tmp_path) -> Path:
    root = make_task(tmp_path / "hello", f"{CHECK} && echo 1 > /logs/verifier/reward.txt")
    (root / "solution" / "solve.sh").write_text(f"# {marker()}\necho 'hello world' > hello.txt\n")
    return root


def test_the_tests_and_the_reference_solution_are_not_there_before_grading(box, task):
    secret = (task / "solution" / "solve.sh").read_text().split()[1]
    result = box.exec(f"ls -A /tests; grep -rl {secret} /app /tmp /logs /tests 2>/dev/null")
    assert result.stdout.strip() == ""
    assert grade_terminal(box, task).reward == 0.0


def test_tampering_with_the_reward_and_the_verifier_earns_zero(box, task):
    box.exec(
        "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && "
        "echo '{\"reward\": 1}' > /logs/verifier/reward.json; "
        "mkdir -p /tests && echo 'echo 1 > /logs/verifier/reward.txt' > /tests/test.sh"
    )
    assert box.read_log("verifier/reward.txt") == b"1\n"  # the plant did land
    result = grade_terminal(box, task)
    assert result.reward == 0.0, result.reason
    box.exec("echo 'hello world' > /app/hello.txt")
    assert grade_terminal(box, task).reward == 1.0


def test_the_sandbox_is_removed_when_an_episode_fails(backend):
    box = open_box(backend)
    box.exec("echo x > /app/x")
    with pytest.raises(RuntimeError, match="episode failed"), box:
        raise RuntimeError("episode failed")
    if hasattr(box, "uid"):
        assert not box.host_workdir.exists()
    else:
        import docker  # noqa: PLC0415

        with pytest.raises(docker.errors.NotFound):
            docker.from_env().containers.get(box._container.id)
