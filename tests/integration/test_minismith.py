"""minismith end to end in real local sandboxes: generate, then validate executably.

Instances generated from the built-in ``textkit`` project must validate, come out
byte-identical with another worker count, and never quote their patch in the issue text.
Records that lie (a FAIL_TO_PASS test the bug does not break, a PASS_TO_PASS test that
fails, a FAIL_TO_PASS test failing on the clean tree too) must be rejected naming that test.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from data_prep.generators.minismith import (
    PROJECTS_DIR,
    generate,
    make_patch,
    store_snapshot,
    tree_digest,
)
from data_prep.validate_swe import repo_snapshot_lookup, validate_many

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("bwrap") is None,
        reason="bwrap not installed (Debian package 'bubblewrap'; `make test` installs it as root)",
    ),
]

PROJECT = PROJECTS_DIR / "textkit"
FIELDS = [
    "instance_id",
    "repo",
    "patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "image_name",
    "base_commit",
    "problem_statement",
    "created_at",
]
CALC = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
CALC_TESTS = """\
from calc import add, mul


def test_add():
    assert add(2, 3) == 5


def test_mul():
    assert mul(2, 3) == 6


def test_always_fails():
    assert add(1, 1) == 3
"""
ADD, MUL, ALWAYS_FAILS = (
    f"tests/test_calc.py::{name}" for name in ("test_add", "test_mul", "test_always_fails")
)


@pytest.fixture(scope="module")
def generated() -> list[dict]:
    return generate([PROJECT], seed=0, max_per_project=3, workers=2, progress=False)


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("repos")
    store_snapshot(PROJECT, root)
    return root


@pytest.fixture(scope="module")
def calc_repo(tmp_path_factory) -> tuple[Path, str]:
    """A hand-made repository stored like a snapshot: ``<root>/<repo>/<base_commit>``."""
    source = tmp_path_factory.mktemp("calc-source")
    (source / "calc.py").write_text(CALC)
    (source / "tests").mkdir()
    (source / "tests" / "test_calc.py").write_text(CALC_TESTS)
    base_commit = tree_digest(source)
    root = tmp_path_factory.mktemp("calc-repos")
    shutil.copytree(source, root / "local" / "calc" / base_commit)
    return root, base_commit


def calc_record(base_commit: str, name: str, **fields) -> dict:
    bugged = CALC.replace("a + b", "a - b")
    return {
        "instance_id": name,
        "repo": "local/calc",
        "base_commit": base_commit,
        "patch": make_patch("calc.py", CALC, bugged),
        "FAIL_TO_PASS": [ADD],
        "PASS_TO_PASS": [MUL],
    } | fields


def test_records_follow_the_schema(generated):
    assert len(generated) == 3
    assert [r["instance_id"] for r in generated] == sorted(r["instance_id"] for r in generated)
    base_commit = tree_digest(PROJECT)
    for record in generated:
        assert list(record) == FIELDS
        assert record["repo"] == "minismith/textkit"
        assert record["image_name"] == ""
        assert record["base_commit"] == base_commit
        assert re.fullmatch(
            rf"textkit\.{base_commit}\.[a-z_]+__[0-9a-f]{{10}}", record["instance_id"]
        )
        assert record["FAIL_TO_PASS"]
        assert not set(record["FAIL_TO_PASS"]) & set(record["PASS_TO_PASS"])
        added = [line[1:].strip() for line in record["patch"].splitlines() if line.startswith("+")]
        assert not any(line and line in record["problem_statement"] for line in added[1:])


def test_generation_is_byte_identical_across_worker_counts(generated):
    again = generate([PROJECT], seed=0, max_per_project=3, workers=1, progress=False)
    assert json.dumps(again) == json.dumps(generated)


def test_generated_records_validate(generated, repos):
    verdicts = validate_many(generated, repo_snapshot_lookup(repos), progress=False)
    assert [v.record_id for v in verdicts] == [r["instance_id"] for r in generated]
    assert all(v.ok for v in verdicts), [v.reason for v in verdicts if not v.ok]
    for verdict, record in zip(verdicts, generated, strict=True):
        assert set(verdict.details["bugged"]) == {*record["FAIL_TO_PASS"], *record["PASS_TO_PASS"]}


def test_lying_records_are_rejected_naming_the_test(generated, repos, calc_repo):
    calc_root, calc_commit = calc_repo
    record = generated[0]
    not_broken = record["PASS_TO_PASS"][0]
    as_strings = record | {
        "FAIL_TO_PASS": json.dumps(record["FAIL_TO_PASS"]),
        "PASS_TO_PASS": json.dumps(record["PASS_TO_PASS"]),
    }
    cases = [
        as_strings,
        record
        | {"FAIL_TO_PASS": [*record["FAIL_TO_PASS"], not_broken]}
        | {"PASS_TO_PASS": record["PASS_TO_PASS"][1:]},
        calc_record(calc_commit, "calc-ok"),
        calc_record(calc_commit, "calc-p2p-fails", PASS_TO_PASS=[MUL, ALWAYS_FAILS]),
        calc_record(calc_commit, "calc-f2p-fails-clean", FAIL_TO_PASS=[ADD, ALWAYS_FAILS]),
        calc_record("0000", "calc-missing"),
        calc_record(
            calc_commit, "calc-bad-patch", patch=make_patch("calc.py", "x = 1\n", "x = 2\n")
        ),
    ]
    lookup = repo_snapshot_lookup(repos)
    calc_lookup = repo_snapshot_lookup(calc_root)
    verdicts = validate_many(
        cases, lambda r: lookup(r) or calc_lookup(r), progress=False, timeout_s=60
    )
    by_id = {v.record_id: v for v in verdicts[2:]}
    assert verdicts[0].ok, verdicts[0].reason
    assert not verdicts[1].ok
    assert verdicts[1].reason == (
        f"FAIL_TO_PASS test {not_broken} passes with the patch applied; it must fail"
    )
    assert by_id["calc-ok"].ok, by_id["calc-ok"].reason
    assert by_id["calc-p2p-fails"].reason == (
        f"PASS_TO_PASS test {ALWAYS_FAILS} fails with the patch applied (failed)"
    )
    assert by_id["calc-f2p-fails-clean"].reason == (
        f"FAIL_TO_PASS test {ALWAYS_FAILS} does not pass on the clean tree (failed)"
    )
    assert by_id["calc-missing"].reason == "repository snapshot unavailable: local/calc@0000"
    assert by_id["calc-bad-patch"].reason.startswith("the patch does not apply to the snapshot")
    assert not any(by_id[name].ok for name in by_id if name != "calc-ok")
