"""SWE-bench style grading of test logs, predictions files and the official run report.

Grading a log against an instance record (FAIL_TO_PASS / PASS_TO_PASS as lists or JSON
strings) uses the ``swebench`` package: its markers cut the test section out of the log,
its pytest parser (``parse_log_pytest_v2``) reads ``-rA`` summary lines
(``PASSED nodeid``, ``FAILED nodeid - message``), and its ``get_eval_tests_report`` /
``get_resolution_status`` decide the outcome. Resolved means every FAIL_TO_PASS test
passed and no PASS_TO_PASS test failed, with swebench's semantics: XFAIL counts as a pass,
and a *skipped* PASS_TO_PASS test is not a regression (a skipped FAIL_TO_PASS test is a
failure). A test missing from the log counts as failed.

What swebench's parser misses, added here: pytest ``--verbose`` lines as SWE-smith
writes them, ``nodeid PASSED [ 3%]`` (the progress suffix hides the status from its
"line ends with a status" rule), pytest-xdist's ``[gw0] [ 3%] PASSED nodeid``, and exact
ids in summary lines: it splits a line on whitespace and joins the pieces with single
spaces, so a parametrised id holding a run of spaces (``test_x[  a]``) comes out changed
and never matches the instance's list. Lines of these three shapes are read here with the
id kept verbatim (in a verbose line, everything before the last status word; in a summary
line, everything after the status word, up to the `` - `` that starts the message on
non-passing lines) and override swebench's reading of the same line; within the log, a
later line about the same test wins (the summary is printed after the verbose lines).

A log is not gradable (resolved False, with the reason) when it holds one of swebench's
failure markers (patch apply failed, reset failed, tests errored or timed out), when no
test result can be read from it, or when the recorded test exit status is non-zero while
the log reports no failure (the log does not describe the run that happened).

Also here: predictions in the official ``{instance_id, model_name_or_path, model_patch}``
format, the official run-summary report built from our gradings, and a guarded entry to
swebench's Docker harness, which refuses clearly where no Docker daemon answers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swebench.harness.constants import (
    APPLY_PATCH_FAIL,
    END_TEST_OUTPUT,
    FAIL_TO_PASS,
    PASS_TO_PASS,
    RESET_FAILED,
    START_TEST_OUTPUT,
    TESTS_ERROR,
    TESTS_TIMEOUT,
    EvalType,
    ResolvedStatus,
    TestStatus,
)
from swebench.harness.grading import (
    get_eval_tests_report,
    get_resolution_status,
    parse_test_exit_code,
)
from swebench.harness.infra_failure import TIER_ENVIRONMENT, classify_text
from swebench.harness.log_parsers.python import parse_log_pytest_v2
from swebench.types import TestSpec

from data_prep.schema import test_list

__all__ = [
    "DockerUnavailable",
    "InstanceError",
    "InstanceImagesMissing",
    "LogGrade",
    "docker_unavailable_reason",
    "grade_log",
    "instance_images",
    "load_dataset_records",
    "load_instance",
    "missing_images",
    "parse_exact_lines",
    "parse_pytest_log",
    "prediction",
    "run_docker_harness",
    "summary_report",
    "validation_lists",
    "write_predictions",
]

_STATUSES = tuple(status.value for status in TestStatus)
_STATUS_ALT = "|".join(_STATUSES)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# ``nodeid STATUS`` with an optional ``[ 42%]``; the id is everything before the last status.
_VERBOSE = re.compile(rf"^(?P<id>\S+::.*?)\s+(?P<status>{_STATUS_ALT})(?:\s+\[\s*\d+%\])?\s*$")
# ``-rA`` summary: ``STATUS nodeid``, then `` - message`` on all but PASSED lines.
_SUMMARY = re.compile(rf"^(?P<status>{_STATUS_ALT}) (?P<id>\S+::.*)$")
# pytest-xdist: ``[gw3] [ 42%] STATUS nodeid``.
_XDIST = re.compile(
    rf"^\[gw\d+\]\s+\[\s*\d+%\]\s+(?P<status>{_STATUS_ALT})\s+(?P<id>\S+::.*\S)\s*$"
)
_FAILURE_MARKERS = {
    APPLY_PATCH_FAIL: "the patch did not apply",
    RESET_FAILED: "resetting the repository failed",
    TESTS_ERROR: "the tests errored",
    TESTS_TIMEOUT: "the tests timed out",
}
_FAILING_STATUSES = {TestStatus.FAILED.value, TestStatus.ERROR.value}


class InstanceError(ValueError):
    """An instance record is malformed; the message names the file and field."""


class DockerUnavailable(RuntimeError):
    """No Docker daemon answers, so swebench's harness cannot run here."""


