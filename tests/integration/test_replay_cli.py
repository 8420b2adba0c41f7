"""`thundersync replay` in a real subprocess: files written, schedules agree, bad input refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import random_batch, reference_grad_j, rel_diff
from thundersync_core.batch import trajectory_to_json
from thundersync_core.policy import load_model
from thundersync_core.replay import compare_gradients

pytestmark = pytest.mark.integration


def thundersync(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "thundersync_core.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / "batch.jsonl"
    batch = random_batch(seed=21, vocab=1024, n_groups=3, group_size=4)
    path.write_text("".join(trajectory_to_json(t) + "\n" for t in batch))
    return path, batch


@pytest.mark.parametrize("loss_agg", ["seq-sum", "token-mean"])
def test_replay_sync_and_stream_agree_in_fp64(micro_model_dir, batch_file, tmp_path, loss_agg):
    path, batch = batch_file
    outs = {}
    for schedule, seed in [("sync", 0), ("stream", 1), ("stream", 2)]:
        out = tmp_path / f"{schedule}-{seed}"
        done = thundersync(
            "replay", "--model", str(micro_model_dir), "--batch", str(path),
            "--objective", "grpo", "--schedule", schedule, "--loss-agg", loss_agg,
            "--dtype", "float64", "--seed", str(seed), "--out", str(out),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        summary = json.loads((out / "summary.json").read_text())
        assert summary["n_sources"] == 12
        assert summary["n_groups"] == 3
        assert summary["wall_s"] > 0
        outs[(schedule, seed)] = out
    sync = outs[("sync", 0)] / "gradient.safetensors"
    for key in [("stream", 1), ("stream", 2)]:
        assert compare_gradients(sync, outs[key] / "gradient.safetensors") <= 1e-10

    model = load_model(micro_model_dir, dtype=torch.float64)
    objective, ref = reference_grad_j(model, batch, loss_agg)
    assert rel_diff(ref, load_file(str(sync))) <= 1e-10
    summary = json.loads((outs[("stream", 1)] / "summary.json").read_text())
    assert summary["objective"] == pytest.approx(objective, rel=1e-10)


def test_malformed_batch_writes_nothing(micro_model_dir, batch_file, tmp_path):
    path, _ = batch_file
    broken = tmp_path / "broken.jsonl"
    lines = path.read_text().splitlines()
    lines[4] = lines[4].replace('"reward"', '"rewrd"')
    broken.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    done = thundersync(
        "replay", "--model", str(micro_model_dir), "--batch", str(broken), "--out", str(out)
    )
    assert done.returncode == 2
    assert "line 5: field" in done.stderr
    assert not out.exists()


def test_model_folder_must_be_a_hugging_face_folder(batch_file, tmp_path):
    path, _ = batch_file
    done = thundersync("replay", "--model", str(tmp_path), "--batch", str(path), "--out", "x")
    assert done.returncode == 2
    assert "no config.json" in done.stderr
