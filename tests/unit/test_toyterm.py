"""The toyterm generator, hermetically: pool shape, determinism, layout, verifier checks.

Whether each task's verifier really separates no work from the reference solution needs a
sandbox; tests/integration/test_toyterm_validate.py checks that.
"""

from __future__ import annotations

import collections
import os
import re
import tarfile
import tomllib
from pathlib import Path

import pytest

from data_prep.generators.toyterm import generate
from data_prep.generators.toyterm_families import FAMILIES, checks
from data_prep.generators.toyterm_families.archives import targz_bytes
from data_prep.generators.toyterm_families.verifier_runtime import run_checks

N_TASKS = 240
REQUIRED = (
    "task.toml",
    "instruction.md",
    "environment/Dockerfile",
    "solution/solve.sh",
    "tests/test.sh",
    "tests/test_outputs.py",
)
TASK_ID = re.compile(r"^toyterm-([a-z]+)-(\d{4})$")


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Relative path -> (bytes, mode) of every file and folder below ``root``."""
    found = {}
    for path in sorted(root.rglob("*")):
        mode = path.stat().st_mode & 0o7777
        found[str(path.relative_to(root))] = (path.read_bytes() if path.is_file() else b"", mode)
    return found


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return generate(tmp_path_factory.mktemp("toyterm-a"), n_tasks=N_TASKS, seed=0)


def _metadata(task: Path) -> dict:
    return tomllib.loads((task / "task.toml").read_text())


def test_pool_size_families_and_ids(pool: list[Path]) -> None:
    assert len(pool) == N_TASKS >= 200
    ids = [task.name for task in pool]
    assert len(set(ids)) == len(ids)
    families = collections.Counter()
    for task in pool:
        match = TASK_ID.match(task.name)
        assert match, task.name
        assert _metadata(task)["metadata"]["family"] == match.group(1)
        families[match.group(1)] += 1
    assert set(families) == set(FAMILIES)
    assert len(families) >= 12
    # Families take turns, so none is starved.
    assert max(families.values()) - min(families.values()) <= 1


def test_same_seed_gives_identical_bytes(pool: list[Path], tmp_path: Path) -> None:
    again = generate(tmp_path / "b", n_tasks=N_TASKS, seed=0)
    assert [p.name for p in again] == [p.name for p in pool]
    assert _snapshot(tmp_path / "b") == _snapshot(pool[0].parent)


def test_other_seed_differs_and_prefix_is_stable(pool: list[Path], tmp_path: Path) -> None:
    other = generate(tmp_path / "seed1", n_tasks=len(FAMILIES), seed=1)
    prefix = generate(tmp_path / "prefix", n_tasks=len(FAMILIES), seed=0)
    by_name = {p.name: p for p in pool}
    for task in prefix:
        assert _snapshot(task) == _snapshot(by_name[task.name]), task.name
    first_a = (by_name[other[0].name] / "instruction.md").read_text()
    assert (other[0] / "instruction.md").read_text() != first_a


def test_every_task_has_the_harbor_layout(pool: list[Path]) -> None:
    for task in pool:
        for rel in REQUIRED:
            assert (task / rel).is_file(), f"{task.name}: missing {rel}"
        config = _metadata(task)
        meta = config["metadata"]
        assert meta["difficulty"] in ("easy", "medium", "hard"), task.name
        assert meta["category"], task.name
        assert meta["tags"], task.name
        assert config["verifier"]["timeout_sec"] > 0 < config["agent"]["timeout_sec"]
        docker = (task / "environment" / "Dockerfile").read_text().splitlines()
        assert docker[:2] == ["FROM python:3.11-slim", "WORKDIR /app"], task.name
        inputs = sorted(p.name for p in (task / "environment").iterdir() if p.name != "Dockerfile")
        assert [line.split()[1].rstrip("/") for line in docker[2:]] == inputs, task.name
        assert (task / "solution" / "solve.sh").read_text().startswith("#!/bin/bash\n")
        assert os.access(task / "tests" / "test.sh", os.X_OK)
        source = (task / "tests" / "test_outputs.py").read_text()
        compile(source, str(task / "tests" / "test_outputs.py"), "exec")
        assert "\nCHECKS = [" in source, task.name


def test_instructions_are_distinct_and_difficulties_mixed(pool: list[Path]) -> None:
    instructions = [(task / "instruction.md").read_text() for task in pool]
    assert len(set(instructions)) == len(instructions)
    levels = collections.Counter(_metadata(t)["metadata"]["difficulty"] for t in pool)
    for level in ("easy", "medium", "hard"):
        assert levels[level] >= N_TASKS // 10, levels
    short = [t for t in pool if "short-command" in _metadata(t)["metadata"]["tags"]]
    assert len(short) >= 10


def test_zero_tasks_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="n_tasks"):
        generate(tmp_path, n_tasks=0)


# -- the verifier's checks, run on a plain folder --------------------------------------------


def test_text_checks_forgive_trailing_newlines_only(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one\ntwo")
    (tmp_path / "b.txt").write_text("one \ntwo\n")
    (tmp_path / "n.txt").write_text(" 42\n")
    assert run_checks([checks.text("a.txt", "one\ntwo\n")], str(tmp_path)) == 0
    assert run_checks([checks.text("b.txt", "one\ntwo\n")], str(tmp_path)) == 1
    assert run_checks([checks.number("n.txt", 42)], str(tmp_path)) == 0
    assert run_checks([checks.text("missing.txt", "")], str(tmp_path)) == 1
    assert run_checks([], str(tmp_path)) == 1


def test_outputs_are_not_read_through_symlinks(tmp_path: Path) -> None:
    (tmp_path / "real.txt").write_text("yes\n")
    (tmp_path / "out.txt").symlink_to(tmp_path / "real.txt")
    assert run_checks([checks.text("real.txt", "yes")], str(tmp_path)) == 0
    assert run_checks([checks.text("out.txt", "yes")], str(tmp_path)) == 1


def test_path_lists_and_trees(tmp_path: Path) -> None:
    (tmp_path / "paths.txt").write_text("./d/b.txt\n/app/d/a.txt\n")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("A\n")
    paths = checks.lines("paths.txt", ["d/a.txt", "d/b.txt"], unordered=True, paths=True)
    assert run_checks([paths], str(tmp_path)) == 0
    assert run_checks([checks.tree("d", {"a.txt": "A\n"})], str(tmp_path)) == 0
    assert run_checks([checks.tree("d", {"a.txt": "A\n", "b.txt": ""})], str(tmp_path)) == 1
    assert run_checks([checks.tree("gone", {}, missing_ok=True)], str(tmp_path)) == 0


def test_tar_check_reads_members_and_compression(tmp_path: Path) -> None:
    members = {"top/a.txt": "alpha\n", "top/sub/b.md": "beta\n"}
    (tmp_path / "x.tar.gz").write_bytes(targz_bytes(members))
    with tarfile.open(tmp_path / "plain.tar", "w") as archive:
        archive.add(tmp_path / "x.tar.gz", arcname="top/x.tar.gz")
    assert run_checks([checks.tar("x.tar.gz", members)], str(tmp_path)) == 0
    assert run_checks([checks.tar("x.tar.gz", members, gzipped=False)], str(tmp_path)) == 1
    assert run_checks([checks.tar("x.tar.gz", {"top/a.txt": "alpha\n"})], str(tmp_path)) == 1
    assert run_checks([checks.tar("plain.tar", members, gzipped=False)], str(tmp_path)) == 1


def test_a_verifier_starts_without_the_heavy_standard_modules(pool: list[Path], tmp_path) -> None:
    """Every graded episode starts a verifier: typing, enum (signal's) and collections.abc
    would be about half its interpreter start. Only a check that needs more imports more.

    The script is imported, not run: its ``main`` kills every process younger than its
    oldest ancestor, which outside a sandbox's pid namespace is the whole session."""
    import shutil  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    script = next(t for t in pool if "-count-" in t.name) / "tests" / "test_outputs.py"
    shutil.copy(script, tmp_path / "verifier_probe.py")
    probe = "import sys; sys.path.insert(0, '.'); import verifier_probe; print(verifier_probe.ROOT)"
    run = subprocess.run(
        [sys.executable, "-I", "-S", "-X", "importtime", "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert run.stdout.strip() == "/app"
    lines = [line for line in run.stderr.splitlines() if line.startswith("import time:")]
    loaded = {line.rsplit("|", 1)[1].strip() for line in lines[1:]}
    assert {"os", "verifier_probe"} <= loaded
    assert not loaded & {"typing", "enum", "signal", "collections.abc", "re"}, sorted(loaded)
