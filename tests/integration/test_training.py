"""The training stage end to end on Ray: real rollouts in the local sandbox, real graders.

The policy is the tiny model warm-started briefly on the two fixture tasks, so it solves
them about half the time and GRPO updates are not zero. The engine is the transformers
engine (deterministic per request seed, and no 30 s engine start per run); the vLLM path
runs in the embedded end-to-end run and the engine tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from eval.report import STEP_PARTS
from tests.helpers import checkpoint_weights, max_rel_diff, train_config_file
from thundersync_core.batch import read_batch
from thundersync_core.config import load_config
from thundersync_core.policy import build_model, build_tokenizer, save_policy
from thundersync_core.rollout.vllm_engine import vllm_available
from thundersync_core.rollout.weights import publication_root
from thundersync_core.streaming.grpo_stream import _packs
from thundersync_core.train import TrainingError, train
from thundersync_core.train_cli import PREEMPTED_EXIT

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_sync_and_thundersync_agree_on_the_first_step(tmp_path, tiny_prep_dir, solver_policy_dir):
    runs = {}
    variants = {
        "sync": {"schedule": "sync"},
        "thundersync": {"schedule": "thundersync"},
        "thundersync-fixed": {"schedule": "thundersync", "learner_order": "fixed"},
        # Backwards once a group's rewards are all in, with no per-group statistics.
        "thundersync-group": {"schedule": "thundersync", "grpo_release": "group"},
    }
    for name, overrides in variants.items():
        cfg = load_config(train_config_file(tmp_path, tiny_prep_dir, solver_policy_dir), overrides)
        train(cfg, tmp_path / name)
        runs[name] = tmp_path / name
    sync_batch = read_batch(runs["sync"] / "batches" / "step-000000.jsonl")
    stream_batch = read_batch(runs["thundersync"] / "batches" / "step-000000.jsonl")
    key = lambda t: t.trajectory_id  # noqa: E731
    sync_batch, stream_batch = sorted(sync_batch, key=key), sorted(stream_batch, key=key)
    assert [t.response_ids for t in sync_batch] == [t.response_ids for t in stream_batch]
    assert [t.reward for t in sync_batch] == [t.reward for t in stream_batch]
    rewards = {t.reward for t in sync_batch}
    assert len(rewards) > 1, "uniform rewards would make the update trivially equal"

    start = load_file(str(solver_policy_dir / "model.safetensors"))
    after_sync, after_stream = (
        checkpoint_weights(runs["sync"], 1),
        checkpoint_weights(runs["thundersync"], 1),
    )
    update_sync = {k: after_sync[k] - start[k] for k in start}
    update_stream = {k: after_stream[k] - start[k] for k in start}
    norm = torch.sqrt(sum((u**2).sum() for u in update_sync.values()))
    diff = torch.sqrt(sum(((update_sync[k] - update_stream[k]) ** 2).sum() for k in start))
    assert float(norm) > 0
    assert float(diff / norm) < 1e-3
    metrics = {s: json.loads((runs[s] / "metrics.jsonl").read_text().splitlines()[0]) for s in runs}
    for name in ("thundersync", "thundersync-group"):
        assert metrics["sync"]["loss"] == pytest.approx(metrics[name]["loss"], rel=1e-4)
        assert metrics["sync"]["grad_norm"] == pytest.approx(metrics[name]["grad_norm"], rel=1e-4)
    # Released per group: trajectories ran as one-row packs with their final advantages
    # (one backward each, none where a group's rewards are uniform).
    assert 0 < metrics["thundersync-group"]["pack_backwards"] <= 8
    assert metrics["thundersync"]["pack_backwards"] == 0
    for record in metrics.values():  # every second of the step is named once
        parts = [record[f"wall_{part}_s"] for part in STEP_PARTS]
        assert min(parts) >= 0.0
        assert sum(parts) == pytest.approx(record["step_wall_s"], rel=1e-9)
        assert record["wall_generation_s"] > 0
        assert record["wall_optimizer_s"] > 0
        assert record["wall_overhead_fraction"] < 0.5
    # In trajectory-id order the streamed sums are the ones sync takes: bitwise one update.
    fixed = checkpoint_weights(runs["thundersync-fixed"], 1)
    assert all(torch.equal(fixed[k], after_sync[k]) for k in start)


def test_packed_learners_give_the_per_source_update(tmp_path, tiny_prep_dir, solver_policy_dir):
    records = {}
    for name, schedule, pack, order in (
        ("per-source", "sync", 0, "arrival"),
        ("sync-packed", "sync", 4096, "fixed"),
        ("thundersync-packed", "thundersync", 4096, "fixed"),
        # Its first batch is sync's, sampled by the weights it trains (importance weights 1).
        ("async-packed", "async", 4096, "fixed"),
    ):
        cfg = load_config(
            train_config_file(tmp_path, tiny_prep_dir, solver_policy_dir),
            {"schedule": schedule, "learner_pack_tokens": pack, "learner_order": order},
        )
        train(cfg, tmp_path / name)
        records[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
    # Sync hands the batch over at once: each group runs as its packs (rows cut by length),
    # one backward each unless its rewards are all equal (no advantage, no gradient).
    members: dict[str, list] = {}
    for traj in read_batch(tmp_path / "sync-packed" / "batches" / "step-000000.jsonl"):
        members.setdefault(traj.group_id, []).append(traj)
    assert records["sync-packed"]["pack_backwards"] == sum(
        len(_packs(sorted(m, key=lambda t: t.trajectory_id), 4096))
        for m in members.values()
        if len({t.reward for t in m}) > 1
    )
    assert records["sync-packed"]["pack_backwards"] >= 1
    # A group whose rewards are all equal (every advantage 0) takes no forward either.
    mixed = _in_mixed_groups(tmp_path / "sync-packed" / "batches" / "step-000000.jsonl")
    assert 0 < mixed <= 8
    assert records["sync-packed"]["packed_trajectories"] == mixed
    assert records["per-source"]["pack_backwards"] == 0
    assert records["async-packed"]["packed_trajectories"] == mixed
    for name in ("sync-packed", "thundersync-packed", "async-packed"):
        for key in ("loss", "grad_norm", "reward_mean"):
            assert records[name][key] == pytest.approx(records["per-source"][key], rel=1e-5), key
    # Packs in trajectory-id order: thundersync's update is bitwise sync's.
    assert records["thundersync-packed"]["packed_trajectories"] == mixed
    sync, stream = (
        checkpoint_weights(tmp_path / n, 1) for n in ("sync-packed", "thundersync-packed")
    )
    assert sync.keys() == stream.keys()
    assert all(torch.equal(sync[k], stream[k]) for k in sync)


def test_opd_over_the_teachers_top_k_agrees_between_sync_and_thundersync(
    tmp_path, tiny_prep_dir, solver_policy_dir, tiny_policy_dir
):
    """The teacher actor sends its top-k per token, both schedules' learners train on the
    KL over the vocabulary, and their first updates agree."""
    updates, metrics = {}, {}
    start = load_file(str(solver_policy_dir / "model.safetensors"))
    for schedule in ("sync", "thundersync"):
        config = train_config_file(
            tmp_path,
            tiny_prep_dir,
            solver_policy_dir,
            objective="opd",
            schedule=schedule,
            opd_teacher_top_k=4,
            policy__teacher_path=str(tiny_policy_dir),
        )
        train(load_config(config), tmp_path / schedule)
        after = checkpoint_weights(tmp_path / schedule, 1)
        updates[schedule] = {k: after[k] - start[k] for k in start}
        metrics[schedule] = json.loads(
            (tmp_path / schedule / "metrics.jsonl").read_text().splitlines()[0]
        )
    norm = torch.sqrt(sum((u**2).sum() for u in updates["sync"].values()))
    diff = torch.sqrt(
        sum(((updates["sync"][k] - updates["thundersync"][k]) ** 2).sum() for k in start)
    )
    assert float(norm) > 0
    assert float(diff / norm) < 1e-3
    # A random teacher is far from the student: the KL over the vocabulary is large.
    assert metrics["sync"]["loss"] > 1.0
    assert metrics["sync"]["loss"] == pytest.approx(metrics["thundersync"]["loss"], rel=1e-4)
    assert metrics["sync"]["reverse_kl"] == pytest.approx(
        metrics["thundersync"]["reverse_kl"], rel=1e-4
    )


def publications_of(pid: int) -> list[Path]:
    """The weight-publication folders process ``pid`` of this host made."""
    return sorted(publication_root().glob(f"thundersync-publish-{socket.gethostname()}-{pid}-*"))


def _run_and_kill(config: Path, out: Path) -> int:
    """Start ``thundersync train`` and kill its whole process group mid-run, right after
    the first checkpoint is complete (the second step is then in flight); returns its pid."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "thundersync_core.cli",
            "train",
            "--config",
            str(config),
            "--out",
            str(out),
        ],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    marker = out / "checkpoints" / "step-000001" / "state.json"
    try:
        deadline = time.time() + 240
        while not marker.exists():
            assert proc.poll() is None, "the run ended before its first checkpoint"
            assert time.time() < deadline, "no checkpoint within 240 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.pid


