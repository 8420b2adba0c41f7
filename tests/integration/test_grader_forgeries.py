"""Forged rewards, tried as a policy would, on both sandbox backends: each must earn 0.

The "agent" acts only through ``sandbox.exec`` with the bug left in place (plus a trivial
source edit, so that the empty-diff rule is not what stops it), then the real grader runs.
Where it is cheap, a probe first shows that its forgery works against the same runner
called the naive way (``python3 -m pytest`` in the workdir, a background writer alive
after the agent's command), so that a 0 cannot come from a forgery that was simply
broken. A genuine fix still earns 1 on each backend.
"""

from __future__ import annotations

import re
import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from data_prep.generators.toyterm import generate
from tests.integration.test_grading import (
    BUGGY_CALC,
    CHECK,
    F2P,
    FIXED_CALC,
    FORCE_PASS_CONFTEST,
    P2P,
    TEST_FILES,
    make_task,
    write_calc_repo,
)
from thundersync_core.rollout.grading import grade_swe, grade_terminal, snapshot_workdir
from thundersync_core.rollout.sandbox import (
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
    open_sandbox,
)

pytestmark = pytest.mark.integration

BACKENDS = ["local", "docker"]
# A JUnit report in which both calc tests passed.
FORGED_JUNIT = (
    "<testsuites><testsuite>"
    '<testcase classname="tests.test_calc" name="test_add"/>'
    '<testcase classname="tests.test_calc" name="test_mul"/>'
    "</testsuite></testsuites>"
)
# Python that, wherever it runs in a pytest process, writes the forged report to the path
# given by --junitxml at exit and ends the process with status 0.
FORGE = textwrap.dedent(
    f"""\
    import atexit, os, sys

    def _forge():
        for arg in sys.argv:
            if arg.startswith('--junitxml='):
                path = arg.split('=', 1)[1]
                os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
                with open(path, 'w') as out:
                    out.write({FORGED_JUNIT!r})
        os._exit(0)

    if any(arg.startswith('--junitxml=') for arg in sys.argv):
        atexit.register(_forge)
    """
)
# Run as ``python -m pytest``: writes the report straight away.
FAKE_PYTEST = FORGE.replace("atexit.register(_forge)", "_forge()")
TOUCHED = BUGGY_CALC + "# touched\n"


def open_box(backend: str, **kwargs) -> Sandbox:
    try:
        return open_sandbox(backend, limits=SandboxLimits(timeout_s=60), **kwargs)
    except SandboxUnavailable as exc:
        if backend == "local" and shutil.which("bwrap") is not None:
            raise
        pytest.skip(f"{backend} sandbox unavailable: {exc}")


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return write_calc_repo(tmp_path_factory.mktemp("repo"))


@pytest.fixture(params=BACKENDS)
def swe(request, repo) -> Iterator[tuple[Sandbox, object]]:
    with open_box(request.param, workdir_from=repo) as box:
        yield box, snapshot_workdir(box)


def grade(box, baseline):
    return grade_swe(
        box, baseline=baseline, fail_to_pass=F2P, pass_to_pass=P2P, test_files=TEST_FILES
    )


def agent(box, command: str, stdin: str | None = None) -> str:
    result = box.exec(command, stdin=stdin)
    return result.stdout + result.stderr


def agent_writes(box, path: str, content: str) -> None:
    result = box.exec(f'mkdir -p "$(dirname "{path}")" && cat > "{path}"', stdin=content)
    assert result.exit_code == 0, result.stderr


def assert_the_bug_still_fails(result) -> None:
    assert result.reward == 0.0, result.reason
    assert result.details["fail_to_pass"] == {F2P[0]: "failed"}


def naive_run_passes(box) -> bool:
    """Does the forgery fool pytest run the usual way, from the workdir?"""
    box.exec(
        "rm -f /tmp/naive.xml; python3 -m pytest -q -p no:cacheprovider "
        "--junitxml=/tmp/naive.xml tests/test_calc.py"
    )
    report = box.exec("cat /tmp/naive.xml 2>/dev/null").stdout
    return 'name="test_add"' in report and "<failure" not in report


def user_site(box) -> tuple[str, bool]:
    """The user site-packages folder and whether the agent's python3 reads it (a venv's not)."""
    probe = "import site; print(site.getusersitepackages()); print(bool(site.ENABLE_USER_SITE))"
    folder, enabled = box.exec(["python3", "-c", probe]).stdout.split()
    return folder, enabled == "True"


