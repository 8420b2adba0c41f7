"""Log-probs of the distribution actually sampled (temperature, top-k, top-p).

The engines report behaviour log-probs of the sampling distribution (``sampling_log_softmax``
in the transformers engine, vLLM's processed log-probs); the learner's policy is the
tempered softmax (``set_policy_sampling`` with the run's temperature), whose support is the
whole vocabulary. References here are written out per row with Python sorting, independent
of the vectorised masks.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.helpers import random_batch, reference_sampling_row, rel_diff
from thundersync_core.objectives.opd import vocab_kl
from thundersync_core.policy import build_model
from thundersync_core.policy.logprobs import (
    SamplingFilter,
    policy_sampling,
    sampling_log_softmax,
    set_policy_sampling,
)
from thundersync_core.streaming import StreamingGRPOLearner, SyncGRPOLearner, groups_of

FILTERS = [
    SamplingFilter(0.7, 0, 0.9),
    SamplingFilter(0.6, 20, 0.95),
    SamplingFilter(1.3, 5, 1.0),
    SamplingFilter(1.0, 0, 0.5),
]


@pytest.mark.parametrize("f", FILTERS, ids=str)
def test_sampling_log_softmax_matches_the_written_out_rows(f):
    logits = torch.randn(6, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ours = sampling_log_softmax(logits * 2.0, f)
    for row, got in zip((logits * 2.0).tolist(), ours, strict=True):
        want = torch.tensor(reference_sampling_row(row, f), dtype=torch.float64)
        assert torch.equal(torch.isinf(want), torch.isinf(got))
        finite = torch.isfinite(want)
        assert float((want[finite] - got[finite]).abs().max()) < 1e-12
        assert float(got[finite].exp().sum()) == pytest.approx(1.0, abs=1e-12)


def test_plain_sampling_is_the_plain_log_softmax_bitwise():
    logits = torch.randn(4, 32)
    assert torch.equal(
        sampling_log_softmax(logits, SamplingFilter()), torch.log_softmax(logits, -1)
    )
    assert policy_sampling(torch.nn.Linear(2, 2)) == SamplingFilter()


def reference_grad(model, batch, f: SamplingFilter) -> dict[str, torch.Tensor]:
    """grad J (seq-sum) with each token's log-prob under ``f``, by the textbook recipe."""
    groups: dict[str, list] = {}
    for t in batch:
        groups.setdefault(t.group_id, []).append(t)
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for members in groups.values():
        rewards = torch.tensor([t.reward for t in members], dtype=torch.float64)
        mean, std = rewards.mean(), rewards.std(unbiased=False)
        for t in members:
            adv = 0.0 if len(set(rewards.tolist())) == 1 else (t.reward - mean) / (std + 1e-6)
            tokens = list(t.prompt_ids) + [i for s in t.segments for i in s.ids]
            scored = [False] * len(t.prompt_ids) + [b for s in t.segments for b in s.scored]
            logits = model(input_ids=torch.tensor([tokens])).logits[0] / f.temperature
            for pos in range(1, len(tokens)):
                if scored[pos]:
                    mask = _dropped(logits[pos - 1].detach(), f)
                    logp = torch.log_softmax(logits[pos - 1].masked_fill(mask, -math.inf), -1)
                    total = total + adv * logp[tokens[pos]]
    (-(total / len(groups))).backward()
    grads = {n: -p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _dropped(scaled_row: torch.Tensor, f: SamplingFilter) -> torch.Tensor:
    unscaled = SamplingFilter(1.0, f.top_k, f.top_p)
    return torch.tensor(
        [math.isinf(v) for v in reference_sampling_row(scaled_row.tolist(), unscaled)]
    )


@pytest.mark.parametrize("f", [SamplingFilter(0.7), SamplingFilter(1.3)], ids=str)
def test_streamed_and_sync_grpo_at_a_temperature_equal_the_reference(f):
    model = build_model("micro", seed=3, dtype=torch.float64)
    set_policy_sampling(model, f)
    batch = random_batch(seed=11, vocab=1024, n_groups=3, group_size=4)
    want = reference_grad(model, batch, f)

    sync = SyncGRPOLearner(model, loss_agg="seq-sum")
    sync.begin_batch(groups_of(batch))
    for t in batch:
        sync.submit(t)
    sync_result = sync.finish()
    stream = StreamingGRPOLearner(model, loss_agg="seq-sum", max_open_groups=2)
    stream.begin_batch(groups_of(batch))
    for t in random.Random(5).sample(batch, len(batch)):
        stream.submit(t)
    stream_result = stream.finish()
    assert rel_diff(want, sync_result.grad_objective) <= 1e-10
    assert rel_diff(want, stream_result.grad_objective) <= 1e-10
    # The sampler matters: the plain policy's gradient is another one.
    plain = build_model("micro", seed=3, dtype=torch.float64)
    plain_learner = SyncGRPOLearner(plain, loss_agg="seq-sum")
    plain_learner.begin_batch(groups_of(batch))
    for t in batch:
        plain_learner.submit(t)
    assert rel_diff(want, plain_learner.finish().grad_objective) > 1e-3


def test_vocab_kl_under_a_nucleus_is_finite_with_finite_gradient():
    logits = torch.randn(5, 64, dtype=torch.float64, requires_grad=True)
    logp = sampling_log_softmax(logits, SamplingFilter(0.7, 0, 0.8))
    assert bool(torch.isinf(logp).any())
    top_logprobs, top_ids = torch.log_softmax(torch.randn(5, 64, dtype=torch.float64), -1).topk(4)
    kl = vocab_kl(logp, top_ids, top_logprobs)
    kl.sum().backward()
    assert bool(torch.isfinite(kl).all())
    assert logits.grad is not None
    assert bool(torch.isfinite(logits.grad).all())
