"""``thundersync perfmodel`` and ``thundersync plan`` through the real command entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from thundersync_core.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "plan_example.yaml"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_analytic(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys, "perfmodel", "analytic", "--rho", "2", "--sources", "10", "--rollout-s", "30"
    )
    assert code == 0
    result = json.loads(out)
    assert result["speedup"] == pytest.approx(1.5)
    assert result["tail"]["lower_r"] == pytest.approx(1.0)
    assert result["seconds"]["sync_step_s"] == pytest.approx(90.0)
    assert result["finite_sources"]["tail_r"] == pytest.approx(1.1)


def test_analytic_rejects_bad_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "perfmodel", "analytic", "--rho", "1", "--release-lag", "2")
    assert code == 2
    assert "thundersync perfmodel: error: release_lag must lie in [0, 1]" in err


def _write_trace(path: Path, service_s: float) -> Path:
    trace = {
        "suffix_s": 0.5,
        "rollout_start_s": 0.0,
        "ranks": [
            {
                "sources": [
                    {"release_s": 1.0, "service_s": 2.0},
                    {"release_s": 3.0, "service_s": 1.0},
                ]
            },
            {
                "sources": [
                    {"release_s": 2.0, "service_s": 0.5},
                    {"release_s": 5.0, "service_s": service_s},
                ]
            },
        ],
        "measured": {"sync_step_s": 9.0, "thundersync_step_s": 7.0},
    }
    path.write_text(json.dumps(trace))
    return path


def test_trace_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    first = _write_trace(tmp_path / "a.json", 1.0)
    second = _write_trace(tmp_path / "b.json", 2.0)
    code, out, _ = _run(capsys, "perfmodel", "trace", "--trace", str(first), str(second))
    assert code == 0
    result = json.loads(out)
    assert result["files"][str(first)]["thundersync"]["step_s"] == pytest.approx(6.5)
    assert result["files"][str(second)]["thundersync"]["step_s"] == pytest.approx(7.5)
    assert result["measured_files"] == 2
    assert isinstance(result["mean_speedup_relative_error"], float)


def test_trace_malformed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = _write_trace(tmp_path / "bad.json", -1.0)
    code, _, err = _run(capsys, "perfmodel", "trace", "--trace", str(bad))
    assert code == 2
    assert "bad.json: ranks[1].sources[1].service_s: must be a non-negative number" in err


def test_simulate_preset(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "perfmodel", "simulate", "--steps", "3")
    assert code == 0
    result = json.loads(out)
    assert result["source"] == "preset:talk-stragglers"
    assert set(result["schedules"]) == {"sync", "thundersync", "async", "pipeline"}
    assert len(result["schedules"]["sync"]["step_s"]) == 3


def test_plan_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", "--config", str(EXAMPLE))
    assert code == 0
    assert "winner: pipeline" in out
    assert "pruned " in out
    code, out, _ = _run(capsys, "plan", "--config", str(EXAMPLE), "--json")
    assert code == 0
    assert json.loads(out)["winner"]["schedule"] == "pipeline"


def test_plan_bad_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("devices: 1\nbatch_size: 8\nlearner: {tokens_per_s_per_device: 1}\n")
    code, _, err = _run(capsys, "plan", "--config", str(path))
    assert code == 2
    assert "thundersync plan: error:" in err
    assert "devices" in err


def test_package_imports_neither_torch_nor_ray() -> None:
    code = (
        "import sys\n"
        "import thundersync_core.perfmodel.cli, thundersync_core.perfmodel.plan_cli\n"
        "import thundersync_core.perfmodel.simulate, thundersync_core.perfmodel.planner\n"
        "heavy = sorted(m for m in ('torch', 'ray', 'vllm') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
