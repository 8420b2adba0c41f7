"""Shared test helpers: random batches, an independent, plainly written GRPO reference, and
small training configs with their checkpoints' weights."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from thundersync_core.batch import Segment, Trajectory, turns_of
from thundersync_core.objectives.opd import TAIL_MASS_FLOOR, split_by_turn
from thundersync_core.policy import build_model
from thundersync_core.teacher import Teacher


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


def with_teacher(batch: list[Trajectory], seed: int) -> list[Trajectory]:
    """Attach made-up teacher log-probs (one per scored token) to every trajectory."""
    rng = random.Random(seed)
    return [
        dataclasses.replace(
            t, teacher_logprobs=tuple(-5 * rng.random() for _ in range(t.n_scored_tokens))
        )
        for t in batch
    ]


def reference_grad_l(
    model: torch.nn.Module, batch: list[Trajectory]
) -> tuple[float, dict[str, torch.Tensor]]:
    """grad L by the textbook recipe: one forward of each full trajectory, full-vocabulary
    log-softmax, L = (1/N) sum_t sg(log pi_t - q_t) log pi_t, one backward."""
    model.zero_grad(set_to_none=True)
    n_tokens = sum(t.n_scored_tokens for t in batch)
    total = torch.zeros((), dtype=next(model.parameters()).dtype)
    for t in batch:
        tokens = list(t.prompt_ids) + [i for s in t.segments for i in s.ids]
        scored = [False] * len(t.prompt_ids) + [b for s in t.segments for b in s.scored]
        logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0], -1)
        student = [logp[pos - 1, tokens[pos]] for pos in range(1, len(tokens)) if scored[pos]]
        assert t.teacher_logprobs is not None
        for lp, q in zip(student, t.teacher_logprobs, strict=True):
            total = total + (lp.detach() - q) * lp
    loss = total / max(n_tokens, 1)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def multi_turn_batch(seed: int, vocab: int, n_groups: int = 2, group_size: int = 3):
    """Trajectories of 1 to 6 action turns with observations between actions."""
    rng = random.Random(seed)
    batch = []
    for g in range(n_groups):
        prompt = tuple(rng.randrange(vocab) for _ in range(rng.randint(2, 8)))
        for i in range(group_size):
            n_turns = 1 + (g * group_size + i) % 6
            segments = []
            for k in range(n_turns):
                if k:
                    obs = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
                    segments.append(Segment.observation(obs))
                n = rng.randint(1, 6)
                ids = [rng.randrange(vocab) for _ in range(n)]
                segments.append(Segment.action(ids, [rng.random() < 0.85 for _ in range(n)]))
            batch.append(Trajectory(f"g{g}", f"g{g}-t{i}", prompt, tuple(segments), 0.0))
    return with_teacher(batch, seed)


def scored_positions(traj):
    tokens = list(traj.prompt_ids) + list(traj.response_ids)
    scored = [False] * len(traj.prompt_ids) + list(traj.response_scored)
    return tokens, [p for p in range(1, len(tokens)) if scored[p]]


def with_real_teacher(batch, k, dtype=torch.float64):
    """Every trajectory scored by a real (micro) teacher, turn by turn."""
    teacher = Teacher(build_model("micro", seed=99, dtype=dtype), top_k=k)
    out = []
    for traj in batch:
        scores = [teacher.score_turn(t) for t in turns_of(traj, split_by_turn(traj))]
        out.append(
            dataclasses.replace(
                traj,
                teacher_logprobs=tuple(q for s in scores for q in s.logprobs),
                teacher_top_ids=tuple(i for s in scores for i in s.top_ids),
                teacher_top_logprobs=tuple(q for s in scores for q in s.top_logprobs),
            )
        )
    return out


def reference_vocab_kl(model, batch, k):
    """(L, grad L): L = (1/N) sum_t sum_v pi_t(v) (log pi_t(v) - log q^_t(v)), one backward."""
    model.zero_grad(set_to_none=True)
    n_tokens = sum(t.n_scored_tokens for t in batch)
    total = torch.zeros((), dtype=next(model.parameters()).dtype)
    for traj in batch:
        tokens, positions = scored_positions(traj)
        logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0], -1)
        n_vocab = logp.shape[-1]
        for j, pos in enumerate(positions):
            ids = traj.teacher_top_ids[j * k : (j + 1) * k]
            top = traj.teacher_top_logprobs[j * k : (j + 1) * k]
            rest = max(1.0 - sum(math.exp(q) for q in top), TAIL_MASS_FLOOR) / (n_vocab - k)
            row = logp[pos - 1]
            logq = torch.full_like(row, math.log(rest)).detach()
            for i, q in zip(ids, top, strict=True):
                logq[i] = q
            total = total + (row.exp() * (row - logq)).sum()
    loss = total / n_tokens
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def run_opd_stream(model, batch, seed, **learner_kwargs):
    """The streaming OPD learner fed every turn of ``batch`` in a random order from ``seed``."""
    from thundersync_core.replay import interleave  # noqa: PLC0415
    from thundersync_core.streaming import StreamingOPDLearner, groups_of  # noqa: PLC0415

    learner = StreamingOPDLearner(model, **learner_kwargs)
    learner.begin_batch(groups_of(batch))
    turns = {t.trajectory_id: turns_of(t, split_by_turn(t)) for t in batch}
    for turn in interleave(turns, random.Random(seed)):
        learner.submit_turn(turn)
    return learner, learner.finish()


def run_opd_sync(model, batch, **learner_kwargs):
    """The whole-batch OPD learner fed ``batch``."""
    from thundersync_core.streaming import SyncOPDLearner, groups_of  # noqa: PLC0415

    learner = SyncOPDLearner(model, **learner_kwargs)
    learner.begin_batch(groups_of(batch))
    for traj in batch:
        learner.submit(traj)
    return learner.finish()


def train_config_file(tmp: Path, prep: Path, policy: Path, **extra: object) -> Path:
    """A small training config (hf engine, 2 groups of 4, a checkpoint every step) as a
    file; ``extra`` sets keys, nested ones spelled ``a__b``."""
    config = {
        "name": "test",
        "steps": 1,
        "groups_per_step": 2,
        "group_size": 4,
        "lr": 1e-3,
        "checkpoint_every": 1,
        "policy": {"path": str(policy), "teacher_path": str(policy)},
        "warm_start": {"enabled": False},
        "tasks": {"prep_dir": str(prep), "dev_tasks": 0},
        "rollout": {"engine": "hf", "max_turns": 3, "max_tokens_per_turn": 64},
        "resources": {"learner_peak_flops": 1e10},
    }
    for dotted, value in extra.items():
        node = config
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})  # type: ignore[assignment]
        node[leaf] = value  # type: ignore[index]
    path = tmp / f"config-{time.time_ns()}.json"
    path.write_text(json.dumps(config))
    return path


def checkpoint_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    """The policy weights of a run's checkpoint after ``step`` steps."""
    folder = run / "checkpoints" / f"step-{step:06d}" / "model"
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max |a - b| over every tensor, relative to max |a|."""
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    return diff / max(float(a[k].abs().max()) for k in a)


def reference_sampling_row(logits: list[float], f: Any) -> list[float]:
    """One row by hand: scale, keep the k largest, then keep (most likely first) each token
    while the mass before it is below top_p; log-softmax over what is kept."""
    z = [x / f.temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    kept = order[: f.top_k] if f.top_k else order
    norm = max(z[i] for i in kept)
    total = sum(math.exp(z[i] - norm) for i in kept)
    probs = {i: math.exp(z[i] - norm) / total for i in kept}
    nucleus, before = [], 0.0
    for i in kept:
        if before >= f.top_p and nucleus:
            break
        nucleus.append(i)
        before += probs[i]
    log_total = math.log(sum(math.exp(z[i] - norm) for i in nucleus)) + norm
    return [z[i] - log_total if i in nucleus else -math.inf for i in range(len(z))]