class InstanceImagesMissing(DockerUnavailable):
    """Instance images the harness needs are not on the daemon (and cannot be pulled)."""


# -- instances ------------------------------------------------------------------------------


def load_instance(path: Path) -> dict[str, Any]:
    """An instance record from a JSON file, FAIL_TO_PASS / PASS_TO_PASS normalised to lists."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--instance {path}: no such file")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InstanceError(f"--instance {path}: not JSON ({exc.msg}, line {exc.lineno})") from None
    return normalise_instance(record, str(path))


def normalise_instance(record: object, source: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise InstanceError(f"{source}: expected a JSON object, got {type(record).__name__}")
    instance_id = record.get("instance_id")
    if not isinstance(instance_id, str) or not instance_id:
        raise InstanceError(f"{source}: field 'instance_id' missing or not a string")
    out = dict(record)
    for name in (FAIL_TO_PASS, PASS_TO_PASS):
        if name not in record:
            raise InstanceError(f"{source} ({instance_id}): missing field {name!r}")
        try:
            out[name] = test_list(record[name])
        except ValueError as exc:
            raise InstanceError(f"{source} ({instance_id}): field {name!r}: {exc}") from None
    if not out[FAIL_TO_PASS]:
        raise InstanceError(f"{source} ({instance_id}): field 'FAIL_TO_PASS' is empty")
    return out


def _test_spec(instance: Mapping[str, Any]) -> TestSpec:
    return TestSpec(
        instance_id=instance["instance_id"],
        image=str(instance.get("image_name") or ""),
        eval_script_list=[],
        repo=str(instance.get("repo") or ""),
        version=str(instance.get("version") or ""),
        FAIL_TO_PASS=list(instance[FAIL_TO_PASS]),
        PASS_TO_PASS=list(instance[PASS_TO_PASS]),
        log_parser="parse_log_pytest_v2",
        eval_type=EvalType.PASS_AND_FAIL.value,
    )


# -- parsing --------------------------------------------------------------------------------


def _exact_line(line: str) -> tuple[str, str] | None:
    """(node id, status) from one verbose, xdist or summary line, or None."""
    match = _VERBOSE.match(line) or _XDIST.match(line)
    if match:
        return match.group("id"), match.group("status")
    match = _SUMMARY.match(line)
    if not match:
        return None
    status, node_id = match.group("status"), match.group("id")
    if status != TestStatus.PASSED.value:
        node_id = node_id.split(" - ", 1)[0]
    return node_id, status


def parse_exact_lines(log: str) -> dict[str, str]:
    """node id -> status from verbose, xdist and summary lines, ids verbatim; later wins."""
    status_map: dict[str, str] = {}
    for raw in log.splitlines():
        found = _exact_line(_ANSI.sub("", raw).rstrip())
        if found:
            status_map[found[0]] = found[1]
    return status_map


def parse_pytest_log(log: str, spec: TestSpec | None = None) -> dict[str, str]:
    """swebench's ``-rA`` parser, overridden where a line is read exactly here."""
    return parse_log_pytest_v2(log, spec) | parse_exact_lines(log)  # type: ignore[arg-type]


def _test_section(content: str) -> str:
    """The text between swebench's start/end markers, or the whole log without them."""
    if START_TEST_OUTPUT in content and END_TEST_OUTPUT in content:
        return content.split(START_TEST_OUTPUT, 1)[1].split(END_TEST_OUTPUT, 1)[0]
    return content