def test_a_genuine_fix_earns_one(swe):
    box, baseline = swe
    agent_writes(box, "calc/__init__.py", FIXED_CALC)
    result = grade(box, baseline)
    assert result.reward == 1.0, result.reason


@pytest.mark.parametrize(
    "plant",
    [
        {"pytest.py": FAKE_PYTEST},
        {"pytest/__init__.py": "", "pytest/__main__.py": FAKE_PYTEST},
    ],
    ids=["pytest-module", "pytest-package"],
)
def test_a_shadowed_test_runner_earns_zero(swe, plant):
    box, baseline = swe
    for path, content in plant.items():
        agent_writes(box, path, content)
    agent_writes(box, "calc/__init__.py", TOUCHED)
    assert naive_run_passes(box)
    assert_the_bug_still_fails(grade(box, baseline))


@pytest.mark.parametrize(
    "path",
    [
        "tests/conftest.py",
        "tests/__init__.py",
        "sitecustomize.py",
        "usercustomize.py",
        "calc.pth",
    ],
)
def test_planted_start_up_and_collection_hooks_earn_zero(swe, path):
    box, baseline = swe
    content = FORCE_PASS_CONFTEST if path.endswith("conftest.py") else FORGE
    content = f"import calc_forge  # {content}" if path.endswith(".pth") else content
    agent_writes(box, path, content)
    agent_writes(box, "calc/__init__.py", TOUCHED)
    result = grade(box, baseline)
    assert result.reward == 0.0, result.reason
    if not path.endswith(".pth"):
        assert box.exec(f"test -e {path}").exit_code == 1


@pytest.mark.parametrize("name", ["pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml"])
def test_a_planted_pytest_configuration_is_removed(swe, name):
    box, baseline = swe
    agent_writes(box, name, "[pytest]\npython_functions = nothing_at_all\n")
    agent_writes(box, "calc/__init__.py", FIXED_CALC)
    result = grade(box, baseline)
    assert name in result.details["restored_harness"]
    # Removed before the run, so a real fix still counts.
    assert result.reward == 1.0, result.reason


def test_hooks_in_the_users_site_packages_earn_zero(swe):
    box, baseline = swe
    site, enabled = user_site(box)
    agent_writes(box, f"{site}/usercustomize.py", FORGE)
    agent_writes(box, f"{site}/forge.pth", "import usercustomize\n")
    agent_writes(box, "calc/__init__.py", TOUCHED)
    assert naive_run_passes(box) == enabled
    result = grade(box, baseline)
    assert result.reward == 0.0, result.reason


def test_a_hook_in_the_interpreters_own_site_packages_earns_zero(swe):
    box, baseline = swe
    # Root in a Docker container can write the image's site-packages; the local sandbox's
    # system folders are read-only, so there the plant fails (and the grade is the same).
    site = box.exec(["python3", "-c", "import site; print(site.getsitepackages()[0])"])
    planted = box.exec(f"cat > {site.stdout.strip()}/zz_forge.pth", stdin="import forge_calc\n")
    agent_writes(box, "calc/__init__.py", TOUCHED)
    if planted.exit_code == 0:
        agent(box, f"cat > {site.stdout.strip()}/forge_calc.py", stdin=FORGE)
        assert naive_run_passes(box)
    result = grade(box, baseline)
    assert result.reward == 0.0, result.reason


def test_reports_planted_in_advance_and_by_a_background_writer_earn_zero(swe):
    box, baseline = swe
    agent_writes(box, "/tmp/forged.xml", FORGED_JUNIT)
    for target in ("junit.xml", "report.xml", ".thundersync-grade-0/junit.xml"):
        agent_writes(box, target, FORGED_JUNIT)
    writer = (
        "while :; do for d in /logs/*/ /tmp/*/ /app/.*/; do cp /tmp/forged.xml $d/junit.xml;"
        " done 2>/dev/null; sleep 0.01; done"
    )
    agent(box, f"setsid sh -c '{writer}' > /dev/null 2>&1 < /dev/null &")
    agent_writes(box, "calc/__init__.py", TOUCHED)
    assert_the_bug_still_fails(grade(box, baseline))


@pytest.mark.parametrize(
    "cheat",
    [
        "printf 'def test_add():\\n    assert True\\n' > tests/test_calc.py",
        "rm -rf tests",
        "mkdir -p /tmp/fake && printf 'def test_add():\\n    pass\\n\\ndef test_mul():\\n"
        "    pass\\n' > /tmp/fake/test_calc.py && rm -rf tests && ln -s /tmp/fake tests",
    ],
    ids=["edited", "deleted", "symlinked-folder"],
)
def test_edited_deleted_or_redirected_tests_earn_zero(swe, cheat):
    box, baseline = swe
    agent(box, cheat)
    agent_writes(box, "calc/__init__.py", TOUCHED)
    result = grade(box, baseline)
    assert result.reward == 0.0, result.reason


