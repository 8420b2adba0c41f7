"""The streamed GRPO update equals the batch-synchronous one and a plain reference.

Why a pass cannot be chance: the reference is written independently (full-vocabulary
log-softmax over full-sequence forwards, one backward of the summed loss) and the gradients
compared are dense over ~0.5 M parameters with non-zero advantages; a wrong advantage, a
missed prompt adjoint or a double-counted segment moves the result by O(1) relative, far
outside the tolerances. Tolerances: float64 1e-10 (rounding alone is ~1e-15 here); float32
1e-5 (measured ~1e-6: the split backward sums in a different order).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import random_batch, reference_grad_j, rel_diff
from thundersync_core.streaming import StreamingGRPOLearner, SyncGRPOLearner, groups_of

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def run(learner, batch, order=None):
    learner.begin_batch(groups_of(batch))
    for traj in order if order is not None else batch:
        learner.submit(traj)
    return learner.finish()


@pytest.fixture(scope="module")
def batch():
    return random_batch(seed=11, vocab=1024, n_groups=3, group_size=4)


@pytest.fixture(scope="module")
def references(micro64, micro32, batch):
    return {
        (dtype, agg): reference_grad_j(model, batch, agg)
        for dtype, model in [(torch.float64, micro64), (torch.float32, micro32)]
        for agg in ("seq-sum", "token-mean")
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("loss_agg", ["seq-sum", "token-mean"])
def test_sync_and_stream_match_reference(micro64, micro32, batch, references, dtype, loss_agg):
    model = micro64 if dtype == torch.float64 else micro32
    ref_objective, ref_grads = references[(dtype, loss_agg)]
    sync = run(SyncGRPOLearner(model, loss_agg=loss_agg), batch)
    order = random.Random(1).sample(batch, len(batch))
    stream = run(StreamingGRPOLearner(model, loss_agg=loss_agg, max_open_groups=2), batch, order)
    for result in (sync, stream):
        assert rel_diff(ref_grads, result.grad_objective) <= TOLERANCE[dtype]
        assert result.objective == pytest.approx(ref_objective, rel=TOLERANCE[dtype], abs=1e-12)
        assert result.reverse_kl is None  # an OPD figure only
    assert rel_diff(sync.grad_objective, stream.grad_objective) <= TOLERANCE[dtype]
    # Every group was closed with its prompt replayed exactly once.
    assert stream.counters["groups_closed"] == 3
    assert stream.counters["prefix_replays"] == 3


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    derandomize=True,
)
@given(order_seed=st.integers(0, 2**31), cap=st.integers(1, 4))
def test_any_arrival_order_and_admission_cap_is_exact(micro64, batch, references, order_seed, cap):
    order = random.Random(order_seed).sample(batch, len(batch))
    learner = StreamingGRPOLearner(micro64, max_open_groups=cap)
    result = run(learner, batch, order)
    _, ref_grads = references[(torch.float64, "seq-sum")]
    assert rel_diff(ref_grads, result.grad_objective) <= 1e-10
    assert result.counters["peak_open_groups"] <= cap


def test_gradient_lands_in_param_grad_as_loss_gradient(micro64, batch):
    learner = SyncGRPOLearner(micro64)
    result = run(learner, batch)
    for name, p in micro64.named_parameters():
        torch.testing.assert_close(p.grad, -result.grad_objective[name], rtol=0, atol=0)
    micro64.zero_grad(set_to_none=True)


def test_larger_offset_rewards_stay_exact_in_fp32(micro32):
    """Rewards sharing a large offset: the shifted statistics avoid cancellation."""
    batch = random_batch(seed=5, vocab=1024, n_groups=2, group_size=5)
    shifted = [t.__class__(**{**t.__dict__, "reward": 1000.0 + t.reward}) for t in batch]
    _, ref = reference_grad_j(micro32, shifted)
    order = random.Random(3).sample(shifted, len(shifted))
    stream = run(StreamingGRPOLearner(micro32), shifted, order)
    assert rel_diff(ref, stream.grad_objective) <= 1e-5


@pytest.mark.parametrize("cap", [1, 3])
def test_fixed_order_is_bitwise_the_sorted_batch_whatever_the_arrival(micro32, batch, cap):
    # float32, where sums in another order differ in the last bits (arrival order shows it).
    ordered = sorted(batch, key=lambda t: t.trajectory_id)
    sorted_grads = run(StreamingGRPOLearner(micro32, max_open_groups=3), ordered).grad_objective
    shuffled = [random.Random(seed).sample(batch, len(batch)) for seed in range(4)]
    arrival = [run(StreamingGRPOLearner(micro32, max_open_groups=cap), batch, o) for o in shuffled]
    assert any(
        not torch.equal(r.grad_objective[k], sorted_grads[k]) for r in arrival for k in sorted_grads
    ), "arrival order should move float32 sums (else this test shows nothing)"
    for order in shuffled:
        learner = StreamingGRPOLearner(micro32, max_open_groups=cap, order="fixed")
        result = run(learner, batch, order)
        for name, grad in sorted_grads.items():
            assert torch.equal(result.grad_objective[name], grad), name
        assert learner.live_statistics_bytes() == 0  # everything was added at the barrier
    _, ref_grads = reference_grad_j(micro32, batch)
    assert rel_diff(ref_grads, result.grad_objective) <= 1e-5


def test_fixed_order_holds_gradients_until_close_and_barrier(micro64, batch):
    learner = StreamingGRPOLearner(micro64, max_open_groups=3, order="fixed")
    learner.begin_batch(groups_of(batch))
    by_group: dict[str, list] = {}
    for traj in batch:
        by_group.setdefault(traj.group_id, []).append(traj)
    first, *_ = by_group.values()
    for traj in first:
        learner.submit(traj)
    # The group closed: its contribution waits for the barrier, nothing is in the sum yet.
    assert all(float(acc.abs().max()) == 0.0 for acc in learner.gradient_so_far())
    assert learner.live_statistics_bytes() > 0
    for traj in batch[len(first) :]:
        learner.submit(traj)
    result = learner.finish()
    _, ref_grads = reference_grad_j(micro64, batch)
    assert rel_diff(ref_grads, result.grad_objective) <= 1e-10


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("loss_agg", ["seq-sum", "token-mean"])
@pytest.mark.parametrize("pack_tokens", [0, 48, 4096])
def test_release_per_closed_group_is_exact_and_holds_no_statistics(
    micro64, micro32, batch, references, dtype, loss_agg, pack_tokens
):
    """release="group": each trajectory waits for its group's last reward and then runs
    with its final advantage straight into the batch gradient. Same update as the plain
    reference, in any arrival order and chunking, and no group ever holds statistics."""
    model = micro64 if dtype == torch.float64 else micro32
    _, ref_grads = references[(dtype, loss_agg)]
    for seed in range(3):
        rng = random.Random(seed)
        order = rng.sample(batch, len(batch))
        learner = StreamingGRPOLearner(model, loss_agg=loss_agg, release="group")
        learner.begin_batch(groups_of(batch))
        while order:
            size = rng.randint(1, 4) if pack_tokens else 1
            chunk, order = order[:size], order[size:]
            learner.submit_many(chunk, pack_tokens=pack_tokens)
            assert learner.live_statistics_bytes() == 0
        result = learner.finish()
        assert rel_diff(ref_grads, result.grad_objective) <= TOLERANCE[dtype]
        assert result.counters["groups_closed"] == 3
        assert result.counters["prefix_replays"] == 3


def test_release_per_closed_group_waits_for_the_last_reward(micro64, batch):
    """A group's backwards start at its last reward (no overlap inside a group), where
    release="trajectory" runs each at once and holds the group's two statistics."""
    first = [t for t in batch if t.group_id == batch[0].group_id]
    held = {}
    for release in ("group", "trajectory"):
        learner = StreamingGRPOLearner(micro64, release=release)
        learner.begin_batch(groups_of(batch))
        for traj in first[:-1]:
            learner.submit(traj)
        held[release] = (
            learner.counters_so_far()["trajectory_backwards"]
            + learner.counters_so_far()["pack_backwards"],
            learner.live_statistics_bytes(),
        )
        learner.submit(first[-1])
        assert learner.counters_so_far()["groups_closed"] == 1
        assert learner.live_statistics_bytes() == 0
    params = sum(p.numel() * p.element_size() for p in micro64.parameters())
    assert held["group"] == (0, 0)
    backwards, statistics = held["trajectory"]
    assert backwards == len(first) - 1
    assert statistics >= 2 * params  # x1 and x2 over the parameters (and prompt proxies)
