"""Shared test helpers: random batches and an independent, plainly written GRPO reference."""

from __future__ import annotations

import random
import statistics

import torch

from thundersync_core.batch import Segment, Trajectory


def random_batch(
    seed: int,
    vocab: int,
    n_groups: int = 3,
    group_size: int = 4,
    max_segments: int = 4,
) -> list[Trajectory]:
    """Groups with shared prompts; trajectories of several action/observation segments."""
    rng = random.Random(seed)
    batch = []
    for g in range(n_groups):
        prompt = tuple(rng.randrange(vocab) for _ in range(rng.randint(2, 9)))
        for i in range(group_size):
            segments = []
            for _ in range(rng.randint(1, max_segments)):
                n = rng.randint(1, 6)
                ids = [rng.randrange(vocab) for _ in range(n)]
                mask = [rng.random() < 0.85 for _ in range(n)]
                segments.append(Segment.action(ids, mask))
                if rng.random() < 0.7:
                    segments.append(
                        Segment.observation(
                            [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
                        )
                    )
            reward = round(rng.random(), 3)
            batch.append(Trajectory(f"g{g}", f"g{g}-t{i}", prompt, tuple(segments), reward))
    return batch


def reference_grad_j(
    model: torch.nn.Module, batch: list[Trajectory], loss_agg: str = "seq-sum"
) -> tuple[float, dict[str, torch.Tensor]]:
    """grad J by the textbook recipe: full forward of each sequence, full-vocab log-softmax,
    advantages from the group's population statistics, one backward of the whole loss."""
    groups: dict[str, list[Trajectory]] = {}
    for t in batch:
        groups.setdefault(t.group_id, []).append(t)
    n_tokens = sum(sum(b for s in t.segments for b in s.scored) for t in batch)
    scale = 1.0 / len(groups) if loss_agg == "seq-sum" else 1.0 / max(n_tokens, 1)
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=next(model.parameters()).dtype)
    for members in groups.values():
        rewards = [t.reward for t in members]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        for t in members:
            adv = 0.0 if len(set(rewards)) == 1 else (t.reward - mean) / (std + 1e-6)
            tokens = list(t.prompt_ids) + [i for s in t.segments for i in s.ids]
            scored = [False] * len(t.prompt_ids) + [b for s in t.segments for b in s.scored]
            logits = model(input_ids=torch.tensor([tokens])).logits[0]
            logp = torch.log_softmax(
                logits.to(torch.promote_types(logits.dtype, torch.float32)), -1
            )
            seq = sum(
                (logp[pos - 1, tokens[pos]] for pos in range(1, len(tokens)) if scored[pos]),
                torch.zeros((), dtype=logp.dtype),
            )
            total = total + adv * seq
    objective = scale * total
    (-objective).backward()
    grads = {n: -p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(objective.detach()), grads


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max |a - b| / max |a| over every parameter."""
    assert a.keys() == b.keys()
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    scale = max(float(a[k].double().abs().max()) for k in a)
    assert scale > 0, "reference gradient is zero: the comparison would prove nothing"
    return diff / scale