# -- terminal tasks -------------------------------------------------------------------------


@pytest.fixture(params=BACKENDS)
def terminal(request) -> Iterator[Sandbox]:
    with open_box(request.param) as box:
        yield box


def test_read_only_folders_and_a_stopped_container_do_not_stop_grading(terminal, tmp_path):
    task = make_task(tmp_path / "hello", f"{CHECK} && echo 1 > /logs/verifier/reward.txt")
    agent(terminal, "mkdir -p /tmp/keep /logs/verifier/keep && chmod 500 /tmp/keep /logs/verifier")
    agent(terminal, "pkill -9 -x sleep; kill -9 1; true")  # Docker: tries to stop its container
    result = grade_terminal(terminal, task)
    assert result.reward == 0.0, result.reason
    terminal.exec("echo 'hello world' > /app/hello.txt")
    assert grade_terminal(terminal, task).reward == 1.0


REWARD_WRITER = (
    "while :; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; sleep 0.01; done"
)


def test_a_background_process_rewriting_the_reward_earns_zero(terminal, tmp_path):
    task = make_task(tmp_path / "hello", f"{CHECK} && echo 1 > /logs/verifier/reward.txt")
    agent(terminal, f"setsid sh -c '{REWARD_WRITER}' > /dev/null 2>&1 < /dev/null &")
    result = grade_terminal(terminal, task)
    assert result.reward == 0.0, result.reason
    terminal.exec("echo 'hello world' > /app/hello.txt")
    assert grade_terminal(terminal, task).reward == 1.0


@pytest.fixture(scope="module")
def script_task(tmp_path_factory) -> tuple[Path, str]:
    """A toyterm scripting task: its verifier runs the agent's script on hidden inputs."""
    (task,) = generate(tmp_path_factory.mktemp("toyterm"), n_tasks=1, families=["bashscript"])
    script = re.search(r"'script': '([^']+)'", (task / "tests" / "test_outputs.py").read_text())
    assert script is not None
    return task, script.group(1)


@pytest.mark.parametrize(
    "script",
    [
        "echo 1 > /logs/verifier/reward.txt; echo wrong",
        f"setsid sh -c '{REWARD_WRITER}' > /dev/null 2>&1 < /dev/null & echo wrong",
        "echo 1 > /logs/verifier/reward.txt; kill -9 $(pgrep -f /tests/test.sh)",
        "echo 1 > /logs/verifier/reward.txt; kill -9 $PPID",
    ],
    ids=["writes-reward", "reward-daemon", "kills-test-sh", "kills-checker"],
)
def test_an_agent_script_run_by_the_verifier_cannot_write_its_reward(terminal, script_task, script):
    task, name = script_task
    agent_writes(terminal, name, f"#!/bin/bash\n{script}\n")
    result = grade_terminal(terminal, task)
    assert result.reward == 0.0, result.reason
    solve = (task / "solution" / "solve.sh").read_text()
    assert terminal.exec("bash -s", stdin=solve).exit_code == 0
    assert grade_terminal(terminal, task).reward == 1.0


def test_a_replaced_interpreter_cannot_pass_a_workdir_only_verifier(
    terminal, script_task, tmp_path
):
    task, name = script_task
    # Root in a Docker container can put a python3 that always succeeds ahead of the real
    # one; the local sandbox's system folders are read-only, so there the plant fails.
    fake = "#!/bin/sh\nexit 0\n"
    planted = terminal.exec(
        "for d in /usr/local/bin /usr/bin; do cat > $d/python3 && chmod 755 $d/python3 || exit 1;"
        " done",
        stdin=fake,
    )
    agent_writes(terminal, name, "#!/bin/bash\necho wrong\n")
    if planted.exit_code == 0:
        # The hole is real where the verifier keeps the agent's filesystem.
        kept = shutil.copytree(task, tmp_path / "kept")
        toml = (kept / "task.toml").read_text().replace("workdir_only = true\n", "")
        (kept / "task.toml").write_text(toml)
        assert grade_terminal(terminal, kept).reward == 1.0
        agent(terminal, "cat > /usr/bin/python3", stdin=fake)  # grading reset nothing there
    result = grade_terminal(terminal, task)
    assert result.reward == 0.0, result.reason
