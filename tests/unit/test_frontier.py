"""The frontier score: the sum of a reference action's log-probs under the sampler, scored
in padded batches, against a plainly written reference (one row at a time, full logits)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from thundersync_core.config import load_config
from thundersync_core.policy.logprobs import SamplingFilter, set_policy_sampling
from thundersync_core.warmstart.frontier import reference_action_logprobs, select_frontier


def _rows(seed: int, vocab: int, n: int) -> list[tuple[list[int], list[bool]]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 30))]
        action = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        rows.append((prompt + action, [False] * len(prompt) + [True] * len(action)))
    return rows


def _plain(model: torch.nn.Module, ids: list[int], scored: list[bool], sampling) -> float:
    logits = model(input_ids=torch.tensor([ids])).logits[0] / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logp = F.log_softmax(logits.double(), dim=-1)
    return sum(float(logp[t - 1, ids[t]]) for t in range(1, len(ids)) if scored[t])


@pytest.mark.parametrize(
    "sampling", [SamplingFilter(), SamplingFilter(temperature=0.7), SamplingFilter(top_k=40)]
)
@pytest.mark.parametrize(("dtype", "tol"), [("micro64", 1e-10), ("micro32", 1e-4)])
def test_batched_scores_match_one_row_at_a_time(request, sampling, dtype, tol):
    model = request.getfixturevalue(dtype)
    set_policy_sampling(model, sampling)
    rows = _rows(seed=3, vocab=model.config.vocab_size, n=45)  # two batches, mixed widths
    try:
        with torch.no_grad():
            got = reference_action_logprobs(model, rows, pad_id=0)
            want = [_plain(model, ids, scored, sampling) for ids, scored in rows]
    finally:
        set_policy_sampling(model, SamplingFilter())
    assert got == pytest.approx(want, rel=tol, abs=tol)
    if sampling.top_k:
        # A token outside the top k cannot be sampled: its action has probability 0.
        assert any(s == float("-inf") for s in got) == any(w == float("-inf") for w in want)


def test_the_band_is_inclusive_and_in_id_order():
    scores = {"c": 0.5, "a": 0.1, "b": 0.95, "d": 0.0, "e": 1.0}
    assert select_frontier(scores, 0.1, 0.95) == ["a", "b", "c"]
    assert select_frontier(scores, 0.0, 1.0) == ["a", "b", "c", "d", "e"]


@pytest.mark.parametrize(
    ("band", "message"),
    [
        ({"min_p": 0.9, "max_p": 0.1}, "min_p .* must be below max_p"),
        ({"min_p": 0.5, "max_p": 0.5}, "min_p .* must be below max_p"),
        ({"min_p": -0.1, "max_p": 0.5}, "tasks.frontier.min_p"),
        ({"min_p": 0.1, "max_p": 1.5}, "tasks.frontier.max_p"),
        ({"min_p": 0.1}, "tasks.frontier.max_p"),
    ],
)
def test_bad_bands_are_refused_naming_the_key(band, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, {"tasks.frontier": band})