def _unusable(content: str, status_map: Mapping[str, str]) -> str | None:
    """Why the log cannot be graded, or None."""
    for marker, meaning in _FAILURE_MARKERS.items():
        if marker in content:
            return f"the log says {meaning} ({marker!r})"
    if not status_map:
        return "no test results found in the log"
    exit_code = parse_test_exit_code(content)
    failed = any(status in _FAILING_STATUSES for status in status_map.values())
    if exit_code not in (None, 0) and not failed:
        return f"the test command exited {exit_code} but the log reports no failing test"
    return None


# -- grading --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogGrade:
    instance_id: str
    resolved: bool
    tests_status: dict[str, dict[str, list[str]]]
    problem: str | None = None  # why the log could not be graded, if it could not
    failure_reason: str | None = None  # swebench's infrastructure classification
    infra_failure: bool = False
    status_map: dict[str, str] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"resolved": self.resolved, "tests_status": self.tests_status}
        if self.problem is not None:
            out["problem"] = self.problem
        return out


def _failed_everything(instance: Mapping[str, Any]) -> dict[str, dict[str, list[str]]]:
    return {
        name: {"success": [], "failure": list(instance[name])}
        for name in (FAIL_TO_PASS, PASS_TO_PASS)
    }


def grade_log(instance: Mapping[str, Any], log: str) -> LogGrade:
    """Grade one test log against one (normalised) instance record."""
    spec = _test_spec(instance)
    status_map = parse_pytest_log(_test_section(log), spec)
    if not status_map:
        # Some runners print results outside the markers; the whole log is the fallback.
        status_map = parse_pytest_log(log, spec)
    problem = _unusable(log, status_map)
    if problem is not None:
        tests_status = _failed_everything(instance)
        resolved = False
    else:
        gold = {FAIL_TO_PASS: spec.FAIL_TO_PASS, PASS_TO_PASS: spec.PASS_TO_PASS}
        report = get_eval_tests_report(status_map, gold, eval_type=EvalType.PASS_AND_FAIL)
        tests_status = {name: report[name] for name in (FAIL_TO_PASS, PASS_TO_PASS)}
        resolved = get_resolution_status(report) == ResolvedStatus.FULL.value
    classified = None if resolved else classify_text(log)
    return LogGrade(
        instance_id=spec.instance_id,
        resolved=resolved,
        tests_status=tests_status,
        problem=problem,
        failure_reason=classified[0] if classified else None,
        infra_failure=bool(classified and classified[1] == TIER_ENVIRONMENT),
        status_map=status_map,
    )


def validation_lists(clean_log: str, bugged_log: str) -> dict[str, list[str]]:
    """SWE-smith validation: classify every test seen by its outcome on both trees.

    FAIL_TO_PASS fails with the bug and passes clean, PASS_TO_PASS passes on both,
    FAIL_TO_FAIL fails on both, PASS_TO_FAIL passes with the bug and fails clean.
    """
    clean = parse_pytest_log(_test_section(clean_log))
    bugged = parse_pytest_log(_test_section(bugged_log))
    passing = {TestStatus.PASSED.value, TestStatus.XFAIL.value}
    lists: dict[str, list[str]] = {
        "FAIL_TO_PASS": [],
        "PASS_TO_PASS": [],
        "FAIL_TO_FAIL": [],
        "PASS_TO_FAIL": [],
    }
    for test in dict.fromkeys([*clean, *bugged]):
        before = "PASS" if bugged.get(test) in passing else "FAIL"
        after = "PASS" if clean.get(test) in passing else "FAIL"
        lists[f"{before}_TO_{after}"].append(test)
    return lists


# -- predictions and the run report ---------------------------------------------------------


def prediction(instance_id: str, model_patch: str | None, model_name_or_path: str) -> dict:
    """One prediction in the official format; ``model_patch`` None or "" means no patch."""
    if not isinstance(instance_id, str) or not instance_id:
        raise ValueError(f"prediction: instance_id must be a non-empty string, got {instance_id!r}")
    if model_patch is not None and not isinstance(model_patch, str):
        raise ValueError(f"prediction {instance_id}: model_patch must be a string or None")
    if not isinstance(model_name_or_path, str) or not model_name_or_path:
        raise ValueError(f"prediction {instance_id}: model_name_or_path must be a non-empty string")
    return {
        "instance_id": instance_id,
        "model_name_or_path": model_name_or_path,
        "model_patch": model_patch,
    }


