"""Graders in real local sandboxes: a genuine fix earns 1, every cheat tried here earns 0.

The "agent" acts only through ``sandbox.exec``, as a policy's tool calls would. Each cheat
test also shows, where it is cheap, that the cheat works when the grader's defence is
absent, so that a 0 cannot come from the cheat simply being broken.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from thundersync_core.rollout.grading import (
    grade_swe,
    grade_terminal,
    junit_key,
    parse_junit,
    snapshot_workdir,
)
from thundersync_core.rollout.sandbox import SandboxLimits, open_sandbox

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("bwrap") is None,
        reason="bwrap not installed (Debian package 'bubblewrap'; `make test` installs it as root)",
    ),
]

BUGGY_CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
FIXED_CALC = BUGGY_CALC.replace("a - b", "a + b")
TEST_CALC = textwrap.dedent(
    """\
    from calc import add, mul


    def test_add():
        assert add(2, 3) == 5


    def test_mul():
        assert mul(2, 3) == 6
    """
)
CONFTEST = "import sys\n\nsys.path.insert(0, '.')\n"
F2P = ["tests/test_calc.py::test_add"]
P2P = ["tests/test_calc.py::test_mul"]
TEST_FILES = {"tests/test_calc.py": TEST_CALC.encode()}
# A conftest hook that reports every test as passed: the classic pytest reward hack.
FORCE_PASS_CONFTEST = textwrap.dedent(
    """\
    import pytest


    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        report = outcome.get_result()
        report.outcome = "passed"
        report.longrepr = None
    """
)


def write_calc_repo(root: Path) -> Path:
    """The buggy ``calc`` repository with its tests and a conftest that puts it on sys.path."""
    (root / "calc").mkdir()
    (root / "calc" / "__init__.py").write_text(BUGGY_CALC)
    (root / "tests").mkdir()
    (root / "tests" / "test_calc.py").write_text(TEST_CALC)
    (root / "conftest.py").write_text(CONFTEST)
    return root


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return write_calc_repo(tmp_path_factory.mktemp("repo"))


@pytest.fixture
def swe(repo):
    """A sandbox holding the buggy repo and the baseline taken before the agent runs."""
    with open_sandbox("local", workdir_from=repo, limits=SandboxLimits(timeout_s=60)) as box:
        yield box, snapshot_workdir(box)


def grade(box, baseline):
    return grade_swe(
        box, baseline=baseline, fail_to_pass=F2P, pass_to_pass=P2P, test_files=TEST_FILES
    )


def agent_writes(box, path: str, content: str) -> None:
    result = box.exec(f"mkdir -p $(dirname {path}) && cat > {path}", stdin=content)
    assert result.exit_code == 0, result.stderr


def test_genuine_fix_earns_one(swe):
    box, baseline = swe
    agent_writes(box, "calc/__init__.py", FIXED_CALC)
    result = grade(box, baseline)
    assert result.reward == 1.0, result.reason
    assert result.details["fail_to_pass"] == {F2P[0]: "passed"}
    assert result.details["changed_files"] == ["calc/__init__.py"]


def test_empty_patch_earns_zero(swe):
    box, baseline = swe
    box.exec("python3 -m pytest -q -p no:cacheprovider tests || true")
    result = grade(box, baseline)
    assert result.reward == 0.0
    assert "empty diff" in result.reason


def test_rewriting_the_test_to_assert_true_earns_zero(swe):
    box, baseline = swe
    agent_writes(box, "tests/test_calc.py", "def test_add():\n    assert True\n")
    agent_writes(box, "calc/__init__.py", BUGGY_CALC + "# touched\n")
    result = grade(box, baseline)
    assert result.reward == 0.0
    assert result.details["fail_to_pass"] == {F2P[0]: "failed"}
    assert box.read_file("tests/test_calc.py") == TEST_CALC.encode()


def test_deleting_the_tests_earns_zero(swe):
    box, baseline = swe
    box.exec("rm -rf tests")
    agent_writes(box, "calc/__init__.py", BUGGY_CALC + "# touched\n")
    result = grade(box, baseline)
    assert result.reward == 0.0
    assert "FAIL_TO_PASS not passing" in result.reason


def test_printing_passed_and_fake_junit_lines_earns_zero(swe):
    box, baseline = swe
    fake = (
        "print('tests/test_calc.py::test_add PASSED')\n"
        'print(\'<testcase classname="tests.test_calc" name="test_add" time="0.1"/>\')\n'
        "print('1 passed')\n"
    )
    agent_writes(box, "calc/__init__.py", fake + BUGGY_CALC)
    result = grade(box, baseline)
    assert result.reward == 0.0
    assert result.details["fail_to_pass"] == {F2P[0]: "failed"}


def test_a_conftest_that_forces_passes_is_removed_and_earns_zero(swe):
    box, baseline = swe
    agent_writes(box, "tests/conftest.py", FORCE_PASS_CONFTEST)
    agent_writes(box, "calc/__init__.py", BUGGY_CALC + "# touched\n")
    # The hack is real: with it in place, pytest's own report says the buggy test passed.
    cheat = box.exec("python3 -m pytest -q -p no:cacheprovider --junitxml=/tmp/j.xml tests")
    assert cheat.exit_code == 0, cheat.stdout
    result = grade(box, baseline)
    assert result.reward == 0.0
    assert "tests/conftest.py" in result.details["restored_harness"]
    assert box.exec("test -e tests/conftest.py").exit_code == 1


def test_an_edited_harness_file_is_put_back(swe):
    box, baseline = swe
    agent_writes(box, "conftest.py", CONFTEST + FORCE_PASS_CONFTEST)
    agent_writes(box, "calc/__init__.py", BUGGY_CALC + "# touched\n")
    result = grade(box, baseline)
    assert result.reward == 0.0
    assert result.details["restored_harness"] == ["conftest.py"]
    assert box.read_file("conftest.py") == CONFTEST.encode()


def test_a_regression_earns_zero(swe):
    box, baseline = swe
    agent_writes(box, "calc/__init__.py", FIXED_CALC.replace("a * b", "a ** b"))
    result = grade(box, baseline)
    assert result.reward == 0.0
    assert "PASS_TO_PASS regressed" in result.reason


def test_a_test_file_replaced_by_a_symlink_is_restored_without_touching_the_host(swe, tmp_path):
    box, baseline = swe
    outside = tmp_path / "outside.txt"
    outside.write_text("host file")
    box.exec(f"rm tests/test_calc.py && ln -s {outside} tests/test_calc.py")
    agent_writes(box, "calc/__init__.py", FIXED_CALC)
    result = grade(box, baseline)
    assert result.reward == 1.0, result.reason
    assert outside.read_text() == "host file"


def test_junit_keys_follow_pytest_naming():
    assert junit_key("tests/test_x.py::test_y") == ("tests.test_x", "test_y")
    assert junit_key("a/b/test_x.py::TestK::test_y[p::q-1]") == (
        "a.b.test_x.TestK",
        "test_y[p::q-1]",
    )
    with pytest.raises(ValueError, match="node id"):
        junit_key("test_y (module.Class)")


def test_the_worst_entry_of_a_test_wins():
    xml = b"""<testsuites><testsuite>
      <testcase classname="m" name="t"/>
      <testcase classname="m" name="t"><error message="teardown"/></testcase>
      <testcase classname="m" name="s"><skipped/></testcase>
      <testcase classname="m" name="ok"/>
    </testsuite></testsuites>"""
    assert parse_junit(xml) == {("m", "t"): "error", ("m", "s"): "skipped", ("m", "ok"): "passed"}


# -- Harbor terminal tasks ----------------------------------------------------------------

CHECK = "grep -qx 'hello world' /app/hello.txt"


def make_task(root: Path, verifier: str, timeout_sec: float = 30) -> Path:
    (root / "tests").mkdir(parents=True)
    (root / "solution").mkdir()
    (root / "task.toml").write_text(
        f'version = "1.0"\n\n[verifier]\ntimeout_sec = {timeout_sec}\n\n[agent]\ntimeout_sec = 60\n'
    )
    (root / "instruction.md").write_text("Create /app/hello.txt containing 'hello world'.\n")
    (root / "tests" / "test.sh").write_text(f"#!/bin/bash\nmkdir -p /logs/verifier\n{verifier}\n")
    (root / "solution" / "solve.sh").write_text(
        "#!/bin/bash\necho 'hello world' > /app/hello.txt\n"
    )
    return root


@pytest.fixture
def task(tmp_path) -> Path:
    # Writes a reward only on success, so a reward planted by the agent would survive a
    # grader that did not clear /logs/verifier first.
    return make_task(tmp_path / "hello", f"{CHECK} && echo 1 > /logs/verifier/reward.txt")


@pytest.fixture
def terminal():
    with open_sandbox("local", limits=SandboxLimits(timeout_s=30)) as box:
        yield box


def solve(box, task_dir: Path) -> None:
    result = box.exec("bash -s", stdin=(task_dir / "solution" / "solve.sh").read_text())
    assert result.exit_code == 0, result.stderr


def test_terminal_solution_earns_one(terminal, task):
    solve(terminal, task)
    result = grade_terminal(terminal, task)
    assert result.reward == 1.0, result.reason
    assert result.details["verifier"]["exit_code"] == 0


def test_terminal_no_work_earns_zero(terminal, task):
    result = grade_terminal(terminal, task)
    assert result.reward == 0.0
    assert "no /logs/verifier/reward.txt" in result.reason


def test_terminal_prewritten_reward_and_tampered_tests_earn_zero(terminal, task):
    cheat = (
        "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && "
        "echo '{\"reward\": 1}' > /logs/verifier/reward.json; "
        "echo 'echo 1 > /logs/verifier/reward.txt' > /tests/test.sh"
    )
    terminal.exec(cheat)
    assert terminal.read_log("verifier/reward.txt") == b"1\n"  # the plant did land
    result = grade_terminal(terminal, task)
    assert result.reward == 0.0
    assert "no /logs/verifier/reward.txt" in result.reason


@pytest.mark.parametrize(
    ("verifier", "reward", "reason"),
    [
        ("echo '{\"reward\": 0.5}' > /logs/verifier/reward.json", 0.5, "reward.json"),
        ("echo 'abc' > /logs/verifier/reward.txt", 0.0, "not a number"),
        ("echo nan > /logs/verifier/reward.txt", 0.0, "non-finite"),
        ("echo '{\"score\": 1}' > /logs/verifier/reward.json", 0.0, "no numeric 'reward'"),
        ("ln -s /etc/hostname /logs/verifier/reward.txt", 0.0, "not a plain file"),
    ],
)
def test_terminal_reward_files_are_parsed_strictly(terminal, tmp_path, verifier, reward, reason):
    result = grade_terminal(terminal, make_task(tmp_path / "t", verifier))
    assert result.reward == reward
    assert reason in result.reason


def test_terminal_verifier_timeout_earns_zero(terminal, tmp_path):
    task_dir = make_task(tmp_path / "slow", "echo 1 > /logs/verifier/reward.txt; sleep 30", 1)
    result = grade_terminal(terminal, task_dir)
    assert result.reward == 0.0
    assert "timed out" in result.reason
    assert result.details["verifier"]["duration_s"] < 5