# thundersync exports its checkpoints in bfloat16: the resume takes the float32 master
# beside the export, and the engines get it before the first step. (A sync run resumed
# from float32 checkpoints after a killed role: tests/integration/test_faults.py.)
@pytest.mark.parametrize(("schedule", "export"), [("thundersync", "bfloat16")])
def test_kill_and_resume_ends_with_the_uninterrupted_weights(
    tmp_path, tiny_prep_dir, solver_policy_dir, uninterrupted_run, schedule, export
):
    config = train_config_file(
        tmp_path,
        tiny_prep_dir,
        solver_policy_dir,
        schedule=schedule,
        steps=3,
        learner_order="fixed",
        checkpoint_keep_last=1,  # the resume must still find the latest whole
        checkpoint_keep_every=2,
        checkpoint_export_dtype=export,
    )
    killed_pid = _run_and_kill(config, tmp_path / "killed")
    assert not (tmp_path / "killed" / "checkpoints" / "step-000003").exists()
    assert publications_of(killed_pid), "the killed run left its weight files behind"
    summary = train(load_config(config), tmp_path / "killed", resume=True)
    assert summary["status"] == "finished"
    # The resumed run removed the dead run's publication folder, and its own at the end.
    assert publications_of(killed_pid) == publications_of(os.getpid()) == []
    # The session's uninterrupted sync run (3 steps, fixed order) is the reference.
    last = tmp_path / "killed" / "checkpoints" / "step-000003"
    whole, resumed = (
        checkpoint_weights(uninterrupted_run, 3),
        load_file(str(last / "master.safetensors"))
        if export == "bfloat16"
        else checkpoint_weights(tmp_path / "killed", 3),
    )
    exported = checkpoint_weights(tmp_path / "killed", 3)
    assert {t.dtype for t in exported.values()} == {getattr(torch, export)}
    start = load_file(str(solver_policy_dir / "model.safetensors"))
    assert max_rel_diff(start, whole) > 1e-4, "training must have moved the weights"
    # Bitwise: the sums are taken in trajectory-id order whatever order rewards landed in.
    assert max_rel_diff(whole, resumed) == 0.0
    # Retention: the last checkpoint whole, step 2 (on checkpoint_keep_every) as weights.
    root = tmp_path / "killed" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000003"]
    assert {p.name for p in (root / "step-000002").iterdir()} == {"model", "state.json"}
    steps = [
        json.loads(x)["step"]
        for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [0, 1, 2]


# thundersync, whose learner holds a batch half-streamed when the signal lands; sync's
# stop between steps is the same path with nothing streamed.
@pytest.mark.parametrize("schedule", ["thundersync"])
def test_sigterm_stops_after_the_step_with_a_checkpoint_and_resume_ends_as_uninterrupted(
    tmp_path, tiny_prep_dir, solver_policy_dir, uninterrupted_run, schedule
):
    # Checkpoints only at the end: the one the stop leaves is written because of it.
    config = train_config_file(
        tmp_path,
        tiny_prep_dir,
        solver_policy_dir,
        schedule=schedule,
        steps=3,
        checkpoint_every=3,
        learner_order="fixed",
    )
    out = tmp_path / "stopped"
    argv = [sys.executable, "-m", "thundersync_core.cli", "train", "--config", str(config)]
    proc = subprocess.Popen(
        [*argv, "--out", str(out)],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.time() + 240
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
            assert proc.poll() is None, "the run ended before its first step"
            assert time.time() < deadline, "no step within 240 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # the driver alone, as a scheduler preempts it
        stdout, _ = proc.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == PREEMPTED_EXIT, stdout
    assert "preempted: SIGTERM: stopped after step" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "preempted"
    assert 1 <= summary["steps"] < 3
    assert (out / "checkpoints" / f"step-{summary['steps']:06d}" / "state.json").is_file()
    assert train(load_config(config), out, resume=True)["status"] == "finished"
    whole = checkpoint_weights(uninterrupted_run, 3)  # the session's sync reference
    assert max_rel_diff(whole, checkpoint_weights(out, 3)) == 0


def test_dev_is_measured_before_and_after_task_by_task(tmp_path, tiny_prep_dir, solver_policy_dir):
    # The policy "already saw" write-hello: dev_exclude leaves it out of the measure.
    seen = tmp_path / "seen" / "write-hello"
    shutil.copytree(tiny_prep_dir / "tasks" / "write-hello", seen)
    table = tmp_path / "dev-with-instructions"
    shutil.copytree(tiny_prep_dir, table)
    rows = pq.read_table(table / "terminal" / "dev.parquet").to_pylist()
    for row in rows:
        row["instruction"] = (table / row["path"] / "instruction.md").read_text()
    pq.write_table(pa.Table.from_pylist(rows), table / "terminal" / "dev.parquet")
    config = train_config_file(
        tmp_path, table, solver_policy_dir, tasks__dev_tasks=4, tasks__dev_samples=3,
        tasks__dev_exclude=[str(seen.parent)],
    )  # fmt: skip
    summary = train(load_config(config), tmp_path / "run")
    assert summary["dev_left_out"] == 1
    for when in ("dev_before", "dev_after"):
        dev = summary[when]
        assert (dev["tasks"], dev["samples"]) == (1, 3)
        assert set(dev["solved"]) == {"count-lines"}
        assert dev["pass_rate"] == pytest.approx(dev["solved"]["count-lines"] / 3)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["dev_left_out"] == 1
    # A resumed run (here: one already at its last step) keeps the first dev measure.
    again = train(load_config(config), tmp_path / "run", resume=True)
    assert again["dev_before"] == summary["dev_before"]


def test_non_finite_teacher_scores_stop_the_run_and_keep_checkpoints(
    tmp_path, tiny_prep_dir, solver_policy_dir
):
    config = train_config_file(
        tmp_path, tiny_prep_dir, solver_policy_dir, objective="opd", schedule="thundersync"
    )
    run = tmp_path / "run"
    train(load_config(config), run)
    checkpoint = run / "checkpoints" / "step-000001"
    digest = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in checkpoint.rglob("*")
        if p.is_file()
    }

    broken = build_model("tiny", seed=1)
    with torch.no_grad():
        for p in broken.parameters():
            p.fill_(float("nan"))
    save_policy(
        broken, build_tokenizer(vocab_size=broken.config.vocab_size), tmp_path / "nan-teacher"
    )
    bad = train_config_file(
        tmp_path,
        tiny_prep_dir,
        solver_policy_dir,
        objective="opd",
        schedule="thundersync",
        steps=2,
        policy__teacher_path=str(tmp_path / "nan-teacher"),
    )
    with pytest.raises(TrainingError, match=r"step 1: trajectory 's00001-g\d-[a-z-]+/\d' turn 0"):
        train(load_config(bad), run, resume=True)
    assert not (run / "checkpoints" / "step-000002").exists()
    after = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in checkpoint.rglob("*")
        if p.is_file()
    }
    assert after == digest
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"


