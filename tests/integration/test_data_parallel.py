"""Two gloo ranks give the single-process update: GRPO, OPD, sharded, checkpoint resume.

Two ranks are spawned once per module (torch.multiprocessing, gloo on 127.0.0.1, a 60 s
collective timeout so a deadlock fails instead of hanging) and run every case; this
process compares their results with an independent plainly written reference (full
forwards, one backward of the whole loss; ``tests/helpers.py``) and with the one-process
sync learner.

Why a pass cannot be chance: the gradients are dense over ~0.5 M parameters; a rank that
normalised by its own group count (1/G_rank instead of 1/G) is off by a factor 2-4 on its
groups, a group split over ranks or a missed reduction by O(1). Tolerance 1e-5 relative to
the max entry, in float32: per-source backwards and the cross-rank sum add in another order
than one backward (measured ~1e-6, as in the one-process exactness tests).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests import dp_workers
from tests.helpers import reference_grad_j, reference_grad_l, rel_diff
from thundersync_core.parallel.dcp import load_group_checkpoint
from thundersync_core.policy import build_model
from thundersync_core.policy.io import checkpoint_dtype
from thundersync_core.streaming import SyncGRPOLearner, SyncOPDLearner, groups_of

pytestmark = pytest.mark.integration

TOLERANCE = 1e-5
WORLD = 2
SPLIT_3_1 = ",".join(f"{g}={r}" for g, r in dp_workers.SPLIT_3_1.items())
ALL_ON_0 = "g0=0,g1=0,g2=0,g3=0"
GRAD_CASES = [
    *(f"grad:grpo:seq-sum:{order}:" for order in (0, 1, 2)),
    f"grad:grpo:seq-sum:3:{SPLIT_3_1}",
    f"grad:grpo:seq-sum:4:{ALL_ON_0}",
    *(f"grad:grpo:token-mean:{order}:" for order in (0, 1)),
    f"grad:grpo:token-mean:5:{SPLIT_3_1}",
    *(f"grad:opd:-:{order}:" for order in (0, 1, 2)),
    "grad:opd:-:3:g0=0,g1=0,g2=1",
]
UPDATE_CASES = ["update:replicated:fp32", "update:fsdp2:fp32", "update:fsdp2:bf16"]
# "refusal" runs before "checkpoint": the group must still work after a refused barrier.
CASES = [*GRAD_CASES, *UPDATE_CASES, "refusal", "checkpoint", "load:fp32", "load:bf16"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """{case: [rank 0 result, rank 1 result]} from one spawn of two gloo ranks."""
    out = tmp_path_factory.mktemp("dp")
    return dp_workers.run_ranks(WORLD, out, CASES), out


@pytest.fixture(scope="module")
def references():
    model = build_model("micro", seed=3, dtype=torch.float32)
    grpo, opd = dp_workers.grpo_batch(), dp_workers.opd_batch()
    refs = {}
    for agg in ("seq-sum", "token-mean"):
        sync = SyncGRPOLearner(model, loss_agg=agg)  # type: ignore[arg-type]
        sync.begin_batch(groups_of(grpo))
        for traj in grpo:
            sync.submit(traj)
        refs[("grpo", agg)] = (reference_grad_j(model, grpo, agg), sync.finish())
        model.zero_grad(set_to_none=True)
    sync_opd = SyncOPDLearner(model)
    sync_opd.begin_batch(groups_of(opd))
    for traj in opd:
        sync_opd.submit(traj)
    refs[("opd", "-")] = (reference_grad_l(model, opd), sync_opd.finish())
    model.zero_grad(set_to_none=True)
    return refs


@pytest.mark.parametrize("case", GRAD_CASES)
def test_two_ranks_equal_single_process(ranks, references, case):
    results, _ = ranks
    _, objective, agg, _, forced = case.split(":")
    (ref_objective, ref_grads), sync = references[(objective, agg)]
    rank0, rank1 = results[case]
    # Every group is on exactly one rank.
    assert sorted(rank0["groups"] + rank1["groups"]) == sorted(groups_of_batch(objective))
    if forced == SPLIT_3_1:
        assert (len(rank0["groups"]), len(rank1["groups"])) == (3, 1)
    if forced == ALL_ON_0:
        assert rank1["groups"] == []
    for result in (rank0, rank1):
        assert result["n_groups"] == len(sync.grad_objective and groups_of_batch(objective))
        assert rel_diff(ref_grads, result["grads"]) <= TOLERANCE
        assert rel_diff(sync.grad_objective, result["grads"]) <= TOLERANCE
        assert result["objective"] == pytest.approx(ref_objective, rel=TOLERANCE)
        assert result["n_scored_tokens"] == sync.n_scored_tokens
    # The all-reduce hands both ranks the same gradient, bit for bit.
    for name, grad in rank0["grads"].items():
        assert torch.equal(grad, rank1["grads"][name]), name


def groups_of_batch(objective: str) -> list[str]:
    batch = dp_workers.grpo_batch() if objective == "grpo" else dp_workers.opd_batch()
    return sorted(groups_of(batch))


def test_assigner_balances_groups_over_ranks(ranks):
    """Unforced routing spreads four GRPO groups over both ranks."""
    results, _ = ranks
    for order in (0, 1, 2):
        rank0, rank1 = results[f"grad:grpo:seq-sum:{order}:"]
        assert rank0["groups"]
        assert rank1["groups"]


def test_sharded_and_replicated_give_the_same_update(ranks):
    results, _ = ranks
    replicated = results["update:replicated:fp32"]
    sharded = results["update:fsdp2:fp32"]
    # The global norm is a float32 sum of squares over ~0.5 M entries, taken per shard then
    # summed over ranks in fsdp2: rounding of that sum, not of the gradient.
    assert replicated[0]["grad_norm"] == pytest.approx(sharded[0]["grad_norm"], rel=TOLERANCE)
    # AdamW's first step is lr * g / (|g| + eps): the same reduced gradient, clipped by norms
    # that differ in rounding only, moves every parameter the same way.
    assert rel_diff(replicated[0]["delta"], sharded[0]["delta"]) <= TOLERANCE
    for rank in range(WORLD):  # every rank holds the same refreshed replica
        assert rel_diff(sharded[0]["delta"], sharded[rank]["delta"]) == 0.0
        assert rel_diff(replicated[0]["delta"], replicated[rank]["delta"]) == 0.0


def test_bf16_compute_with_fp32_master_tracks_fp32(ranks):
    """Mixed precision: bf16 replica, fp32 accumulators, master and optimizer. Its update
    follows the fp32 one within bf16 rounding (8 mantissa bits: ~4e-3 per op)."""
    results, _ = ranks
    fp32 = results["update:fsdp2:fp32"][0]["delta"]
    bf16 = results["update:fsdp2:bf16"][0]["delta"]
    agreeing = sum(int((torch.sign(fp32[n]) == torch.sign(bf16[n])).sum()) for n in fp32)
    total = sum(t.numel() for t in fp32.values())
    assert agreeing / total > 0.9


def test_checkpoint_resumes_on_two_ranks_to_the_same_update(ranks):
    results, _ = ranks
    for rank_result in results["checkpoint"]:
        for name, value in rank_result["at_checkpoint"].items():
            assert torch.equal(rank_result["loaded"][name], value), name
        # Same ranks, same routing, same state: bit for bit the uninterrupted step.
        assert rel_diff(rank_result["next_grads"], rank_result["resumed_grads"]) == 0.0
        assert rel_diff(rank_result["uninterrupted"], rank_result["resumed"]) == 0.0
        assert rank_result["record"]["world_size"] == WORLD


def test_checkpoint_resumes_on_one_process(ranks):
    """The 2-rank checkpoint loads into a plain model and AdamW (no process group): the
    same parameters and optimizer state bit for bit, and the next gradient equal to the
    uninterrupted 2-rank one within the float32 tolerance."""
    results, out = ranks
    expected = results["checkpoint"][0]
    model = build_model("micro", seed=99, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=dp_workers.LR)
    record = load_group_checkpoint(
        out / "checkpoints" / "step-000001", module=model, optimizer=optimizer
    )
    assert record["policy_version"] == 1
    assert record["export_dtype"] == "bfloat16"
    # The Hugging Face export (written by rank 0, one gathered tensor at a time) is the
    # master in bfloat16 and says so; the master itself came from the DCP state.
    folder = out / "checkpoints" / "step-000001" / "model"
    assert checkpoint_dtype(folder) == torch.bfloat16
    exported = load_file(str(folder / "model.safetensors"))
    loaded = dp_workers.full_params(model)
    for name, param in model.named_parameters():
        assert torch.equal(loaded[name], expected["at_checkpoint"][name]), name
        assert torch.equal(exported[name], loaded[name].to(torch.bfloat16)), name
        for key, value in expected["optimizer_at_checkpoint"][name].items():
            assert torch.equal(optimizer.state[param][key], value), (name, key)
    second = dp_workers.grpo_batch(22)
    learner = dp_workers.make_learner("grpo", model)
    learner.begin_batch(groups_of(second))
    for traj in dp_workers.arrivals("grpo", second, 2):
        learner.submit(traj)
    result = learner.finish()
    assert rel_diff(expected["next_grads"], result.grad_objective) <= TOLERANCE
    torch.nn.utils.clip_grad_norm_(model.parameters(), dp_workers.MAX_GRAD_NORM)
    optimizer.step()
    after = dp_workers.full_params(model)
    start = expected["at_checkpoint"]
    update_1 = {n: after[n] - start[n] for n in start}
    update_2 = {n: expected["uninterrupted"][n] - start[n] for n in start}
    # AdamW normalises per coordinate (m / sqrt(v)): a gradient rounding difference of 1e-6
    # of the largest entry becomes 1e-6 of each *small* entry's own size, so the parameter
    # update agrees to ~3e-4 of its max (measured) while the gradient agrees to 1e-6.
    assert rel_diff(update_2, update_1) <= 1e-3


def test_one_rank_refusing_the_barrier_stops_both_at_once(ranks):
    """No rank waits in the reduction for the collective timeout (60 s here, 30 min in runs)."""
    results, _ = ranks
    held_back, refused = results["refusal"]
    assert "g3 (2/3)" in refused["error"]
    assert held_back["error"] is not None
    assert "rank(s) [1] refused" in held_back["error"]
    assert max(held_back["elapsed_s"], refused["elapsed_s"]) < 30


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rank_0_reads_the_weights_and_every_rank_takes_its_shard(ranks, dtype):
    """``load_sharded_state`` (rank 0 reads the folder, broadcasts one tensor at a time)
    builds bitwise the state of every rank loading the whole model: the replica in the
    compute dtype, the float32 master (a float32 folder keeps its bits), and the update of
    the next step."""
    results, out = ranks
    saved = load_file(str(out / "load-model" / "model.safetensors"))
    for rank_result in results[f"load:{dtype}"]:
        want = {torch.bfloat16 if dtype == "bf16" else torch.float32}
        assert rank_result["rank0:replica_dtype"] == rank_result["every:replica_dtype"] == want
        for part in ("replica", "master", "after"):
            every, rank0 = rank_result[f"every:{part}"], rank_result[f"rank0:{part}"]
            assert every.keys() == rank0.keys()
            for name in every:
                assert torch.equal(every[name], rank0[name]), (part, name)
        for name, value in rank_result["rank0:master"].items():
            assert torch.equal(value, saved[name]), name
        moved = max(
            float((rank_result["rank0:after"][n] - rank_result["rank0:master"][n]).abs().max())
            for n in saved
        )
        assert moved > 0, "the step must move the master"
