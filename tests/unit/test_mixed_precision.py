"""Mixed precision at one rank: a bfloat16 compute replica beside a float32 master.

The learner runs the replica; the barrier's float32 accumulator (not the replica's
bfloat16-rounded ``.grad``) becomes the master's gradient, AdamW steps the master, and the
replica is refreshed from it. Checked against an independent float64 reference (the plain
batch loss, one backward) with a bound on the relative error that bfloat16's 8 mantissa
bits allow, and bitwise where no rounding is involved.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import random_batch, reference_grad_j, rel_diff
from thundersync_core.config import LearnerResources, ResourcesConfig, TrainConfig
from thundersync_core.parallel.fsdp import MixedPrecisionState, build_train_state
from thundersync_core.policy import build_model
from thundersync_core.runtime.learner_worker import LearnerWorker
from thundersync_core.streaming import StreamingGRPOLearner, groups_of

#: max |g_bf16 - g_ref| / max |g_ref|: bfloat16 rounds each op to ~4e-3 relative; on the
#: micro model this batch measured 0.7e-2 to 1.2e-2 over three seeds (float32: 5e-7).
BF16_GRAD_TOLERANCE = 5e-2


def _batch():
    return random_batch(seed=29, vocab=1024, n_groups=3, group_size=3)


def test_master_takes_the_float32_accumulator_and_tracks_the_float64_reference():
    master = build_model("micro", seed=5, dtype=torch.float32)
    reference = copy.deepcopy(master).double()
    _, grad_ref = reference_grad_j(reference, _batch())

    state = build_train_state(master, sharding="replicated", lr=1e-3, compute_dtype=torch.bfloat16)
    assert isinstance(state, MixedPrecisionState)
    assert state.model is not master
    assert {p.dtype for p in state.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in master.parameters()} == {torch.float32}
    learner = StreamingGRPOLearner(state.model, max_open_groups=3)
    learner.begin_batch(groups_of(_batch()))
    for traj in _batch():
        learner.submit(traj)
    result = learner.finish()
    assert {g.dtype for g in result.grad_objective.values()} == {torch.float32}

    norm = state.clip(1e9, result.grad_objective, -1.0)
    for name, p in master.named_parameters():
        # The master's gradient is the float32 accumulator itself, not the bf16 .grad.
        assert torch.equal(p.grad, -result.grad_objective[name]), name
    assert all(p.grad is None for p in state.model.parameters())
    error = rel_diff(grad_ref, {n: -p.grad for n, p in master.named_parameters()})
    assert error <= BF16_GRAD_TOLERANCE, f"bf16 gradient error {error:.3e}"
    assert error > 0, "a bf16 replica that matched float64 exactly computed nothing in bf16"
    expected_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grad_ref.values()]))
    assert norm == pytest.approx(float(expected_norm), rel=BF16_GRAD_TOLERANCE)

    before = {n: p.detach().clone() for n, p in master.named_parameters()}
    state.apply()
    for (name, p), replica in zip(master.named_parameters(), state.model.parameters(), strict=True):
        assert not torch.equal(p, before[name]), f"{name}: the master did not step"
        assert torch.equal(replica, p.detach().to(torch.bfloat16)), name


def test_master_must_be_float32():
    with pytest.raises(ValueError, match=r"master weights must be loaded in float32.*bfloat16"):
        MixedPrecisionState(
            build_model("micro", seed=1, dtype=torch.bfloat16),
            lr=1e-3,
            compute_dtype=torch.bfloat16,
        )


def _config(dtype: str, num_gpus: float = 0.0) -> TrainConfig:
    return TrainConfig(
        objective="grpo",
        schedule="thundersync",
        lr=1e-2,
        max_open_groups=3,
        learner_dtype=dtype,  # type: ignore[arg-type]
        resources=ResourcesConfig(
            learner=LearnerResources(num_cpus=1.0, cores=(), num_gpus=num_gpus),
            learner_peak_flops=1e9,
        ),
    )


def _step(worker: LearnerWorker) -> dict:
    worker.begin({g: (s.prompt_ids, s.size) for g, s in groups_of(_batch()).items()})
    for traj in _batch():
        worker.submit(traj, None)
    return worker.step(0)


def test_one_rank_bfloat16_learner_steps_publishes_and_resumes_in_float32(
    micro_model_dir, tmp_path
):
    plain = LearnerWorker(micro_model_dir, _config("float32"), publish_dir=tmp_path / "fp32")
    mixed = LearnerWorker(micro_model_dir, _config("bfloat16"), publish_dir=tmp_path / "bf16")
    assert {p.dtype for p in mixed.model.parameters()} == {torch.bfloat16}
    want, got = _step(plain), _step(mixed)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=BF16_GRAD_TOLERANCE)
    assert got["grad_norm"] != want["grad_norm"]
    published = load_file(got["weights"])
    master = dict(mixed.state.checkpoint_module().named_parameters())
    assert {t.dtype for t in published.values()} == {torch.float32}
    for name, tensor in published.items():
        assert torch.equal(tensor, master[name].detach()), name

    path = mixed.save_checkpoint(str(tmp_path / "ckpt"), 1, {})
    resumed = LearnerWorker(
        micro_model_dir, _config("bfloat16"), publish_dir=tmp_path / "resumed", resume_from=path
    )
    assert resumed.version() == 1
    again = dict(resumed.state.checkpoint_module().named_parameters())
    for name, p in master.items():
        assert torch.equal(again[name], p), name
    for (name, p), replica in zip(again.items(), resumed.model.parameters(), strict=True):
        assert torch.equal(replica, p.detach().to(torch.bfloat16)), name


def test_learner_refuses_gpus_it_cannot_see(micro_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = _config("float32", num_gpus=1.0)
    with pytest.raises(
        RuntimeError, match=r"learner: resources.learner.num_gpus is 1.0 but no CUDA"
    ):
        LearnerWorker(micro_model_dir, config, publish_dir=tmp_path / "pub")
