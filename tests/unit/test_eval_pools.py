"""Loading evaluation pools: a prep folder's split, task folders, SWE records and snapshots."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.generators.minismith import PROJECTS_DIR, store_snapshot
from eval.swe_tasks import INSTRUCTION_FOOTER, swe_task_from_record
from eval.terminal_eval import load_pools, load_prep_pools

TASKS = Path(__file__).parent.parent / "fixtures" / "tasks"
TEST_ID = "tests/test_case.py::test_camel_to_snake_acronym"


@pytest.fixture
def prep(tmp_path) -> tuple[Path, dict]:
    """A prep-layout folder holding both fixture tasks (dev) and one textkit record (dev)."""
    root = tmp_path / "prep"
    snapshot = store_snapshot(PROJECTS_DIR / "textkit", root / "repos")
    rows = []
    for task in sorted(TASKS.iterdir()):
        shutil.copytree(task, root / "tasks" / task.name)
        rows.append({"task_id": task.name, "path": f"tasks/{task.name}", "split": "dev"})
    (root / "terminal").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), root / "terminal" / "dev.parquet")
    record = {
        "instance_id": "textkit.demo",
        "repo": "minismith/textkit",
        "base_commit": snapshot.name,
        "patch": "diff --git a/x b/x\n",
        "FAIL_TO_PASS": [TEST_ID],
        "PASS_TO_PASS": [],
        "problem_statement": "camel_to_snake drops an underscore.",
    }
    (root / "swe").mkdir()
    pq.write_table(pa.Table.from_pylist([record]), root / "swe" / "dev.parquet")
    empty = pa.table({"task_id": pa.array([], pa.string()), "path": pa.array([], pa.string())})
    pq.write_table(empty, root / "terminal" / "train.parquet")
    pq.write_table(pa.Table.from_pylist([record]).slice(0, 0), root / "swe" / "train.parquet")
    return root, record


def test_prep_split_gives_both_pools(prep):
    root, record = prep
    pools = load_prep_pools(root, "dev")
    assert [t.task_id for t in pools["terminal"]] == ["count-lines", "write-hello"]
    (swe,) = pools["swe"]
    assert swe.task_id == record["instance_id"]
    assert swe.repo_dir == root / "repos" / "minismith" / "textkit" / record["base_commit"]
    assert swe.test_files == {
        "tests/test_case.py": (swe.repo_dir / "tests/test_case.py").read_bytes()
    }
    assert swe.instruction == f"{record['problem_statement']}\n\n{INSTRUCTION_FOOTER}"
    assert [len(p) for p in load_prep_pools(root, "dev", limit=1).values()] == [1, 1]
    with pytest.raises(ValueError, match="the 'train' split has no terminal or SWE tasks"):
        load_prep_pools(root, "train")
    (root / "swe" / "dev.parquet").unlink()
    with pytest.raises(FileNotFoundError, match=r"no swe/dev.parquet"):
        load_prep_pools(root, "dev")


def test_explicit_pools_default_to_the_prep_repos_folder(prep):
    root, _ = prep
    pools = load_pools(TASKS, root / "swe" / "dev.parquet")
    assert set(pools) == {"terminal", "swe"}
    with pytest.raises(ValueError, match="no tasks to evaluate"):
        load_pools(None, root / "swe" / "train.parquet")


def test_records_are_checked_naming_the_record(prep):
    root, record = prep
    repos = root / "repos"
    with pytest.raises(FileNotFoundError, match=r"record textkit\.demo: no snapshot at .*/0000"):
        swe_task_from_record(record | {"base_commit": "0000"}, repos)
    refusals = [
        ({"FAIL_TO_PASS": []}, "FAIL_TO_PASS is empty"),
        ({"FAIL_TO_PASS": ["test_case"]}, "FAIL_TO_PASS: test id 'test_case' is not a pytest"),
        ({"FAIL_TO_PASS": ["tests/nope.py::t"]}, "test file tests/nope.py is not in"),
        ({"patch": " "}, "field 'patch' is missing or empty"),
    ]
    for change, message in refusals:
        with pytest.raises(ValueError, match=re.escape(f"record textkit.demo: {message}")):
            swe_task_from_record(record | change, repos)


def test_a_task_id_in_two_pools_is_refused(prep, tmp_path):
    root, record = prep
    clash = tmp_path / "clash"
    shutil.copytree(TASKS / "write-hello", clash / record["instance_id"])
    with pytest.raises(ValueError, match="appears in pools 'terminal' and 'swe'"):
        load_pools(clash, root / "swe" / "dev.parquet")
