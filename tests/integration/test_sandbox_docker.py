"""The Docker sandbox against a real daemon: isolation, limits, files, a graded task.

Skipped when no daemon answers. Process checks look inside the container through /proc
(slim images have no ``ps``), since with a remote daemon the host cannot see them.
"""

from __future__ import annotations

import uuid

import docker
import pytest

from tests.integration.test_grading import CHECK, make_task
from thundersync_core.rollout.grading import grade_terminal
from thundersync_core.rollout.sandbox import SandboxLimits, SandboxUnavailable
from thundersync_core.rollout.sandbox.docker_backend import DockerSandbox, connect_docker
from thundersync_core.rollout.sandbox.output import elision_marker

pytestmark = pytest.mark.integration

KILL_SLACK_S = 8.0
# Output travels through the daemon's API; 100 MB is enough to prove the bound holds
# while keeping the test short on a slow daemon.
OUTPUT_BYTES = 100_000_000


@pytest.fixture(scope="module")
def client():
    try:
        return connect_docker()
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def box(client):
    try:
        sandbox = DockerSandbox(SandboxLimits(timeout_s=30, max_processes=128), client=client)
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    yield sandbox
    sandbox.close()


def processes_in(box: DockerSandbox, text: str) -> str:
    # "[x]" matches x, so the pattern does not match this command's own processes.
    pattern = f"{text[:-1]}[{text[-1]}]"
    found = box.exec(f"grep -l '{pattern}' /proc/[0-9]*/cmdline 2>/dev/null || true")
    return found.stdout.strip()


def test_exec_files_stdin_and_env(box, tmp_path):
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "a.txt").write_text("from host\n")
    box.copy_in(tmp_path / "proj")
    box.write_file("sub/b.bin", bytes(range(256)))
    result = box.exec("pwd; cat a.txt; echo $GREETING; cat -", env={"GREETING": "hi"}, stdin="in")
    assert result.stdout == "/app\nfrom host\nhi\nin"
    assert box.read_file("sub/b.bin") == bytes(range(256))
    with pytest.raises(FileNotFoundError):
        box.read_file("missing")
    assert (box.pull_workdir() / "a.txt").read_text() == "from host\n"


def test_no_network(box):
    probe = (
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('1.1.1.1', 53), timeout=3).close(); print('CONNECTED')\n"
        "except OSError:\n"
        "    print('blocked')\n"
    )
    result = box.exec(["python3", "-c", probe])
    assert result.stdout.strip() == "blocked"


def test_fork_bomb_and_loop_are_stopped(box):
    marker = f"tsmark{uuid.uuid4().hex}"
    result = box.exec(f": {marker}; bomb() {{ bomb | bomb & }}; bomb; sleep 60", timeout_s=3)
    assert result.timed_out
    assert result.killed_reason == "timeout"
    assert result.duration_s < 3 + KILL_SLACK_S
    loop = box.exec(f": {marker}; while :; do :; done", timeout_s=2)
    assert loop.timed_out
    assert loop.duration_s < 2 + KILL_SLACK_S
    assert processes_in(box, marker) == ""


def test_a_timed_out_commands_session_leavers_die_too(box):
    marker = f"tsmark{uuid.uuid4().hex}"
    # The check is real: without the timeout, the detached loop outlives its exec.
    box.exec(f"setsid sh -c ': {marker}; sleep 30' > /dev/null 2>&1 < /dev/null &")
    assert processes_in(box, marker) != ""
    box.exec(f"pkill -f {marker[:-1]}[{marker[-1]}] || true")
    result = box.exec(f"setsid sh -c ': {marker}; while :; do :; done' & sleep 60", timeout_s=2)
    assert result.timed_out
    assert processes_in(box, marker) == ""


def test_output_is_bounded(box):
    result = box.exec(f"head -c {OUTPUT_BYTES} /dev/zero | tr '\\0' a", timeout_s=120)
    budget = box.limits.output_bytes
    assert result.exit_code == 0
    assert result.stdout_bytes == OUTPUT_BYTES
    assert len(result.stdout) <= budget + len(elision_marker(OUTPUT_BYTES))
    assert result.output_truncated


def test_memory_limit(client):
    with DockerSandbox(SandboxLimits(memory_mb=256), client=client) as box:
        result = box.exec(["python3", "-c", "b = b'x' * (2 * 1024**3); print('allocated')"])
    assert result.exit_code != 0
    assert "allocated" not in result.stdout
    assert result.killed_reason == "memory"


def test_close_removes_the_container(client):
    box = DockerSandbox(client=client)
    container_id = box._container.id
    box.close()
    box.close()
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(container_id)


def test_graded_terminal_task(box, tmp_path):
    task = make_task(tmp_path / "hello", f"{CHECK} && echo 1 > /logs/verifier/reward.txt")
    box.exec("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt")
    assert grade_terminal(box, task).reward == 0.0
    box.exec("echo 'hello world' > /app/hello.txt")
    assert grade_terminal(box, task).reward == 1.0
