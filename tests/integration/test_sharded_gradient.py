"""The batch gradient sharded over learner ranks (``ShardedGradient``), at 2 and 4 gloo ranks.

Each rank holds its ``Shard(0)`` rows of the batch gradient; contributions are flushed
(reduce-scattered) by every rank after each group's last trajectory. Checked against the
whole accumulators' path and against the plain reference gradient (one backward of the
whole batch loss, one process), in float32: gradient rows within 1e-5, the same loss and
gradient norm, the same AdamW update wherever the reference gradient is clear of zero, and
1/W of the accumulator's bytes on each rank.
"""

from __future__ import annotations

import pytest
import torch

from tests import dp_workers
from tests.helpers import reference_grad_j, rel_diff
from thundersync_core.parallel.data_parallel import shard_rows
from thundersync_core.policy import build_model

pytestmark = pytest.mark.integration

TOLERANCE = 1e-5
CASES = ["sharded:group", "sharded:trajectory"]


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def ranks(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"sharded-{world}")
    results = dp_workers.run_ranks(world, out, CASES)
    return world, results


@pytest.mark.parametrize("case", CASES)
def test_sharded_batch_gradient_is_the_batch_gradient(ranks, case):
    world, results = ranks
    per_rank = results[case]
    whole = per_rank[0]["whole:grads"]
    # Each rank holds its rows of every gradient; stacked in rank order they are the
    # whole accumulators' gradient and the plain reference's.
    stacked = {
        name: torch.cat([r["sharded:grads"][name] for r in per_rank], dim=0) for name in whole
    }
    for rank, r in enumerate(per_rank):
        assert r["sharded:sharded"]
        assert not r["whole:sharded"]
        for name, full in whole.items():
            start, stop = shard_rows(full.shape[0], world, rank)
            assert r["sharded:grads"][name].shape == full[start:stop].shape, name
    assert rel_diff(whole, stacked) <= TOLERANCE
    _, reference = reference_grad_j(
        build_model("micro", seed=3, dtype=torch.float32), dp_workers.grpo_batch(31), "seq-sum"
    )
    assert rel_diff(reference, stacked) <= TOLERANCE
    for r in per_rank:
        assert r["sharded:objective"] == pytest.approx(r["whole:objective"], rel=TOLERANCE)
        assert r["sharded:norm"] == pytest.approx(r["whole:norm"], rel=TOLERANCE)
        # 1/W of the accumulator (whole rows: a dimension not divisible by W rounds up).
        assert r["sharded:bytes"] <= r["whole:bytes"] / world * 1.05
    # The update: AdamW's lr * g / (|g| + eps) agrees wherever the gradient is clear of zero
    # (an entry within rounding of zero may move either way when sums change order).
    largest = max(float(g.abs().max()) for g in reference.values())
    compared = total = 0
    for name, grad in reference.items():
        clear = grad.abs() > 1e-4 * largest
        for r in per_rank:
            diff = (r["sharded:delta"][name] - r["whole:delta"][name])[clear]
            assert diff.abs().max() <= TOLERANCE * dp_workers.LR, name
        compared += int(clear.sum())
        total += grad.numel()
    assert compared / total > 0.9
