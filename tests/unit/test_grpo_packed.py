"""The packed streaming GRPO path equals the plain reference and the per-trajectory path.

Packs are what queued while the learner was busy: ``submit_many`` gets arrival-ordered
chunks of random sizes (1 to the whole batch) and runs each group's members as right-padded
packs bounded by ``pack_tokens``. Several arrival orders, chunkings and bounds (a bound
below one row forces single rows; a large one whole groups) are checked against the
independent reference (full-sequence forwards, one backward of the summed loss): float64
1e-10, float32 1e-5. Members that close their group run as one pack with one backward; the
members of a group that stays open run one at a time: the counters show which ran.
With ``order="fixed"`` a group runs once whole, in trajectory-id order: bitwise the update
of the whole batch at once (sync's), whatever the arrival and chunking.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import random_batch, reference_grad_j, rel_diff
from tests.unit.test_offpolicy import CLIP, _reference_grpo, _with_behaviour
from thundersync_core.batch import Segment, Trajectory
from thundersync_core.streaming import StreamingGRPOLearner, groups_of
from thundersync_core.streaming.grpo_stream import PACK_OVERHEAD_TOKENS, _packs

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def run_packed(learner, batch, *, seed: int, pack_tokens: int):
    """Submit ``batch`` in a seeded arrival order, in chunks of seeded random sizes."""
    rng = random.Random(seed)
    order = rng.sample(batch, len(batch))
    learner.begin_batch(groups_of(batch))
    while order:
        size = rng.randint(1, len(order))
        chunk, order = order[:size], order[size:]
        learner.submit_many(chunk, pack_tokens=pack_tokens)
    return learner.finish()


@pytest.fixture(scope="module")
def batch():
    return random_batch(seed=23, vocab=1024, n_groups=3, group_size=5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("loss_agg", ["seq-sum", "token-mean"])
@pytest.mark.parametrize("pack_tokens", [16, 64, 10_000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packs_match_the_reference(micro64, micro32, batch, dtype, loss_agg, pack_tokens, seed):
    model = micro64 if dtype == torch.float64 else micro32
    ref_objective, ref_grads = reference_grad_j(model, batch, loss_agg)
    learner = StreamingGRPOLearner(model, loss_agg=loss_agg, max_open_groups=3)
    result = run_packed(learner, batch, seed=seed, pack_tokens=pack_tokens)
    assert rel_diff(ref_grads, result.grad_objective) <= TOLERANCE[dtype]
    assert result.objective == pytest.approx(ref_objective, rel=TOLERANCE[dtype], abs=1e-12)
    assert result.counters["groups_closed"] == 3
    assert result.counters["prefix_replays"] == 3


def test_whole_groups_take_one_backward_a_pack(micro64, batch):
    # Everything at once (as sync hands it over): each group closes at once, as its packs.
    learner = StreamingGRPOLearner(micro64, max_open_groups=3)
    learner.begin_batch(groups_of(batch))
    learner.submit_many(batch, pack_tokens=10_000)
    result = learner.finish()
    plans = [_packs([t for t in batch if t.group_id == g], 10_000) for g in groups_of(batch)]
    assert [len(plan) for plan in plans] == [1, 1, 2]  # g2's two short rows cut from the rest
    assert result.counters["packed_trajectories"] == len(batch)
    assert result.counters["pack_backwards"] == 4
    assert result.counters["trajectory_backwards"] == 0
    _, ref_grads = reference_grad_j(micro64, batch)
    assert rel_diff(ref_grads, result.grad_objective) <= 1e-10


def test_members_of_a_group_that_stays_open_run_one_at_a_time(micro64, batch):
    # A pack that left its group open would take two backwards: as many as one at a time.
    members = [t for t in batch if t.group_id == batch[0].group_id]
    learner = StreamingGRPOLearner(micro64, max_open_groups=3)
    learner.begin_batch(groups_of(batch))
    learner.submit_many(members[:3], pack_tokens=10_000)
    assert learner.counters_so_far()["pack_backwards"] == 0
    assert learner.counters_so_far()["trajectory_backwards"] == 3
    learner.submit_many(members[3:] + [t for t in batch if t not in members], pack_tokens=10_000)
    counters = learner.counters_so_far()
    assert counters["packed_trajectories"] == len(batch) - 3  # closing packs
    _, ref_grads = reference_grad_j(micro64, batch)
    assert rel_diff(ref_grads, learner.finish().grad_objective) <= 1e-10


def test_the_admission_cap_holds_packs_of_further_groups(micro64, batch):
    learner = StreamingGRPOLearner(micro64, max_open_groups=1)
    result = run_packed(learner, batch, seed=5, pack_tokens=10_000)
    assert result.counters["peak_open_groups"] == 1
    assert result.counters["sources_held"] > 0
    _, ref_grads = reference_grad_j(micro64, batch)
    assert rel_diff(ref_grads, result.grad_objective) <= 1e-10


def test_packed_importance_weights_match_the_plain_reference(micro64):
    batch = _with_behaviour(micro64, random_batch(5, micro64.config.vocab_size), seed=1)
    batch = [t.__class__(**{**t.__dict__, "policy_version": 3 if i % 2 else 4})
             for i, t in enumerate(batch)]  # fmt: skip
    expected = _reference_grpo(micro64, batch)
    learner = StreamingGRPOLearner(micro64, policy_version=4, max_lag=1, is_clip=CLIP)
    result = run_packed(learner, batch, seed=3, pack_tokens=10_000)
    assert result.counters["pack_backwards"] > 0
    assert rel_diff(expected, result.grad_objective) < 1e-10
    assert 0 < learner.is_stats["clipped"] < learner.is_stats["tokens"]
    micro64.zero_grad(set_to_none=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("pack_tokens", [16, 10_000])
@pytest.mark.parametrize("seed", [0, 4])
def test_off_policy_packs_in_id_order_match_the_plain_reference(
    micro64, micro32, dtype, pack_tokens, seed
):
    # What async and the pipeline run: sources up to one version stale, truncated
    # importance weights, groups whole and in trajectory-id order, as packs.
    model = micro64 if dtype == torch.float64 else micro32
    batch = _with_behaviour(model, random_batch(7, model.config.vocab_size), seed=seed)
    batch = [t.__class__(**{**t.__dict__, "policy_version": 2 + i % 2})
             for i, t in enumerate(batch)]  # fmt: skip
    expected = _reference_grpo(model, batch)
    learner = StreamingGRPOLearner(
        model, policy_version=3, max_lag=1, is_clip=CLIP, max_open_groups=1, order="fixed"
    )
    result = run_packed(learner, batch, seed=seed, pack_tokens=pack_tokens)
    assert result.counters["trajectory_backwards"] == 0
    assert result.counters["packed_trajectories"] == len(batch)
    assert rel_diff(expected, result.grad_objective) <= TOLERANCE[dtype]
    assert 0 < learner.is_stats["clipped"] < learner.is_stats["tokens"]
    model.zero_grad(set_to_none=True)


def test_a_non_finite_pack_score_is_refused_naming_the_trajectory(micro64, batch):
    members = [t for t in batch if t.group_id == batch[0].group_id]
    learner = StreamingGRPOLearner(micro64, max_open_groups=3)
    learner.begin_batch(groups_of(batch))
    broken = members[1].__class__(**{**members[1].__dict__, "reward": float("nan")})
    with pytest.raises(Exception, match=members[1].trajectory_id):
        learner.submit_many([members[0], broken], pack_tokens=10_000)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("pack_tokens", [16, 10_000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fixed_order_packs_match_the_reference(micro64, micro32, batch, dtype, pack_tokens, seed):
    model = micro64 if dtype == torch.float64 else micro32
    ref_objective, ref_grads = reference_grad_j(model, batch, "token-mean")
    learner = StreamingGRPOLearner(model, loss_agg="token-mean", max_open_groups=1, order="fixed")
    result = run_packed(learner, batch, seed=seed, pack_tokens=pack_tokens)
    assert rel_diff(ref_grads, result.grad_objective) <= TOLERANCE[dtype]
    assert result.objective == pytest.approx(ref_objective, rel=TOLERANCE[dtype], abs=1e-12)
    assert result.counters["trajectory_backwards"] == 0
    assert result.counters["packed_trajectories"] == len(batch)


@pytest.mark.parametrize("pack_tokens", [16, 64, 10_000])
def test_fixed_order_packs_are_bitwise_the_whole_batch_at_once(micro32, batch, pack_tokens):
    # float32, where the arrival-order packs differ in the last bits (checked first).
    def at_once():
        learner = StreamingGRPOLearner(micro32, max_open_groups=3, order="fixed")
        learner.begin_batch(groups_of(batch))
        learner.submit_many(list(reversed(batch)), pack_tokens=pack_tokens)
        return learner.finish().grad_objective

    whole = at_once()
    arrival = [
        run_packed(StreamingGRPOLearner(micro32, max_open_groups=3), batch, seed=seed,
                   pack_tokens=pack_tokens).grad_objective
        for seed in range(4)
    ]  # fmt: skip
    assert any(not torch.equal(g[k], whole[k]) for g in arrival for k in whole), (
        "arrival order should move float32 sums (else this test shows nothing)"
    )
    for seed in range(4):
        learner = StreamingGRPOLearner(micro32, max_open_groups=3, order="fixed")
        grads = run_packed(learner, batch, seed=seed, pack_tokens=pack_tokens).grad_objective
        for name, grad in whole.items():
            assert torch.equal(grads[name], grad), (seed, name)
        assert learner.live_statistics_bytes() == 0


def test_fixed_order_packs_wait_for_the_whole_group(micro64, batch):
    members = [t for t in batch if t.group_id == batch[0].group_id]
    learner = StreamingGRPOLearner(micro64, max_open_groups=3, order="fixed")
    learner.begin_batch(groups_of(batch))
    learner.submit_many(members[:-1], pack_tokens=10_000)
    assert learner.counters_so_far()["packed_trajectories"] == 0  # nothing ran yet
    with pytest.raises(Exception, match=r"g0 \(4/5\)"):
        learner.finish()
    learner.submit_many(members[-1:], pack_tokens=10_000)
    assert learner.counters_so_far()["pack_backwards"] == 1
    learner.submit_many([t for t in batch if t not in members], pack_tokens=10_000)
    _, ref_grads = reference_grad_j(micro64, batch)
    assert rel_diff(ref_grads, learner.finish().grad_objective) <= 1e-10


def _rows(lengths: list[int], *, group: str = "g", seed: int = 0, vocab: int = 64):
    """One trajectory per length: a row of ``length`` tokens (the prompt's last, then the
    response), rewards drawn from ``seed``."""
    rng = random.Random(seed)
    return [
        Trajectory(
            group,
            f"{group}-t{i}",
            (1, 2, 3),
            (Segment.action([rng.randrange(vocab) for _ in range(n - 1)], [True] * (n - 1)),),
            float(rng.random() < 0.5) + i / 100,
        )
        for i, n in enumerate(lengths)
    ]


def _width(pack) -> int:
    return max(1 + len(t.response_ids) for t in pack)


def _cost(packs) -> int:
    return sum(PACK_OVERHEAD_TOKENS + len(p) * _width(p) for p in packs)


def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]


def test_a_straggler_runs_alone_instead_of_widening_its_group():
    # Seven rows of 56 tokens and one of 212 (the episode that ran its three turns).
    trajs = _rows([56, 56, 212, 56, 56, 56, 56, 56])
    packs = _packs(trajs, 4096)
    assert [[t.trajectory_id for t in p] for p in packs] == [
        [f"g-t{i}" for i in (0, 1, 3, 4, 5, 6, 7)],
        ["g-t2"],
    ]
    assert _cost(packs) == 2 * PACK_OVERHEAD_TOKENS + 7 * 56 + 212  # against 8 x 212 as one


def test_rows_of_near_one_length_stay_one_pack_and_the_bound_holds():
    assert len(_packs(_rows([61, 61, 62, 61, 60, 61, 61, 61]), 4096)) == 1
    packs = _packs(_rows([100] * 8), 350)  # three rows of 100 fit, four do not
    assert [len(p) for p in packs] == [3, 3, 2]
    assert [len(p) for p in _packs(_rows([500, 20]), 100)] == [1, 1]  # longer than the bound


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_is_the_cheapest_of_every_partition(seed):
    # An exhaustive check of the sorted-runs dynamic programme: no split of the rows into
    # packs within the bound (877 of them for seven rows) costs less.
    rng = random.Random(seed)
    trajs = _rows([rng.choice([rng.randint(20, 70), rng.randint(100, 300)]) for _ in range(7)])
    bound = rng.choice([400, 1000, 4096])
    packs = _packs(trajs, bound)
    assert sorted(t.trajectory_id for p in packs for t in p) == [t.trajectory_id for t in trajs]
    fits = [
        part for part in _partitions(trajs)
        if all(len(p) == 1 or len(p) * _width(p) <= bound for p in part)
    ]  # fmt: skip
    assert _cost(packs) == min(map(_cost, fits))
    index = {t.trajectory_id: i for i, t in enumerate(trajs)}
    firsts = [[index[t.trajectory_id] for t in p] for p in packs]
    assert all(f == sorted(f) for f in firsts)  # input order kept in a pack,
    assert firsts == sorted(firsts)  # and from pack to pack


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("order", ["arrival", "fixed"])
def test_split_groups_match_the_reference(micro64, micro32, dtype, order):
    model = micro64 if dtype == torch.float64 else micro32
    vocab = model.config.vocab_size
    batch = _rows([9, 9, 130, 9, 9], group="a", seed=1, vocab=vocab)
    batch += _rows([12, 150, 12, 160, 12, 12], group="b", seed=2, vocab=vocab)
    ref_objective, ref_grads = reference_grad_j(model, batch, "token-mean")
    learner = StreamingGRPOLearner(model, loss_agg="token-mean", max_open_groups=2, order=order)
    learner.begin_batch(groups_of(batch))
    learner.submit_many(batch, pack_tokens=4096)
    result = learner.finish()
    assert result.counters["pack_backwards"] == 4  # each group: its short rows, its long
    assert rel_diff(ref_grads, result.grad_objective) <= TOLERANCE[dtype]
    assert result.objective == pytest.approx(ref_objective, rel=TOLERANCE[dtype], abs=1e-12)