def write_predictions(path: Path, predictions: Iterable[Mapping[str, Any]]) -> Path:
    """Write predictions as ``.jsonl`` (one a line) or ``.json`` (a list), as the harness reads.

    Refuses a repeated instance_id: the harness keys predictions by it and would keep one.
    """
    path = Path(path)
    rows, seen = [], set()
    for item in predictions:
        row = prediction(
            item.get("instance_id"),  # type: ignore[arg-type]
            item.get("model_patch"),
            item.get("model_name_or_path"),  # type: ignore[arg-type]
        )
        if row["instance_id"] in seen:
            raise ValueError(f"{path}: instance_id {row['instance_id']!r} predicted twice")
        seen.add(row["instance_id"])
        rows.append(row)
    if path.suffix == ".jsonl":
        text = "".join(json.dumps(row) + "\n" for row in rows)
    elif path.suffix == ".json":
        text = json.dumps(rows, indent=2) + "\n"
    else:
        raise ValueError(f"{path}: predictions must be written to a .jsonl or .json file")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def summary_report(
    dataset_ids: Sequence[str],
    predictions: Mapping[str, Mapping[str, Any]],
    grades: Mapping[str, LogGrade],
) -> dict[str, Any]:
    """The official run report's fields, from our gradings instead of the harness's folders.

    As in swebench's ``make_run_report``: an instance without a prediction is incomplete,
    one with an empty patch is counted as such and not run, one with a patch but no
    grading is an error, and a graded one is completed and resolved or unresolved.
    Instances whose log could not be graded stay unresolved; swebench's log classifier
    marks the likely infrastructure failures among them.
    """
    ids: dict[str, set[str]] = {
        name: set()
        for name in ("completed", "incomplete", "empty_patch", "resolved", "unresolved", "error")
    }
    for instance_id in dataset_ids:
        pred = predictions.get(instance_id)
        if pred is None:
            ids["incomplete"].add(instance_id)
        elif pred.get("model_patch") in ("", None):
            ids["empty_patch"].add(instance_id)
        elif instance_id not in grades:
            ids["error"].add(instance_id)
        else:
            ids["completed"].add(instance_id)
            ids["resolved" if grades[instance_id].resolved else "unresolved"].add(instance_id)
    reasons = {
        i: grades[i].failure_reason for i in sorted(ids["unresolved"]) if grades[i].failure_reason
    }
    infra = sorted(i for i in reasons if grades[i].infra_failure)
    ambiguous = sorted(i for i in reasons if not grades[i].infra_failure)
    return {
        "total_instances": len(dataset_ids),
        "submitted_instances": len(predictions),
        "completed_instances": len(ids["completed"]),
        "resolved_instances": len(ids["resolved"]),
        "unresolved_instances": len(ids["unresolved"]),
        "infra_failure_instances": len(infra),
        "ambiguous_failure_instances": len(ambiguous),
        "empty_patch_instances": len(ids["empty_patch"]),
        "error_instances": len(ids["error"]),
        "completed_ids": sorted(ids["completed"]),
        "incomplete_ids": sorted(ids["incomplete"]),
        "empty_patch_ids": sorted(ids["empty_patch"]),
        "submitted_ids": sorted(predictions),
        "resolved_ids": sorted(ids["resolved"]),
        "unresolved_ids": sorted(ids["unresolved"]),
        "infra_failure_ids": infra,
        "ambiguous_failure_ids": ambiguous,
        "failure_reasons": reasons,
        "error_ids": sorted(ids["error"]),
        "schema_version": 2,
    }


# -- the Docker harness ---------------------------------------------------------------------


def docker_unavailable_reason(timeout_s: int = 5) -> str | None:
    """None when a Docker daemon answers a ping, else why not."""
    import docker  # noqa: PLC0415 - only where the harness is wanted

    try:
        client = docker.from_env(timeout=timeout_s)
    except docker.errors.DockerException as exc:
        return str(exc)
    try:
        client.ping()
    except docker.errors.DockerException as exc:
        return str(exc)
    finally:
        client.close()
    return None


