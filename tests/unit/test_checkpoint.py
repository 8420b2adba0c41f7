"""Exact resume: k steps, save, restore into fresh objects, go on == one uninterrupted run."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import subprocess

import pytest
import torch

from tests.helpers import random_batch
from thundersync_core.checkpoint import (
    CheckpointWriteError,
    due,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from thundersync_core.policy import build_model
from thundersync_core.streaming import StreamingGRPOLearner, groups_of


def train(model, optimizer, learner, steps: int) -> None:
    """GRPO steps whose batches and arrival orders come from the global RNGs."""
    for _ in range(steps):
        seed = int(torch.randint(0, 2**31, (1,)))
        batch = [
            dataclasses.replace(t, policy_version=learner.policy_version)
            for t in random_batch(seed=seed, vocab=1024, n_groups=2, group_size=3)
        ]
        learner.begin_batch(groups_of(batch))
        for traj in random.sample(batch, len(batch)):
            learner.submit(traj)
        learner.step(optimizer)


def fresh(seed: int):
    model = build_model("micro", seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer, StreamingGRPOLearner(model)


def uninterrupted_and_saved(tmp_path, **save):
    """Three steps of a run, and the same run's first two saved at step 2 (``save``: more
    arguments of ``save_checkpoint``); returns the three-step run's objects, the two-step
    model and the checkpoint."""
    torch.manual_seed(0)
    random.seed(0)
    model_a, opt_a, learner_a = fresh(1)
    train(model_a, opt_a, learner_a, 3)

    torch.manual_seed(0)
    random.seed(0)
    model_b, opt_b, learner_b = fresh(1)
    train(model_b, opt_b, learner_b, 2)
    path = save_checkpoint(
        tmp_path,
        step=2,
        model=model_b,
        optimizer=opt_b,
        policy_version=learner_b.policy_version,
        **save,
    )
    return model_a, learner_a, model_b, path


def test_resume_is_bitwise_exact(tmp_path):
    model_a, learner_a, _, path = uninterrupted_and_saved(tmp_path)
    torch.manual_seed(123)  # disturb every RNG the resume must restore
    random.seed(123)

    model_c, opt_c, learner_c = fresh(7)  # different initial weights on purpose
    state = load_checkpoint(path, model=model_c, optimizer=opt_c)
    learner_c.policy_version = state["policy_version"]
    assert state["step"] == 2
    train(model_c, opt_c, learner_c, 1)
    for (name, a), (_, c) in zip(
        model_a.named_parameters(), model_c.named_parameters(), strict=True
    ):
        assert torch.equal(a, c), name
    assert learner_c.policy_version == learner_a.policy_version == 3


def test_latest_ignores_partial_and_steps_are_saved_once(tmp_path):
    model, optimizer, _ = fresh(0)
    save_checkpoint(tmp_path, step=2, model=model, optimizer=optimizer, policy_version=2)
    save_checkpoint(tmp_path, step=10, model=model, optimizer=optimizer, policy_version=10)
    (tmp_path / ".step-000012.partial").mkdir()  # a crash mid-write
    (tmp_path / "step-000011").mkdir()  # no state.json: not a checkpoint
    assert latest_checkpoint(tmp_path).name == "step-000010"
    with pytest.raises(FileExistsError, match="saved once"):
        save_checkpoint(tmp_path, step=10, model=model, optimizer=optimizer, policy_version=10)
    assert [s for s in range(1, 13) if due(s, 4)] == [4, 8, 12]
    with pytest.raises(ValueError, match="cadence"):
        due(3, 0)


@pytest.fixture
def small_disk(tmp_path):
    """A file system with room for one micro checkpoint and a half (a tmpfs; needs root)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    model, optimizer, _ = fresh(0)
    save_checkpoint(tmp_path / "probe", step=1, model=model, optimizer=optimizer, policy_version=1)
    size = sum(p.stat().st_size for p in (tmp_path / "probe").rglob("*") if p.is_file())
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size * 3 // 2}", "tmpfs", str(disk)], check=False
    )
    if mounted.returncode != 0:
        pytest.skip("this machine does not let root mount a tmpfs")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_keeps_the_previous_checkpoint_whole(small_disk):
    model, optimizer, learner = fresh(0)
    first = save_checkpoint(small_disk, step=1, model=model, optimizer=optimizer, policy_version=1)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    train(model, optimizer, learner, 1)
    with pytest.raises(CheckpointWriteError, match=r"000002 failed .*No space left.*000001"):
        save_checkpoint(small_disk, step=2, model=model, optimizer=optimizer, policy_version=2)
    assert latest_checkpoint(small_disk) == first
    assert sorted(p.name for p in small_disk.iterdir()) == ["step-000001"]  # no partial left
    restored, restored_optimizer, _ = fresh(1)
    state = load_checkpoint(first, model=restored, optimizer=restored_optimizer)
    assert state["step"] == 1
    for name, param in restored.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_pruning_keeps_the_last_whole_and_the_evaluation_cadence_as_weights(tmp_path):
    """keep_last 2, keep_every 4 over steps 1..9: 8 and 9 stay whole (the latest is what a
    resume takes), 4 keeps weights and state.json for evaluation, the rest go; a resume
    from a weights-only checkpoint is refused by name."""
    model = build_model("micro", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    root = tmp_path / "checkpoints"
    pruned = []
    for step in range(1, 10):
        save_checkpoint(root, step=step, model=model, optimizer=optimizer, policy_version=step)
        pruned.append(prune_checkpoints(root, keep_last=2, keep_every=4))
    assert sorted(p.name for p in root.iterdir()) == ["step-000004", "step-000008", "step-000009"]
    assert pruned[3] == {"weights_only": [], "removed": [2]}  # after step 4: 3 and 4 kept
    assert pruned[5] == {"weights_only": [4], "removed": []}  # after step 6: 4 slimmed
    assert pruned[6] == {"weights_only": [], "removed": [5]}  # already slim: left alone
    for step in (8, 9):
        assert {p.name for p in (root / f"step-{step:06d}").iterdir()} == {
            "model",
            "optimizer.pt",
            "rng.pt",
            "state.json",
        }
    slim = root / "step-000004"
    assert {p.name for p in slim.iterdir()} == {"model", "state.json"}
    assert (slim / "model" / "config.json").is_file()
    assert latest_checkpoint(root) == root / "step-000009"
    with pytest.raises(ValueError, match=r"step-000004 holds weights only"):
        load_checkpoint(slim, model=model, optimizer=optimizer)
    load_checkpoint(root / "step-000009", model=model, optimizer=optimizer)
    # keep_last 0 keeps everything; pruning again changes nothing.
    assert prune_checkpoints(root, keep_last=0) == {"weights_only": [], "removed": []}
    assert prune_checkpoints(root, keep_last=2, keep_every=4) == {"weights_only": [], "removed": []}


def test_a_bfloat16_export_keeps_the_float32_master_and_resumes_bitwise(tmp_path):
    from safetensors import safe_open  # noqa: PLC0415

    from thundersync_core.checkpoint import MASTER_FILE  # noqa: PLC0415
    from thundersync_core.policy.io import checkpoint_dtype, load_model  # noqa: PLC0415

    model_a, _, model_b, path = uninterrupted_and_saved(tmp_path, export_dtype=torch.bfloat16)
    # The export: bfloat16 weights (half the bytes) that load as a Hugging Face model and
    # say their dtype; the master beside it is the float32 parameters, bitwise.
    with safe_open(str(path / "model" / "model.safetensors"), "pt") as export:
        dtypes = {export.get_tensor(k).dtype for k in export.keys()}  # noqa: SIM118
    assert dtypes == {torch.bfloat16}
    assert checkpoint_dtype(path / "model") == torch.bfloat16
    exported = dict(load_model(path / "model", dtype=torch.bfloat16).named_parameters())
    for name, p in model_b.named_parameters():
        assert torch.equal(exported[name], p.detach().to(torch.bfloat16)), name
    assert (path / "model" / "model.safetensors").stat().st_size < 0.6 * (
        path / MASTER_FILE
    ).stat().st_size
    assert '"export_dtype": "bfloat16"' in (path / "state.json").read_text()

    torch.manual_seed(123)
    random.seed(123)
    model_c, opt_c, learner_c = fresh(2)
    state = load_checkpoint(path, model=model_c, optimizer=opt_c)
    learner_c.policy_version = state["policy_version"]
    train(model_c, opt_c, learner_c, 1)
    for (name, a), (_, c) in zip(
        model_a.named_parameters(), model_c.named_parameters(), strict=True
    ):
        assert torch.equal(a, c), name

    # Without its master a bfloat16 export is refused for a resume, naming the parameter.
    (path / MASTER_FILE).unlink()
    model_d, opt_d, _ = fresh(3)
    with pytest.raises(ValueError, match="float32 master is missing"):
        load_checkpoint(path, model=model_d, optimizer=opt_d)
