"""The prepared GPU check runs on a CPU too: its CUDA parts fall back to the CPU (gloo ranks,
float32 schedule model) or skip with a reason, and its exactness checks still judge."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check"
    done = subprocess.run(
        [
            sys.executable,
            "scripts/gpu_check.py",
            "--out",
            str(out),
            "--no-vllm",
            "--bench-repeats",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["cuda"] is False
    assert summary["failed"] == []
    learner = summary["learner"]
    assert learner["ok"]
    assert learner["fp32_rel_error"] <= 1e-5
    assert 0 < learner["bf16_rel_error"] <= 5e-2
    assert learner["bf16_master_grad_is_fp32_accumulator"]
    assert summary["worker"]["replica"] == ["cpu:torch.bfloat16"]
    assert summary["worker"]["published_is_master_fp32"]
    ranks = summary["ranks"]
    assert ranks["ok"]
    assert ranks["world_size"] == 2
    assert ranks["backend"] == "gloo"
    assert ranks["ranks"][0]["fp32_rel_error"] <= 1e-5
    assert ranks["ranks"][0]["sharded_grad_rel_error"] <= 1e-5
    assert all(r["sharded_grad_bytes"] > 0 for r in ranks["ranks"])
    assert summary["vllm"] == {"ok": None, "skipped": "--no-vllm"}
    schedule = summary["schedule"]
    assert schedule["ok"]
    assert all(schedule["bitwise_equal_to_sync"].values())
    assert schedule["step_s"]["sync"] > schedule["sync_learner_busy_s"] > 0
