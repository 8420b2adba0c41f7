"""`thundersync replay` in a real subprocess: files written, schedules agree, bad input refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import (
    multi_turn_batch,
    random_batch,
    reference_grad_j,
    reference_grad_l,
    reference_vocab_kl,
    rel_diff,
    with_real_teacher,
)
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
    runs = [("sync", 0, 0, "arrival", "trajectory"), ("stream", 1, 0, "arrival", "trajectory"),
            ("stream", 2, 0, "arrival", "group"), ("stream", 3, 4096, "arrival", "trajectory"),
            ("stream", 4, 64, "fixed", "trajectory"),
            ("stream", 5, 64, "fixed", "chunks")]  # fmt: skip
    if loss_agg == "token-mean":
        # Release rules, packs and orders under token-mean: tests/unit/test_grpo_packed.py
        # and test_grpo_exactness.py, in process; here the CLI's sync and stream agree.
        runs = runs[:2]
    for schedule, seed, pack, order, how in runs:
        out = tmp_path / f"{schedule}-{seed}"
        chunks = ["--chunks", "2"] if how == "chunks" else []
        release = "trajectory" if how == "chunks" else how
        done = thundersync(
            "replay", "--model", str(micro_model_dir), "--batch", str(path),
            "--objective", "grpo", "--schedule", schedule, "--loss-agg", loss_agg,
            "--dtype", "float64", "--seed", str(seed), "--pack-tokens", str(pack),
            "--order", order, "--release", release, *chunks, "--out", str(out),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        summary = json.loads((out / "summary.json").read_text())
        assert summary["n_sources"] == 12
        assert summary["n_groups"] == 3
        assert summary["wall_s"] > 0
        outs[(schedule, seed)] = out
    sync = outs[("sync", 0)] / "gradient.safetensors"
    for key in [k for k in outs if k[0] == "stream"]:
        assert compare_gradients(sync, outs[key] / "gradient.safetensors") <= 1e-10
    model = load_model(micro_model_dir, dtype=torch.float64)
    objective, ref = reference_grad_j(model, batch, loss_agg)
    assert rel_diff(ref, load_file(str(sync))) <= 1e-10
    summary = json.loads((outs[("stream", 1)] / "summary.json").read_text())
    assert summary["objective"] == pytest.approx(objective, rel=1e-10)
    if loss_agg == "token-mean":
        return
    # Released per closed group: no per-trajectory backward ran before its group was whole.
    grouped = json.loads((outs[("stream", 2)] / "summary.json").read_text())
    assert grouped["release"] == "group"
    assert grouped["counters"]["peak_open_groups"] == 1
    packed = json.loads((outs[("stream", 3)] / "summary.json").read_text())["counters"]
    assert packed["packed_trajectories"] > 0  # the packed path ran
    fixed = json.loads((outs[("stream", 4)] / "summary.json").read_text())
    assert fixed["order"] == "fixed"
    # Every trajectory ran in a pack (none one at a time), a group at a time.
    assert fixed["counters"]["packed_trajectories"] == 12
    assert fixed["counters"]["trajectory_backwards"] == 0
    # Each group as two id-chunks (its rewards graded: each chunk has two values).
    chunked = json.loads((outs[("stream", 5)] / "summary.json").read_text())["counters"]
    assert chunked["chunks_run"] == 6
    assert chunked["trajectory_backwards"] == 0


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


@pytest.fixture(scope="module")
def opd_batch_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("opd") / "batch.jsonl"
    batch = multi_turn_batch(seed=31, vocab=1024)
    path.write_text("".join(trajectory_to_json(t) + "\n" for t in batch))
    return path, batch


def test_replay_opd_sync_and_stream_agree_in_fp64(micro_model_dir, opd_batch_file, tmp_path):
    path, batch = opd_batch_file
    outs = []
    for schedule, seed in [("sync", 0), ("stream", 3), ("stream", 4)]:
        out = tmp_path / f"{schedule}-{seed}"
        done = thundersync(
            "replay", "--model", str(micro_model_dir), "--batch", str(path),
            "--objective", "opd", "--schedule", schedule, "--dtype", "float64",
            "--seed", str(seed), "--out", str(out),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        outs.append(out / "gradient.safetensors")
    assert compare_gradients(outs[0], outs[1]) <= 1e-10
    assert compare_gradients(outs[0], outs[2]) <= 1e-10
    model = load_model(micro_model_dir, dtype=torch.float64)
    loss, ref = reference_grad_l(model, batch)
    assert rel_diff(ref, load_file(str(outs[1]))) <= 1e-10
    summary = json.loads((tmp_path / "stream-3" / "summary.json").read_text())
    assert summary["objective"] == pytest.approx(loss, rel=1e-10)
    assert summary["n_sources"] == sum(sum(s.kind == "action" for s in t.segments) for t in batch)


def test_replay_opd_refuses_missing_teacher_scores_naming_the_turn(
    micro_model_dir, opd_batch_file, tmp_path
):
    path, _ = opd_batch_file
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[3]["teacher_logprobs"] = records[3]["teacher_logprobs"][:-1]
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    done = thundersync(
        "replay", "--model", str(micro_model_dir), "--batch", str(broken),
        "--objective", "opd", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 2
    assert f"trajectory {records[3]['trajectory_id']!r}" in done.stderr
    assert "per turn" in done.stderr
    assert not out.exists()


def test_replay_opd_with_the_teachers_top_k(micro_model_dir, tmp_path):
    """A batch whose records carry the teacher's top-k replays the KL over the vocabulary:
    sync and stream equal the reference; a batch mixing two k is refused."""
    batch = with_real_teacher(multi_turn_batch(seed=33, vocab=1024), 4)
    path = tmp_path / "top.jsonl"
    path.write_text("".join(trajectory_to_json(t) + "\n" for t in batch))
    outs = []
    for schedule in ("sync", "stream"):
        out = tmp_path / schedule
        done = thundersync(
            "replay", "--model", str(micro_model_dir), "--batch", str(path),
            "--objective", "opd", "--schedule", schedule, "--dtype", "float64",
            "--out", str(out),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        outs.append(out / "gradient.safetensors")
        assert json.loads((out / "summary.json").read_text())["teacher_top_k"] == 4
    model = load_model(micro_model_dir, dtype=torch.float64)
    _, ref = reference_vocab_kl(model, batch, 4)
    for out in outs:
        assert rel_diff(ref, load_file(str(out))) <= 1e-10

    records = [json.loads(line) for line in path.read_text().splitlines()]
    k8 = with_real_teacher([batch[2]], 8)[0]
    records[2]["teacher_top_ids"] = list(k8.teacher_top_ids or ())
    records[2]["teacher_top_logprobs"] = list(k8.teacher_top_logprobs or ())
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in records))
    done = thundersync(
        "replay", "--model", str(micro_model_dir), "--batch", str(mixed),
        "--objective", "opd", "--out", str(tmp_path / "mixed-out"),
    )  # fmt: skip
    assert done.returncode == 2
    assert f"trajectory {records[2]['trajectory_id']!r}: teacher top-8" in done.stderr
    assert not (tmp_path / "mixed-out").exists()
