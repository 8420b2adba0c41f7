"""toyterm tasks validated in real bubblewrap sandboxes: no-op scores 0, reference scores 1.

One task of every family is validated as generated. Then the validator itself is tested
on tasks broken on purpose, so that a pass above cannot come from a validator that accepts
everything: a verifier that a no-op already passes, a reference solution that only forges
the reward file, one that writes a wrong answer, and a folder without a verifier.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from data_prep.generators.toyterm import generate
from data_prep.generators.toyterm_families import FAMILIES
from data_prep.validate_terminal import validate_many, validate_task

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("bwrap") is None,
        reason="bwrap not installed (Debian package 'bubblewrap'; `make test` installs it as root)",
    ),
]

ALWAYS_PASSES = "#!/bin/bash\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n"
FORGES_REWARD = (
    "#!/bin/bash\nmkdir -p /logs/verifier\n"
    "echo 1 > /logs/verifier/reward.txt\necho '{\"reward\": 1}' > /logs/verifier/reward.json\n"
)


@pytest.fixture(scope="module")
def one_per_family(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return generate(tmp_path_factory.mktemp("toyterm"), n_tasks=len(FAMILIES), seed=1)


def _copy(task: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(task, tmp_path / task.name))


def _task(tasks: list[Path], family: str) -> Path:
    return next(task for task in tasks if task.name.startswith(f"toyterm-{family}-"))


def test_one_task_per_family_validates(one_per_family: list[Path]) -> None:
    verdicts = validate_many(one_per_family, workers=2, progress=False)
    assert [v.record_id for v in verdicts] == [t.name for t in one_per_family]
    failed = {v.record_id: v.reason for v in verdicts if not v.ok}
    assert not failed
    for verdict in verdicts:
        assert verdict.details["noop"]["reward"] == 0.0
        assert verdict.details["reference"]["reward"] == 1.0
        assert verdict.details["reference"]["solution"]["exit_code"] == 0


def test_a_verifier_the_noop_passes_is_rejected(one_per_family: list[Path], tmp_path: Path) -> None:
    task = _copy(_task(one_per_family, "oneliner"), tmp_path)
    (task / "tests" / "test.sh").write_text(ALWAYS_PASSES)
    verdict = validate_task(task)
    assert not verdict.ok
    problems = verdict.reason.split(": ", 1)[1]
    assert problems.startswith("the no-op scores 1")
    assert "reference" not in problems


@pytest.mark.parametrize(
    ("solve_sh", "expected"),
    [
        (FORGES_REWARD, "does not exist"),
        ('\nfor f in *_count.txt; do echo 999999 > "$f"; done\n', "expected the number"),
    ],
    ids=["forges-reward", "wrong-output"],
)
def test_a_failing_reference_is_rejected(
    one_per_family: list[Path], tmp_path: Path, solve_sh: str, expected: str
) -> None:
    task = _copy(_task(one_per_family, "count"), tmp_path)
    reference = task / "solution" / "solve.sh"
    # A fragment without a shebang is appended to the real reference (a wrong last step).
    reference.write_text(
        solve_sh if solve_sh.startswith("#!") else reference.read_text() + solve_sh
    )
    verdict = validate_task(task)
    assert not verdict.ok
    problems = verdict.reason.split(": ", 1)[1]
    assert problems.startswith("the reference solution scores 0")
    assert expected in problems
    assert "no-op" not in problems


def test_a_malformed_task_is_named(one_per_family: list[Path], tmp_path: Path) -> None:
    task = _copy(_task(one_per_family, "grep"), tmp_path)
    (task / "tests" / "test.sh").unlink()
    verdict = validate_task(task)
    assert not verdict.ok
    assert "malformed" in verdict.reason
    assert "tests/test.sh" in verdict.reason


def test_the_verifier_spares_what_started_before_test_sh(one_per_family: list[Path]) -> None:
    """The checks kill strays younger than ``test.sh`` (the forgery tests' daemons), never an
    older process: unbounded, the hunt would reach the verifier's oldest ancestor, which
    outside a sandbox is everything the login session started since."""
    from thundersync_core.rollout.sandbox.local import LocalSandbox  # noqa: PLC0415

    task = _task(one_per_family, "count")
    with LocalSandbox(workdir_from=task / "environment") as box:
        box.install_tests(task / "tests")
        run = box.exec(
            "sleep 30 & older=$!\n"
            "sleep 0.05\n"
            "bash /tests/test.sh > /dev/null 2>&1\n"
            "kill -0 $older 2>/dev/null && echo older-alive\n"
            "cat /logs/verifier/reward.txt\n",
            timeout_s=60,
        )
    assert run.stdout.split() == ["older-alive", "0"]  # nothing in /app: the check failed
