"""Warm starts kept by key in ``warm_start.cache_dir``: every run folder with the same
settings and tasks reuses one, anything that changes the weights makes another, and the
OPD teacher can continue the policy's warm start instead of starting over."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from thundersync_core.config import load_config
from thundersync_core.pools import load_pool
from thundersync_core.warmstart.cache import prepare_policies, warm_start_key

pytestmark = pytest.mark.integration


def test_warm_starts_are_kept_by_key_and_the_teacher_continues_the_policy(
    tmp_path: Path, tiny_prep_dir: Path
) -> None:
    prep = tmp_path / "prep"
    shutil.copytree(tiny_prep_dir, prep)
    cache = tmp_path / "cache"
    overrides = {
        "objective": "opd",
        "policy.preset": "micro",
        "tasks.prep_dir": str(prep),
        "warm_start.steps": 2,
        "warm_start.teacher_steps": 1,
        "warm_start.teacher_init": "policy",
        "warm_start.cache_dir": str(cache),
    }
    config = load_config(None, overrides)
    roots = list(load_pool(prep, "train").values())

    policy, teacher = prepare_policies(config, tmp_path / "run-a", roots)
    assert policy.parent == teacher.parent == cache
    assert not (tmp_path / "run-a" / "warmstart").exists()
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []
    teacher_summary = json.loads((teacher / "warmstart.json").read_text())
    assert teacher_summary["init_from"] == str(policy)
    assert teacher_summary["out_dir"] == str(teacher)
    assert (teacher_summary["steps"], teacher_summary["preset"]) == (1, None)

    # Another run folder, same settings and tasks: the same folders, not written again.
    written = (policy / "model.safetensors").stat().st_mtime_ns
    assert prepare_policies(config, tmp_path / "run-b", roots) == (policy, teacher)
    assert (policy / "model.safetensors").stat().st_mtime_ns == written

    # A changed setting, or one changed byte in a task, is another warm start.
    key = warm_start_key(config, roots, 2)
    assert warm_start_key(config, roots, 3) != key
    assert warm_start_key(load_config(None, overrides | {"seed": 1}), roots, 2) != key
    assert warm_start_key(config, roots, 2, init_from=policy) != key
    assert warm_start_key(config, roots, 2) == key
    instruction = prep / "tasks" / "count-lines" / "instruction.md"
    instruction.write_text(instruction.read_text() + " ")
    assert warm_start_key(config, roots, 2) != key


def test_without_a_cache_each_run_folder_warm_starts_its_own(
    tmp_path: Path, tiny_prep_dir: Path
) -> None:
    config = load_config(
        None,
        {"policy.preset": "micro", "tasks.prep_dir": str(tiny_prep_dir), "warm_start.steps": 1},
    )
    roots = list(load_pool(tiny_prep_dir, "train").values())
    policy, teacher = prepare_policies(config, tmp_path / "run", roots)
    assert (policy, teacher) == (tmp_path / "run" / "warmstart" / "policy", None)
    assert (policy / "config.json").is_file()
    assert sorted(p.name for p in policy.parent.iterdir()) == ["policy"]


def test_a_killed_warm_starts_scratch_is_removed_and_a_live_ones_kept(
    tmp_path: Path, tiny_prep_dir: Path
) -> None:
    cache = tmp_path / "cache"
    config = load_config(
        None,
        {
            "policy.preset": "micro",
            "tasks.prep_dir": str(tiny_prep_dir),
            "warm_start.steps": 1,
            "warm_start.cache_dir": str(cache),
        },
    )
    roots = list(load_pool(tiny_prep_dir, "train").values())
    target = cache / f"policy-{warm_start_key(config, roots, 1)[:16]}"
    prefix = f".{target.name}.partial-{socket.gethostname()}-"
    ended = subprocess.Popen(["true"])
    ended.wait()  # its pid now names no process (barring reuse within the test)
    live = subprocess.Popen(["sleep", "60"])
    try:
        killed = cache / f"{prefix}{ended.pid}"
        running = cache / f"{prefix}{live.pid}"
        other_host = cache / f".{target.name}.partial-elsewhere-{ended.pid}"
        for folder in (killed, running, other_host):
            folder.mkdir(parents=True)
            (folder / "model.safetensors").write_bytes(b"half written")
        policy, _ = prepare_policies(config, tmp_path / "run", roots)
        assert policy == target
        assert (policy / "config.json").is_file()
        assert not killed.exists()
        assert (running / "model.safetensors").read_bytes() == b"half written"
        assert other_host.exists()
    finally:
        live.kill()
        live.wait()
