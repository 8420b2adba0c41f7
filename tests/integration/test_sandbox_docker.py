"""The Docker sandbox against a real daemon: files, the image, the CLI, a graded task.

The probes both backends share (network, limits, leftovers) are in test_sandbox_probes.py.
Skipped when no daemon answers. Process checks look inside the container through /proc
(slim images have no ``ps``), since with a remote daemon the host cannot see them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import docker
import pytest

from eval.swebench_eval import (
    InstanceImagesMissing,
    load_dataset_records,
    missing_images,
    prediction,
    run_docker_harness,
    write_predictions,
)
from tests.integration.test_grading import CHECK, make_task
from thundersync_core.rollout.grading import grade_terminal
from thundersync_core.rollout.sandbox import SandboxLimits, SandboxUnavailable
from thundersync_core.rollout.sandbox.docker_backend import (
    DEFAULT_IMAGE,
    DockerSandbox,
    connect_docker,
)
from thundersync_core.rollout.sandbox.image import RECIPE_LABEL, build_image, recipe_key

pytestmark = pytest.mark.integration


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


def test_a_timed_out_commands_session_leavers_die_too(box):
    marker = f"tsmark{uuid.uuid4().hex}"
    # The check is real: without the timeout, the detached loop outlives its exec.
    box.exec(f"setsid sh -c ': {marker}; sleep 30' > /dev/null 2>&1 < /dev/null &")
    assert processes_in(box, marker) != ""
    box.exec(f"pkill -f {marker[:-1]}[{marker[-1]}] || true")
    result = box.exec(f"setsid sh -c ': {marker}; while :; do :; done' & sleep 60", timeout_s=2)
    assert result.timed_out
    assert processes_in(box, marker) == ""


def test_the_agent_cannot_stop_its_container_and_orphans_are_reaped(box):
    box.exec("pkill -9 -x sleep; kill -9 1; kill -STOP 1; true")
    box.exec("for i in 1 2 3; do (sleep 0.1 &); done; sleep 0.5")
    # State field 3 of /proc/PID/stat; the container's own pid 1 is still the same shell.
    states = box.exec("cat /proc/[0-9]*/stat 2>/dev/null | cut -d' ' -f1-3").stdout.split("\n")
    assert not [line for line in states if line.endswith(" Z")], states
    assert "1 (sh) S" in states
    box._container.reload()
    assert box._container.status == "running"


def test_a_container_stopped_under_the_sandbox_is_started_again(box):
    # As an out-of-memory kill of its main process would: the next calls still work.
    box.write_file("kept.txt", "kept\n")
    box._container.kill()
    assert box.exec("cat kept.txt").stdout == "kept\n"
    box._container.kill()
    assert box.exec("echo $((6 * 7))", timeout_s=1).stdout == "42\n"


def test_close_removes_the_container(client):
    box = DockerSandbox(client=client)
    container_id = box._container.id
    box.close()
    box.close()
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(container_id)


def test_a_missing_image_is_named_with_the_command_that_builds_it(client):
    with pytest.raises(SandboxUnavailable, match=r"thundersync-no-such:0.*build-image --tag"):
        DockerSandbox(image="thundersync-no-such:0", client=client)


def test_the_image_is_built_once_per_recipe(box, client):
    # `box` exists, so the default image does: a second build finds it by its recipe.
    result = build_image(client=client)
    assert result == {"image": DEFAULT_IMAGE, "recipe": recipe_key(), "built": False}
    assert client.images.get(DEFAULT_IMAGE).labels[RECIPE_LABEL] == recipe_key()


def test_sandbox_exec_cli_runs_on_docker(box):
    cli = [sys.executable, "-m", "thundersync_core.cli", "sandbox", "exec", "--backend", "docker"]
    run = subprocess.run(
        [*cli, "--", "python3", "-m", "pytest", "--version"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["exit_code"] == 0


def test_graded_terminal_task(box, tmp_path):
    task = make_task(tmp_path / "hello", f"{CHECK} && echo 1 > /logs/verifier/reward.txt")
    box.exec("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt")
    assert grade_terminal(box, task).reward == 0.0
    box.exec("echo 'hello world' > /app/hello.txt")
    assert grade_terminal(box, task).reward == 1.0


VERIFIED = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "swe-bench-verified"


def test_swebench_harness_refuses_naming_the_instance_images_the_daemon_lacks(
    client, tmp_path, monkeypatch
):
    if not (VERIFIED / "test.parquet").is_file():
        pytest.skip(f"SWE-bench Verified fixtures absent: {VERIFIED} has no test.parquet")
    records = load_dataset_records(str(VERIFIED / "test.parquet"))
    chosen = records[:2]
    preds = write_predictions(
        tmp_path / "p.jsonl", [prediction(r["instance_id"], "", "m") for r in chosen]
    )
    monkeypatch.chdir(tmp_path)  # the harness would write logs/ under the working folder
    with pytest.raises(InstanceImagesMissing, match="2 of 2 SWE-bench instance images") as err:
        run_docker_harness(preds, dataset_name=str(VERIFIED), run_id="t")
    for record in chosen:
        assert record["image"] in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]  # refused before any work
    argv = [sys.executable, "-m", "thundersync_core.cli", "eval", "swebench-harness"]
    argv += ["--predictions", str(preds), "--dataset", str(VERIFIED), "--run-id", "t"]
    cli = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert cli.returncode == 1, cli.stderr
    assert "refused: 2 of 2 SWE-bench instance images" in cli.stderr
    # An image the daemon holds is not named (the sandbox image, tagged as one instance's).
    client.images.get(DEFAULT_IMAGE).tag(chosen[0]["image"])
    try:
        assert missing_images([r["image"] for r in chosen], client) == [chosen[1]["image"]]
    finally:
        client.images.remove(chosen[0]["image"])


def test_the_next_sandbox_removes_what_a_killed_process_left(client):
    # A rollout role killed mid-episode cannot close its containers; the next process that
    # opens a sandbox on this host removes them (and their staging folders).
    opener = (
        "import time\n"
        "from thundersync_core.rollout.sandbox.docker_backend import DockerSandbox\n"
        "box = DockerSandbox()\n"
        "print(box._container.name, box._staging, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", opener], stdout=subprocess.PIPE, text=True)
    try:
        name, staging = proc.stdout.readline().split()
    finally:
        proc.kill()
        proc.wait()
    assert client.containers.get(name).status == "running"  # nobody closed it
    assert Path(staging).is_dir()
    subprocess.run(
        [sys.executable, "-c", "from thundersync_core.rollout.sandbox.docker_backend import "
         "DockerSandbox\nDockerSandbox().close()\n"],
        check=True, timeout=120,
    )  # fmt: skip
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(name)
    assert not Path(staging).exists()
