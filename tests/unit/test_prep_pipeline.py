"""The prep pipeline on small pools: reconciled counts, separation, determinism, stable splits.

Executable validation is off here (it has its own integration tests); everything else runs
for real on files written to tmp_path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.config import PrepConfig, load_prep_config
from data_prep.pipeline import prepare
from data_prep.split import in_dev

VERIFIED = Path(__file__).parents[2] / "data" / "swe-bench-verified" / "test.parquet"
FIXTURE_TASKS = Path(__file__).parents[1] / "fixtures" / "tasks"


def swe_record(i: int, repo: str = "acme/widgets", **changes) -> dict:
    record = {
        "instance_id": f"{repo.replace('/', '__')}.{i:04d}",
        "repo": f"swesmith/{repo.replace('/', '__')}.abc123",
        "patch": f"diff --git a/src/m{i}.py b/src/m{i}.py\n--- a/src/m{i}.py\n+++ b/src/m{i}.py\n"
        f"@@ -1 +1 @@\n-x = {i}\n+x = {i + 1}\n",
        "FAIL_TO_PASS": [f"tests/test_m.py::test_{i}"],
        "PASS_TO_PASS": json.dumps(["tests/test_m.py::test_ok"]),
        "image_name": "img",
        "base_commit": "abc123",
        "problem_statement": f"m{i} is wrong",
        "created_at": "2024-01-01",
    }
    return record | changes


def write_swe_pool(path: Path, extra: list[dict] = ()) -> None:
    rows = [swe_record(i) for i in range(6)]
    rows += [swe_record(i, repo=f"team{i}/lib{i}") for i in range(20)]
    rows.append(swe_record(1, repo="astropy/astropy"))  # evaluated by SWE-bench Verified
    rows.append(swe_record(99, patch="diff --git a/README.md b/README.md\n+x\n"))  # not Python
    dup = swe_record(2)
    dup["instance_id"] = "acme__widgets.dup"  # same repo + patch as record 2
    rows.append(dup)
    rows.append(swe_record(77, patch="diff --git a/a.py b/a.py\n" + "+x\n" * 20000))  # too long
    lines = [json.dumps(r) for r in [*rows, *extra]]
    lines.append(json.dumps({k: v for k, v in swe_record(50).items() if k != "patch"}))
    lines.append(json.dumps(swe_record(51, FAIL_TO_PASS="[not json")))
    lines.append("{broken")
    lines.append(json.dumps(swe_record(3)))  # the same id twice
    path.write_text("\n".join(lines) + "\n")


def write_terminal_pool(root: Path) -> None:
    for task in FIXTURE_TASKS.iterdir():
        shutil.copytree(task, root / task.name)
    shutil.copytree(FIXTURE_TASKS / "write-hello", root / "write-hello-copy")  # exact duplicate
    old = root / "old-layout-1"
    (old / "tests").mkdir(parents=True)
    (old / "task.yaml").write_text("instruction: Print the current date into date.txt.\n")
    (old / "solution.sh").write_text("date > date.txt\n")
    (old / "run-tests.sh").write_text("test -s date.txt\n")
    no_instruction = root / "old-layout-2"
    shutil.copytree(old, no_instruction)
    (no_instruction / "task.yaml").write_text("difficulty: easy\n")
    broken = root / "broken-task"
    broken.mkdir()
    (broken / "task.toml").write_text('version = "1.0"\n')
    (broken / "instruction.md").write_text("Do something.\n")


def config_for(tmp: Path, swe_path: Path, term_dir: Path, eval_dir: Path | None) -> PrepConfig:
    return PrepConfig.model_validate({
        "swe_sources": [{"kind": "file", "name": "pool", "path": swe_path}],
        "terminal_sources": [{"kind": "dir", "name": "seta", "path": term_dir}],
        "swe_bench_verified": VERIFIED,
        "terminal_eval_dir": eval_dir,
        "dev_fraction": 0.3,
        "validation": {"enabled": False},
    })  # fmt: skip


@pytest.fixture
def pools(tmp_path):
    swe_path = tmp_path / "swe.jsonl"
    write_swe_pool(swe_path)
    term_dir = tmp_path / "terminal"
    write_terminal_pool(term_dir)
    eval_dir = tmp_path / "eval"
    (eval_dir / "eval-count").mkdir(parents=True)
    shutil.copytree(FIXTURE_TASKS / "count-lines", eval_dir / "eval-count", dirs_exist_ok=True)
    return swe_path, term_dir, eval_dir


def test_counts_reconcile_and_every_reason_is_recorded(pools, tmp_path):
    manifest = prepare(config_for(tmp_path, *pools), tmp_path / "out")
    stages = {(s["pool"], s["stage"]): s for s in manifest["stages"]}
    for s in manifest["stages"]:
        assert s["in"] == s["kept"] + s["filtered"] + s["quarantined"]
    load = stages[("swe", "load")]
    assert (load["in"], load["quarantined"]) == (34, 4)
    assert stages[("swe", "language")]["filtered"] == 1
    assert stages[("swe", "benchmark_separation")]["filtered"] == 1
    assert stages[("swe", "duplicates")]["filtered"] == 1
    assert stages[("swe", "length")]["filtered"] == 1
    assert sum(manifest["splits"]["swe"].values()) == 26
    term = {k[1]: v for k, v in stages.items() if k[0] == "terminal"}
    assert term["load"]["quarantined"] == 2  # broken-task, old-layout-2
    assert term["benchmark_separation"]["filtered"] == 1  # count-lines matches eval-count
    assert term["duplicates"]["filtered"] == 1  # write-hello-copy
    quarantine = [
        json.loads(x) for x in (tmp_path / "out" / "quarantine.jsonl").read_text().splitlines()
    ]
    reasons = " | ".join(q["reason"] for q in quarantine)
    assert "field patch" in reasons
    assert "field FAIL_TO_PASS" in reasons
    assert "not JSON" in reasons
    assert "same id appears twice" in reasons
    assert "harbor task misses" in reasons
    assert "task.yaml has no instruction" in reasons


def test_rerun_is_byte_identical(pools, tmp_path):
    config = config_for(tmp_path, *pools)
    prepare(config, tmp_path / "a")
    prepare(config, tmp_path / "b")
    files_a = sorted(
        p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file()
    )
    files_b = sorted(
        p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file()
    )
    assert files_a == files_b
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


def split_of(out: Path) -> dict[str, str]:
    result = {}
    for split in ("train", "dev"):
        for row in pq.read_table(out / "swe" / f"{split}.parquet").to_pylist():
            result[row["instance_id"]] = row["split"]
    return result


def test_adding_records_moves_no_existing_record_and_groups_stay_whole(pools, tmp_path):
    swe_path, term_dir, eval_dir = pools
    prepare(config_for(tmp_path, swe_path, term_dir, eval_dir), tmp_path / "before")
    grown = tmp_path / "grown.jsonl"
    write_swe_pool(grown, extra=[swe_record(i, repo=f"new{i}/pkg") for i in range(30)])
    prepare(config_for(tmp_path, grown, term_dir, eval_dir), tmp_path / "after")
    before, after = split_of(tmp_path / "before"), split_of(tmp_path / "after")
    assert all(after[k] == v for k, v in before.items())
    assert set(before.values()) == {"train", "dev"}  # both splits are exercised
    # acme/widgets has five kept instances: all on one side.
    widgets = {v for k, v in after.items() if k.startswith("acme__widgets")}
    assert len(widgets) == 1
    assert in_dev("acme/widgets", 0.3) == (widgets == {"dev"})


def test_existing_output_is_never_overwritten(pools, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        prepare(config_for(tmp_path, *pools), out)
    assert (out / "keep.txt").read_text() == "mine"


def test_malformed_evaluation_records_are_quarantined_not_dropped(pools, tmp_path):
    rows = pq.read_table(VERIFIED).slice(0, 3).to_pylist()
    rows[1]["FAIL_TO_PASS"] = "[not json"
    bad_verified = tmp_path / "verified.parquet"
    pq.write_table(pa.Table.from_pylist(rows), bad_verified)
    config = config_for(tmp_path, *pools).model_copy(update={"swe_bench_verified": bad_verified})
    prepare(config, tmp_path / "out")
    quarantine = (tmp_path / "out" / "quarantine.jsonl").read_text()
    assert rows[1]["instance_id"] in quarantine
    assert "swe-bench-verified" in quarantine


def test_config_errors_name_the_field(tmp_path):
    path = tmp_path / "prep.yaml"
    path.write_text("swe_sources:\n  - {kind: file, name: x}\n")
    with pytest.raises(ValueError, match=r"swe_sources\.0"):
        load_prep_config(path)
    path.write_text("dev_fraction: 2\n")
    with pytest.raises(ValueError, match="field dev_fraction"):
        load_prep_config(path)


def test_warm_start_pool_is_generated_apart_from_every_kept_task(tmp_path):
    from data_prep.generators import toyterm  # noqa: PLC0415
    from data_prep.pipeline import WARM_START_SEED_OFFSET, write_warm_start_pool  # noqa: PLC0415
    from data_prep.sources.terminal import load_task_pool  # noqa: PLC0415

    config = PrepConfig.model_validate(
        {"warm_start_pool": {"n_tasks": 12, "families": ["oneliner", "count"]}}
    )
    # The same draws the pool will make; one of them stands in for a kept train/dev task.
    twin = tmp_path / "twin"
    toyterm.generate(twin, n_tasks=12, seed=WARM_START_SEED_OFFSET, families=["oneliner", "count"])
    drawn, _ = load_task_pool(twin, "twin")
    (tmp_path / "scratch").mkdir()
    counts = write_warm_start_pool(config, [drawn[3]], tmp_path / "scratch", tmp_path / "out")
    assert counts == {"generated": 12, "kept": 11, "repeats_a_kept_or_eval_task": 1, "malformed": 0}
    rows = pq.read_table(tmp_path / "out" / "terminal" / "warmstart.parquet").to_pylist()
    assert {r["family"] for r in rows} == {"oneliner", "count"}
    assert drawn[3].instruction not in {r["instruction"] for r in rows}
    assert all((tmp_path / "out" / r["path"] / "instruction.md").is_file() for r in rows)
    assert write_warm_start_pool(PrepConfig(), [], tmp_path, tmp_path / "none") is None
    with pytest.raises(ValueError, match="unknown families"):
        toyterm.generate(tmp_path / "bad", n_tasks=1, families=["nope"])


def test_a_toyterm_source_keeps_to_its_families(tmp_path):
    from data_prep.pipeline import load_terminal  # noqa: PLC0415
    from data_prep.stages import StageLog  # noqa: PLC0415

    config = PrepConfig.model_validate(
        {"terminal_sources": [{"kind": "toyterm", "name": "tt", "n_tasks": 6,
                               "families": ["count", "grep"]}]}
    )  # fmt: skip
    log = StageLog()
    records, [meta] = load_terminal(config, tmp_path, log)
    assert log.quarantine == []
    assert sorted(r.family for r in records) == ["count"] * 3 + ["grep"] * 3
    assert {k: meta[k] for k in ("generator", "seed", "families")} == {
        "generator": "toyterm", "seed": 0, "families": ["count", "grep"]
    }  # fmt: skip


def test_unknown_toyterm_families_are_refused_naming_the_source(tmp_path):
    bad = {"kind": "toyterm", "name": "tt", "families": ["count", "nope"]}
    with pytest.raises(ValueError, match=r"source 'tt': unknown toyterm families \['nope'\]"):
        PrepConfig.model_validate({"terminal_sources": [bad]})
    with pytest.raises(ValueError, match="warm_start_pool: unknown toyterm families"):
        PrepConfig.model_validate({"warm_start_pool": {"n_tasks": 2, "families": ["nope"]}})
    with pytest.raises(ValueError, match="families is for kind 'toyterm'"):
        PrepConfig.model_validate(
            {"terminal_sources": [{"kind": "dir", "name": "d", "path": "x", "families": ["count"]}]}
        )
