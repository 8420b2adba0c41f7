"""SWE-bench log grading on the real SWE-smith logs, on both pytest log shapes, and reports.

The real logs in ../shared/data/swe-smith come with the reports SWE-smith wrote: each
must grade to the report's ``resolved`` and its exact test lists. The two pytest shapes
(``--verbose`` lines with a progress suffix, ``-rA`` summary lines) are checked on
synthetic logs whose parametrised ids hold spaces and brackets, where splitting a line
on whitespace would give a wrong id and fail the instance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.swebench_eval import (
    DockerUnavailable,
    InstanceError,
    LogGrade,
    docker_unavailable_reason,
    grade_log,
    load_instance,
    normalise_instance,
    parse_pytest_log,
    run_docker_harness,
    summary_report,
    validation_lists,
    write_predictions,
)
from thundersync_core.cli import main

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
SWE_SMITH = SHARED_DATA / "swe-smith"
needs_swe_smith = pytest.mark.skipif(
    not SWE_SMITH.is_dir(), reason=f"SWE-smith fixtures absent: {SWE_SMITH} is not a folder"
)


def evaluation_runs() -> list[Path]:
    root = SWE_SMITH / "run_evaluation"
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if (d / "test_output.txt").is_file())


def report_of(run_dir: Path) -> dict:
    report = json.loads((run_dir / "report.json").read_text())
    # swebench nests the report under the instance id; SWE-smith's is flat.
    return report.get(run_dir.name, report)


def instance_for(run_dir: Path, report: dict) -> dict:
    """The instance record beside the logs, else its test lists as the report states them."""
    record = SWE_SMITH / f"{run_dir.name}.json"
    if record.is_file():
        return load_instance(record)
    status = report["tests_status"]
    lists = {
        name: status[name]["success"] + status[name]["failure"]
        for name in ("FAIL_TO_PASS", "PASS_TO_PASS")
    }
    return normalise_instance({"instance_id": run_dir.name, **lists}, str(run_dir))


@needs_swe_smith
def test_fixtures_are_present():
    assert evaluation_runs(), f"no run_evaluation/*/test_output.txt under {SWE_SMITH}"


@needs_swe_smith
@pytest.mark.parametrize("run_dir", evaluation_runs(), ids=lambda p: p.name)
def test_swe_smith_logs_grade_as_their_reports_state(run_dir):
    report = report_of(run_dir)
    grade = grade_log(instance_for(run_dir, report), (run_dir / "test_output.txt").read_text())
    assert grade.problem is None
    assert grade.resolved is report["resolved"]
    for name in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        assert grade.tests_status[name] == report["tests_status"][name]


@needs_swe_smith
@pytest.mark.parametrize("run_dir", evaluation_runs(), ids=lambda p: p.name)
def test_one_failing_fail_to_pass_test_unresolves_a_real_log(run_dir):
    report = report_of(run_dir)
    instance = instance_for(run_dir, report)
    victim = instance["FAIL_TO_PASS"][0]
    log = (run_dir / "test_output.txt").read_text()
    assert f"{victim} PASSED" in log
    grade = grade_log(instance, log.replace(f"{victim} PASSED", f"{victim} FAILED"))
    assert not grade.resolved
    assert grade.tests_status["FAIL_TO_PASS"]["failure"] == [victim]


@needs_swe_smith
def test_validation_logs_reproduce_the_validation_report():
    root = SWE_SMITH / "run_validation"
    report = json.loads((root / "report.json").read_text())
    clean = (root / "test_output_pre_gold.txt").read_text()
    bugged = (root / "test_output.txt").read_text()
    lists = validation_lists(clean, bugged)
    for name in ("FAIL_TO_PASS", "PASS_TO_PASS", "FAIL_TO_FAIL", "PASS_TO_FAIL"):
        assert sorted(lists[name]) == sorted(report[name]), name
    instance = normalise_instance({"instance_id": "v", **report}, "report.json")
    assert grade_log(instance, clean).resolved
    bugged_grade = grade_log(instance, bugged)
    assert not bugged_grade.resolved
    assert sorted(bugged_grade.tests_status["FAIL_TO_PASS"]["failure"]) == sorted(
        report["FAIL_TO_PASS"]
    )


@needs_swe_smith
def test_cli_grades_a_real_log(capsys):
    instance = SWE_SMITH / "pandas-dev__pandas.95280573.pr_53652.json"
    log = SWE_SMITH / "run_evaluation" / instance.stem / "test_output.txt"
    assert main(["eval", "grade-swebench", "--instance", str(instance), "--log", str(log)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["resolved"] is True
    assert set(out["tests_status"]) == {"FAIL_TO_PASS", "PASS_TO_PASS"}
    assert len(out["tests_status"]["FAIL_TO_PASS"]["success"]) == 2


# -- the two log shapes -------------------------------------------------------------------

SPACED = "tests/test_fmt.py::test_pad[a b-[x]]"
PLAIN = "tests/test_fmt.py::TestPad::test_width"
BROKEN = "tests/test_fmt.py::test_strip[  lead]"
SKIPPED = "tests/test_fmt.py::test_unicode[é è]"

VERBOSE_LOG = f"""\
+ : '>>>>> Start Test Output'
+ pytest --disable-warnings --color=no --tb=no --verbose tests/test_fmt.py
============================= test session starts ==============================
collecting ... collected 4 items