def load_dataset_records(dataset_name: str, split: str = "test") -> list[dict[str, Any]]:
    """A SWE-bench dataset's records: a local .parquet/.json/.jsonl file read here, a folder
    holding ``<split>.parquet``, else swebench's loader (Hugging Face, needs the network)."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    path = Path(dataset_name)
    if path.is_dir() and (path / f"{split}.parquet").is_file():
        path = path / f"{split}.parquet"
    if path.suffix == ".parquet" and path.is_file():
        return pq.read_table(path).to_pylist()
    if path.suffix == ".jsonl" and path.is_file():
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".json" and path.is_file():
        return list(json.loads(path.read_text()))
    from swebench.harness.utils import load_swebench_dataset  # noqa: PLC0415

    return [dict(r) for r in load_swebench_dataset(dataset_name, split)]


def instance_images(records: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """instance id -> the image swebench runs it in (the record's ``image`` field, as
    swebench's test spec reads it)."""
    images = {}
    for record in records:
        instance_id = str(record.get("instance_id") or "")
        image = record.get("image")
        if not instance_id or not isinstance(image, str) or not image:
            raise InstanceError(
                f"instance {instance_id or '?'}: field image is missing (the SWE-bench "
                "dataset names each instance's evaluation image there)"
            )
        images[instance_id] = image
    return images


def missing_images(images: Iterable[str], client: Any = None) -> list[str]:
    """The images of ``images`` that the Docker daemon does not hold, in order."""
    import docker  # noqa: PLC0415

    own = client is None
    client = client or docker.from_env(timeout=10)
    missing = []
    try:
        for image in dict.fromkeys(images):
            try:
                client.images.get(image)
            except docker.errors.ImageNotFound:
                missing.append(image)
    finally:
        if own:
            client.close()
    return missing


def run_docker_harness(
    predictions_path: Path,
    *,
    dataset_name: str,
    run_id: str,
    split: str = "test",
    instance_ids: Sequence[str] = (),
    max_workers: int = 1,
    timeout_s: int = 1800,
    report_dir: Path = Path("."),
) -> Path:
    """Run swebench's containerised evaluation, in each instance's own image (swebench's
    image spec, the record's ``image``); returns its run report's path.

    Refuses before any work: DockerUnavailable where no daemon answers, and
    InstanceImagesMissing, naming them, where an instance's image is not on the daemon
    (swebench would try to pull it, and no registry can be reached from these machines).
    """
    reason = docker_unavailable_reason()
    if reason is not None:
        raise DockerUnavailable(
            f"the SWE-bench Docker harness needs a Docker daemon and none answers ({reason}); "
            "grade existing logs with `thundersync eval grade-swebench` instead"
        )
    predicted = {
        str(json.loads(line)["instance_id"])
        for line in Path(predictions_path).read_text().splitlines()
        if line.strip()
    }
    wanted = set(instance_ids) or predicted
    records = [
        r for r in load_dataset_records(dataset_name, split) if r.get("instance_id") in wanted
    ]
    unknown = sorted(wanted - {str(r["instance_id"]) for r in records})
    if unknown:
        raise InstanceError(f"--dataset {dataset_name}: no instance {', '.join(unknown[:5])}")
    images = instance_images(records)
    missing = missing_images(images.values())
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise InstanceImagesMissing(
            f"{len(missing)} of {len(images)} SWE-bench instance images are not on the Docker "
            f"daemon: {shown}. They cannot be pulled from here: build them with swebench's "
            "image builder (or pull them) where a registry is reachable, `docker save` them, "
            "and `docker load` them on this machine"
        )
    from swebench.harness.run_evaluation import main as harness_main  # noqa: PLC0415

    return harness_main(
        dataset_name=dataset_name,
        split=split,
        instance_ids=list(instance_ids),
        predictions_path=str(predictions_path),
        max_workers=max_workers,
        open_file_limit=4096,
        run_id=run_id,
        timeout=timeout_s,
        rewrite_reports=False,
        modal=False,
        report_dir=str(report_dir),
    )
