"""``benchmarks/core_overlap.py``: real worker processes, briefly; its figures hang together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "core_overlap.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_each_pair_is_measured_against_its_own_alone_rates(tmp_path):
    cores = sorted(os.sched_getaffinity(0))[:2]
    out = tmp_path / "overlap.json"
    done = _run(
        "--seconds", "0.3", "--repeats", "2", "--workloads", "spawn",
        "--cores", *map(str, cores), "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert json.loads(done.stdout.splitlines()[-1]) == result
    assert [p["pair"] for p in result["pairs"]] == [f"spawn@{cores[0]} + matmul@{cores[1]}"]
    for pair in result["pairs"]:
        assert len(pair["repeats"]) == 2
        for r in pair["repeats"]:
            assert r["alone_first"] > 0
            assert r["alone_second"] > 0
            assert r["overlap_ceiling"] == pytest.approx(
                1 / r["slowdown_first"] + 1 / r["slowdown_second"]
            )
        ceilings = [r["overlap_ceiling"] for r in pair["repeats"]]
        assert pair["ceiling_range"] == [min(ceilings), max(ceilings)]


def test_the_two_cores_must_differ():
    done = _run("--cores", "0", "0")
    assert done.returncode == 2
    assert "--cores: two different cores" in done.stderr