{SPACED} PASSED [ 25%]
{PLAIN} \x1b[32mPASSED\x1b[0m   [ 50%]
{BROKEN} FAILED [ 75%]
{SKIPPED} SKIPPED (no locale) [100%]

========================= 1 failed, 2 passed, 1 skipped in 0.10s ===============
+ : '>>>>> End Test Output'
"""

SUMMARY_LOG = f"""\
>>>>> Start Test Output
+ pytest -rA tests/test_fmt.py
..F.s
=========================== short test summary info ============================
PASSED {SPACED}
PASSED {PLAIN}
FAILED {BROKEN} - AssertionError: assert ' lead' == 'lead'
SKIPPED [1] tests/test_fmt.py:40: no locale
========================= 1 failed, 2 passed, 1 skipped in 0.10s ===============
>>>>> End Test Output
"""

XDIST_LOG = f"""\
[gw0] [ 33%] PASSED {SPACED}
[gw1] [ 66%] PASSED {PLAIN}
[gw0] [100%] FAILED {BROKEN}
"""


def fmt_instance(fail_to_pass, pass_to_pass) -> dict:
    record = {"instance_id": "fmt-1", "FAIL_TO_PASS": fail_to_pass, "PASS_TO_PASS": pass_to_pass}
    return normalise_instance(record, "test")


@pytest.mark.parametrize(
    "log", [VERBOSE_LOG, SUMMARY_LOG, XDIST_LOG], ids=["verbose", "rA", "xdist"]
)
def test_both_shapes_keep_ids_with_spaces_and_brackets(log):
    status = parse_pytest_log(log)
    assert status[SPACED] == "PASSED"
    assert status[PLAIN] == "PASSED"
    assert status[BROKEN] == "FAILED"
    resolved = grade_log(fmt_instance([SPACED], [PLAIN]), log)
    assert resolved.resolved, resolved
    unresolved = grade_log(fmt_instance([SPACED, BROKEN], [PLAIN]), log)
    assert not unresolved.resolved
    assert unresolved.tests_status["FAIL_TO_PASS"] == {"success": [SPACED], "failure": [BROKEN]}
    regressed = grade_log(fmt_instance([SPACED], [PLAIN, BROKEN]), log)
    assert not regressed.resolved
    assert regressed.tests_status["PASS_TO_PASS"]["failure"] == [BROKEN]


def test_verbose_skip_with_reason_and_missing_tests():
    # A skipped FAIL_TO_PASS test is no resolution; a test absent from the log failed.
    grade = grade_log(fmt_instance([SKIPPED], []), VERBOSE_LOG)
    assert not grade.resolved
    missing = grade_log(fmt_instance(["tests/test_fmt.py::test_gone"], []), VERBOSE_LOG)
    assert missing.tests_status["FAIL_TO_PASS"]["failure"] == ["tests/test_fmt.py::test_gone"]


def test_summary_line_wins_over_an_earlier_verbose_line():
    log = f"{SPACED} PASSED [ 50%]\n{SPACED} ERROR [ 50%]\nERROR {SPACED} - teardown\n"
    assert parse_pytest_log(log)[SPACED] == "ERROR"


@pytest.mark.parametrize(
    ("log", "problem"),
    [
        (">>>>> Patch Apply Failed\n" + SUMMARY_LOG, "patch did not apply"),
        (SUMMARY_LOG + ">>>>> Tests Timed Out\n", "tests timed out"),
        (">>>>> Start Test Output\nnothing here\n>>>>> End Test Output\n", "no test results"),
        (
            f"PASSED {SPACED}\n>>>>> End Test Output\n>>>>> Test Exit Code: 1\n",
            "exited 1 but the log reports no failing test",
        ),
    ],
)
def test_ungradable_logs_are_unresolved_with_the_reason(log, problem):
    grade = grade_log(fmt_instance([SPACED], [PLAIN]), log)
    assert not grade.resolved
    assert problem in grade.problem
    assert grade.tests_status["FAIL_TO_PASS"]["failure"] == [SPACED]


def test_instance_fields_are_checked(tmp_path):
    record = {"instance_id": "x", "FAIL_TO_PASS": json.dumps([PLAIN]), "PASS_TO_PASS": "[]"}
    assert normalise_instance(record, "r")["FAIL_TO_PASS"] == [PLAIN]
    with pytest.raises(InstanceError, match="field 'FAIL_TO_PASS'"):
        normalise_instance(record | {"FAIL_TO_PASS": "not json"}, "r")
    with pytest.raises(InstanceError, match="FAIL_TO_PASS' is empty"):
        normalise_instance(record | {"FAIL_TO_PASS": []}, "r")
    with pytest.raises(InstanceError, match="missing field 'PASS_TO_PASS'"):
        normalise_instance({"instance_id": "x", "FAIL_TO_PASS": [PLAIN]}, "r")
    path = tmp_path / "bad.json"
    path.write_text("{")
    with pytest.raises(InstanceError, match=f"--instance {path}: not JSON"):
        load_instance(path)


# -- predictions, report, harness -----------------------------------------------------------


def test_predictions_in_the_official_format(tmp_path):
    preds = [
        {"instance_id": "a", "model_patch": "diff --git a/x b/x\n", "model_name_or_path": "m"},
        {"instance_id": "b", "model_patch": None, "model_name_or_path": "m"},
    ]
    jsonl = write_predictions(tmp_path / "preds.jsonl", preds)
    rows = [json.loads(t) for t in jsonl.read_text().splitlines()]
    assert rows == preds
    assert all(list(row) == ["instance_id", "model_name_or_path", "model_patch"] for row in rows)
    assert json.loads(write_predictions(tmp_path / "preds.json", preds).read_text()) == preds
    with pytest.raises(ValueError, match="'a' predicted twice"):
        write_predictions(tmp_path / "dup.jsonl", preds + preds[:1])
    with pytest.raises(ValueError, match="model_name_or_path"):
        write_predictions(tmp_path / "x.jsonl", [{"instance_id": "a", "model_patch": ""}])


def test_summary_report_counts_like_the_official_one():
    dataset = ["a", "b", "c", "d", "e"]
    patch = {"model_patch": "diff", "model_name_or_path": "m"}
    predictions = {
        "a": patch | {"instance_id": "a"},
        "b": patch | {"instance_id": "b"},
        "c": {"instance_id": "c", "model_patch": "", "model_name_or_path": "m"},
        "d": patch | {"instance_id": "d"},
    }
    status = {"FAIL_TO_PASS": {"success": [], "failure": []}}
    grades = {
        "a": LogGrade("a", True, status),
        "b": LogGrade("b", False, status, failure_reason="docker: no space", infra_failure=True),
    }
    report = summary_report(dataset, predictions, grades)
    assert report["total_instances"] == 5
    assert report["submitted_instances"] == 4
    assert report["completed_instances"] == 2
    assert report["resolved_instances"] == 1
    assert report["unresolved_instances"] == 1
    assert report["empty_patch_instances"] == 1
    assert report["error_instances"] == 1
    assert report["resolved_ids"] == ["a"]
    assert report["unresolved_ids"] == ["b"]
    assert report["empty_patch_ids"] == ["c"]
    assert report["error_ids"] == ["d"]
    assert report["incomplete_ids"] == ["e"]
    assert report["infra_failure_ids"] == ["b"]
    assert report["failure_reasons"] == {"b": "docker: no space"}


def test_docker_harness_refuses_clearly_without_a_daemon(tmp_path, monkeypatch):
    # A socket nothing listens on stands for a machine without a daemon, so the refusal
    # is shown whether or not this machine runs one.
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")
    assert docker_unavailable_reason() is not None
    monkeypatch.chdir(tmp_path)  # the harness would write logs/ under the working folder
    preds = write_predictions(
        tmp_path / "p.jsonl", [{"instance_id": "a", "model_patch": "", "model_name_or_path": "m"}]
    )
    with pytest.raises(DockerUnavailable, match="needs a Docker daemon and none answers"):
        run_docker_harness(preds, dataset_name="SWE-bench/SWE-bench_Verified", run_id="t")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]  # refused before any work