@pytest.mark.parametrize(
    ("schedule", "objective", "engine"),
    [("async", "grpo", "hf"), ("pipeline", "opd", "hf"), ("pipeline", "grpo", "vllm")],
)
def test_off_policy_schedules_record_bounded_staleness(
    tmp_path, tiny_prep_dir, solver_policy_dir, schedule, objective, engine
):
    if engine == "vllm" and not vllm_available():
        pytest.skip("vLLM is not installed")
    # On vLLM the pipeline runs two engines and publishes by collective: the learner
    # broadcasts each version, both engines take it at their next round, checked against
    # what was sent (verify_publication), and the staleness bound holds over both.
    engines = 2 if engine == "vllm" else 1
    publication = (
        {"rollout__publication": "collective", "rollout__verify_publication": True}
        if engine == "vllm"
        else {}
    )
    # GRPO as the embedded demo runs it: a group once whole, in trajectory-id order, as packs.
    packs = {"learner_pack_tokens": 4096, "learner_order": "fixed"} if objective == "grpo" else {}
    config = train_config_file(
        tmp_path,
        tiny_prep_dir,
        solver_policy_dir,
        schedule=schedule,
        objective=objective,
        steps=3,
        max_staleness=1,
        rollout__engine=engine,
        tasks__dev_tasks=2,
        tasks__dev_samples=1,
        resources__rollout__engines=engines,
        **publication,
        **packs,
    )
    summary = train(load_config(config), tmp_path / "run")
    # The dev evaluation after training samples the last step's weights (the pipeline's
    # last publication is queued, not swapped: it is applied first).
    assert summary["dev_after"]["policy_version"] == 3
    # The run's published weight files (under /dev/shm) are gone with it.
    assert not list(publication_root().glob(f"thundersync-publish-*-{os.getpid()}-run-*"))
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["policy_version"] for r in records] == [1, 2, 3]
    for record in records:
        lags = {int(k) for k, v in record["staleness_tokens"].items() if v}
        assert lags <= {0, 1}, record["staleness_tokens"]
        # OPD's step figure of merit, the sampled KL to the teacher; GRPO has none.
        if objective == "opd":
            assert math.isfinite(record["reverse_kl"])
        else:
            assert record["reverse_kl"] is None
            # Every trajectory of a group with two reward values runs in a pack.
            batch = tmp_path / "run" / "batches" / f"step-{record['step']:06d}.jsonl"
            assert record["packed_trajectories"] == _in_mixed_groups(batch)
        if publication:
            # Every version was broadcast whole to both engines (the tiny model's float32
            # weights), and arrived checked.
            assert record["publication_bytes"] > 0, record
        if engines > 1:
            # Both engines sampled, each with versions the bound allows (the next batch may
            # already have begun with the version this step made).
            assert min(record["engine_requests"]) > 0, record["engine_requests"]
            for versions in record["engine_versions"]:
                assert versions, record["engine_versions"]
                assert all(record["step"] - 1 <= v <= record["step"] + 1 for v in versions)
    if schedule == "async":
        # Batch k is sampled by theta_{k-1}: every token of steps 1 and 2 is one version old.
        assert set(records[1]["staleness_tokens"]) == {"1"}
        assert set(records[2]["staleness_tokens"]) == {"1"}
        assert records[1]["is_weight_mean"] is not None
        # Weights change only between batches: no trajectory spans two versions.
        assert [r["inflight_swaps"] for r in records] == [0, 0, 0]


def test_the_bench_runs_both_schedules_on_the_same_batches(
    tmp_path, tiny_prep_dir, solver_policy_dir
):
    from thundersync_core.bench import run_bench  # noqa: PLC0415

    config = load_config(train_config_file(tmp_path, tiny_prep_dir, solver_policy_dir))
    report = run_bench(config, tmp_path / "bench", steps=2)
    assert report["steps"] == 2
    assert set(report["schedules"]) == {"sync", "thundersync"}
    assert all(r > 0 for r in report["step_time_ratio"])
    speedup = report["speedup"]
    assert speedup["low"] <= speedup["geometric_mean"] <= speedup["high"]
    assert report["schedule_attributable_speedup"]["geometric_mean"] > 0
    check = report["rollout_stage_sync_vs_thundersync"]
    assert check["sync_longer"] + check["thundersync_longer"] <= 2
    assert [p["step"] for p in report["perfmodel"]] == [0, 1]
    assert json.loads((tmp_path / "bench" / "bench.json").read_text()) == report
    # The bench's learners and their weight files are gone once it ends.
    assert not list(publication_root().glob(f"thundersync-publish-*-{os.getpid()}-bench-*"))


def _in_mixed_groups(batch_file) -> int:
    """Trajectories of a logged batch whose group has two reward values or more."""
    members: dict[str, list] = {}
    for traj in read_batch(batch_file):
        members.setdefault(traj.group_id, []).append(traj)
    return sum(len(m) for m in members.values() if len({t.reward for t in m}) > 1)
