"""Supervised fine-tuning on solved episodes: the warm start before RL.

Objective: mean cross-entropy of the action tokens (the two replies of each solved episode,
each ending with ``<|im_end|>``) given everything before them; prompt and observation
tokens are context only. ``L = -(1/N) sum_{scored t} log pi(x_t | x_<t)`` over a batch,
``N`` its number of scored tokens.

Simplifications, and why they are fine here:
- batches are right-padded with no attention mask: attention is causal, so no real token
  attends to the padding after it, and padded positions carry no loss;
- the prefix every row of a batch shares (system prompt, chat header) is forwarded once;
- AdamW in fp32 with linear warm-up then cosine decay to a tenth of the peak rate, and
  global-norm clipping: enough for a few hundred steps of a few-million-parameter model;
- batches are drawn epoch by epoch from a seeded shuffle, so a run is reproducible.

``warm_start`` is the entry point: task folders in, a Hugging Face policy folder out.
Shapes: B episodes in a batch, T tokens per (right-padded) row, N scored tokens.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from thundersync_core.batch import Trajectory
from thundersync_core.policy import (
    PRESETS,
    build_model,
    build_tokenizer,
    load_model,
    load_tokenizer,
    parameter_count,
    save_policy,
    scored_logprobs,
)
from thundersync_core.policy.logprobs import cache_from_flat, prefix_key_values
from thundersync_core.rollout.agent import AgentConfig
from thundersync_core.rollout.chat import ChatFormat
from thundersync_core.rollout.sandbox import SandboxLimits, open_sandbox
from thundersync_core.warmstart.examples import AgentFormat, SolvedEpisode, solve_task
from thundersync_core.warmstart.tasks import collect_tasks

__all__ = [
    "EMBEDDED_FAMILIES",
    "STUDENT_STEPS",
    "TEACHER_STEPS",
    "SFTConfig",
    "collate",
    "example_tensors",
    "sft_loss",
    "shared_prefix_len",
    "train_sft",
    "warm_start",
]

SUMMARY_FILE = "warmstart.json"
# The embedded default: toyterm families whose reference turn fits the rollout's 64 tokens
# per turn (csv, rename: only some tasks do) and which the tiny preset fits in ~140 steps.
EMBEDDED_FAMILIES = (
    "oneliner",
    "count",
    "mktar",
    "untar",
    "grep",
    "columns",
    "find",
    "perms",
    "jobs",
)
# Student: a partial fit, so RL sees mixed rewards. Teacher (OPD): the same data to a
# near-exact fit, same tokenizer. Both at lr 3e-3, 16 episodes a batch, for the ~110
# episodes of those families; the fit follows epochs, so scale steps with the episode count.
STUDENT_STEPS = 140
TEACHER_STEPS = 400


@dataclass(frozen=True)
class SFTConfig:
    steps: int = STUDENT_STEPS
    lr: float = 3e-3
    batch_size: int = 16
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 25
    #: The forward and backward's matrix products: ``bfloat16`` autocasts them (the weights,
    #: AdamW state and the log-softmax stay float32), about 2x faster on CPUs with bf16
    #: instructions; ``float32`` computes everything in float32.
    compute_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"SFTConfig.lr must be > 0, got {self.lr}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"SFTConfig.compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}"
            )


def example_tensors(trajectory: Trajectory) -> tuple[list[int], list[bool]]:
    """All token ids of an episode and which of them carry loss (the action tokens)."""
    ids = list(trajectory.prompt_ids) + list(trajectory.response_ids)
    scored = [False] * len(trajectory.prompt_ids) + list(trajectory.response_scored)
    return ids, scored


def collate(
    examples: Sequence[tuple[list[int], list[bool]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``ids_BT`` and ``scored_BT`` (False on padding)."""
    width = max(len(ids) for ids, _ in examples)
    ids_BT = torch.full((len(examples), width), pad_id, dtype=torch.long)
    scored_BT = torch.zeros((len(examples), width), dtype=torch.bool)
    for row, (ids, scored) in enumerate(examples):
        ids_BT[row, : len(ids)] = torch.tensor(ids)
        scored_BT[row, : len(ids)] = torch.tensor(scored)
    return ids_BT, scored_BT


def shared_prefix_len(ids_BT: torch.Tensor, scored_BT: torch.Tensor) -> int:
    """Length of the prefix every row shares that ends before the first scored token.

    The token right after the prefix must be unscored: its predictor is the prefix's last
    hidden state, which the shared forward does not project.
    """
    same_T = (ids_BT == ids_BT[:1]).all(0)
    common = int(same_T.long().cumprod(0).sum())
    first_scored = int(scored_BT.any(0).long().argmax()) if bool(scored_BT.any()) else common
    return max(0, min(common, first_scored - 1))


def sft_loss(model: PreTrainedModel, ids_BT: torch.Tensor, scored_BT: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the scored tokens.

    The prefix all rows share (system prompt and chat header) is forwarded once and its
    keys/values broadcast to every row; gradients reach it through the broadcast. This is
    the same computation as a full forward of each row, with that prefix's work done once.
    """
    prefix = shared_prefix_len(ids_BT, scored_BT)
    cache = None
    if prefix > 0:
        pairs = prefix_key_values(model, ids_BT[0, :prefix])
        rows = ids_BT.shape[0]
        cache = cache_from_flat([t.expand(rows, -1, -1, -1) for kv in pairs for t in kv])
    logprobs_N, _ = scored_logprobs(
        model, ids_BT[:, prefix:], scored_BT[:, prefix:], past_key_values=cache
    )
    return -logprobs_N.mean()


def _batches(n_examples: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Indices of each batch: every example once per epoch, reshuffled each epoch."""
    rng = random.Random(seed)
    while True:
        order = list(range(n_examples))
        rng.shuffle(order)
        for start in range(0, n_examples, batch_size):
            yield order[start : start + batch_size]


def _lr_factor(step: int, config: SFTConfig) -> float:
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def train_sft(
    model: PreTrainedModel,
    examples: Sequence[tuple[list[int], list[bool]]],
    config: SFTConfig,
    *,
    pad_id: int,
    log: Callable[[str], None] | None = None,
) -> list[float]:
    """Fine-tune ``model`` in place on ``examples``; returns the loss of every step."""
    if not examples:
        raise ValueError("train_sft: no examples to train on")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return _train_loop(model, examples, config, pad_id, log)


def _train_loop(
    model: PreTrainedModel,
    examples: Sequence[tuple[list[int], list[bool]]],
    config: SFTConfig,
    pad_id: int,
    log: Callable[[str], None] | None,
) -> list[float]:
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95)
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, config))
    batches = _batches(len(examples), config.batch_size, config.seed)
    device = next(model.parameters()).device.type
    autocast = config.compute_dtype == "bfloat16"
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    with _attention(model, "eager" if autocast and device == "cpu" else None):
        for step in range(config.steps):
            ids_BT, scored_BT = collate([examples[i] for i in next(batches)], pad_id)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                loss = sft_loss(model, ids_BT, scored_BT)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
            if log is not None and (step + 1) % config.log_every == 0:
                recent = losses[-config.log_every :]
                log(
                    f"step {step + 1}/{config.steps} loss {sum(recent) / len(recent):.4f} "
                    f"lr {schedule.get_last_lr()[0]:.2e} {time.perf_counter() - start:.1f}s"
                )
    model.eval()
    return losses


@contextlib.contextmanager
def _attention(model: PreTrainedModel, implementation: str | None) -> Iterator[None]:
    """Run with ``implementation`` as the model's attention (None: as it is), then restore.

    bf16 on CPU computes attention as batched matrix products ("eager"): a tiny-preset step
    of 16 solved episodes (279 tokens wide) takes 0.33-0.37 s that way against 0.39-0.44 s
    in SDPA's CPU flash kernel, under tcmalloc, alternating runs on the 2-core AMD box (no
    AMX); in float32 SDPA is the faster (0.48 s against 0.52 s). The losses agree.
    """
    before = model.config._attn_implementation
    if implementation is not None:
        model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


# -- the warm start -----------------------------------------------------------------------


def warm_start(
    task_roots: Sequence[Path],
    out_dir: Path,
    *,
    preset: str = "tiny",
    steps: int = STUDENT_STEPS,
    lr: float = 3e-3,
    batch_size: int = 16,
    seed: int = 0,
    compute_dtype: str = "float32",
    families: Sequence[str] | None = None,
    limit: int = 0,
    init_from: Path | None = None,
    tokenizer_from: Path | None = None,
    agent_config: AgentConfig | None = None,
    chat: Mapping[str, Any] | None = None,
    max_action_tokens: int = 64,
    sandbox_workers: int = 4,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune a policy on the reference solutions of ``task_roots``; save it to ``out_dir``.

    ``task_roots``: task folders, folders of task folders, or ``terminal/*.parquet`` files
    of a prep run. ``families`` keeps only those task families; ``limit`` the first N tasks
    after that. The policy starts from ``init_from`` (a Hugging Face folder whose tokenizer
    is kept) or a fresh ``preset`` model with the offline tokenizer; ``tokenizer_from`` takes
    the tokenizer of another policy folder instead (a teacher must share its student's).
    ``chat``: the conversation format's options (``ChatFormat``'s: action format, tool-call
    format, thinking), the starting folder's stop tokens; default: fenced bash blocks.
    Episodes whose first action exceeds ``max_action_tokens`` (the rollout's tokens per
    turn) or whose length exceeds the agent's or the model's context are left out.
    ``out_dir`` receives the policy and ``warmstart.json``, the returned summary.
    """
    start = time.perf_counter()
    log = log or _stderr
    config = SFTConfig(
        steps=steps, lr=lr, batch_size=batch_size, seed=seed, compute_dtype=compute_dtype
    )
    agent_config = agent_config or AgentConfig()
    tasks = collect_tasks(task_roots, families=families, limit=limit)
    model, tokenizer = _initial_policy(preset, seed, init_from, tokenizer_from)
    chat_format = None
    if chat is not None:
        chat_format = ChatFormat.for_checkpoint(tokenizer, init_from, **chat)
    fmt = AgentFormat(tokenizer, agent_config, chat=chat_format)
    solved, skipped = _solve_all(tasks, agent_config.command_timeout_s, sandbox_workers)
    solve_s = time.perf_counter() - start
    context = min(agent_config.max_context_tokens, model.config.max_position_embeddings)
    episodes, too_long = _fit([(s, fmt.episode(s)) for s in solved], max_action_tokens, context)
    skipped.update(too_long)
    if not episodes:
        raise ValueError(f"warm start: no usable episode among {len(tasks)} tasks ({skipped})")
    log(f"warm start: {len(episodes)} episodes from {len(tasks)} tasks in {solve_s:.1f}s")
    train_start = time.perf_counter()
    losses = train_sft(
        model,
        [example_tensors(t) for _, t in episodes],
        config,
        pad_id=int(tokenizer.pad_token_id),
        log=log,
    )
    save_policy(model, tokenizer, out_dir)
    summary = {
        "out_dir": str(out_dir),
        "preset": preset if init_from is None else None,
        "init_from": str(init_from) if init_from is not None else None,
        "parameters": parameter_count(model),
        **_data_summary(episodes, skipped),
        **_loss_summary(losses, config),
        "solve_s": round(solve_s, 2),
        "train_s": round(time.perf_counter() - train_start, 2),
        "wall_s": round(time.perf_counter() - start, 2),
    }
    (Path(out_dir) / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _initial_policy(
    preset: str, seed: int, init_from: Path | None, tokenizer_from: Path | None
) -> tuple[PreTrainedModel, Any]:
    if init_from is not None:
        model = load_model(init_from)
    elif preset in PRESETS:
        model = build_model(preset, seed=seed)
    else:
        raise KeyError(f"--preset {preset!r}: unknown; known: {sorted(PRESETS)}")
    source = tokenizer_from or init_from
    tokenizer = (
        load_tokenizer(source)
        if source is not None
        else build_tokenizer(vocab_size=model.config.vocab_size)
    )
    if len(tokenizer) > model.config.vocab_size:  # type: ignore[arg-type]
        raise ValueError(
            f"tokenizer of {source} has {len(tokenizer)} tokens, "  # type: ignore[arg-type]
            f"more than the model's vocabulary ({model.config.vocab_size})"
        )
    return model, tokenizer


def _solve_all(
    tasks: Sequence[Any], timeout_s: float, workers: int
) -> tuple[list[SolvedEpisode], Counter[str]]:
    limits = SandboxLimits(timeout_s=timeout_s)

    def factory() -> Any:
        return open_sandbox("local", limits=limits)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        outcomes = list(pool.map(lambda t: solve_task(t, factory, timeout_s=timeout_s), tasks))
    solved = [episode for episode, _ in outcomes if episode is not None]
    skipped = Counter(reason for episode, reason in outcomes if episode is None)
    return solved, skipped


def _fit(
    pairs: Sequence[tuple[SolvedEpisode, Trajectory]], max_action_tokens: int, context: int
) -> tuple[list[tuple[SolvedEpisode, Trajectory]], Counter[str]]:
    kept, skipped = [], Counter[str]()
    for solved, trajectory in pairs:
        action = trajectory.segments[0]
        total = len(trajectory.prompt_ids) + len(trajectory.response_ids)
        if len(action.ids) > max_action_tokens:
            skipped[f"action over {max_action_tokens} tokens"] += 1
        elif total > context:
            skipped[f"episode over {context} tokens"] += 1
        else:
            kept.append((solved, trajectory))
    return kept, skipped


def _distribution(values: Sequence[int]) -> dict[str, float]:
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"min": ordered[0], "p50": at(0.5), "p90": at(0.9), "max": ordered[-1]}


def _data_summary(
    episodes: Sequence[tuple[SolvedEpisode, Trajectory]], skipped: Counter[str]
) -> dict[str, Any]:
    trajectories = [t for _, t in episodes]
    return {
        "examples": len(episodes),
        "families": dict(Counter(s.family for s, _ in episodes)),
        "skipped": dict(skipped),
        "with_locale": sum(s.command.startswith("export LC_ALL=C") for s, _ in episodes),
        "tokens": {
            "prompt": _distribution([len(t.prompt_ids) for t in trajectories]),
            "first_action": _distribution([len(t.segments[0].ids) for t in trajectories]),
            "episode": _distribution(
                [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
            ),
        },
    }


def _loss_summary(losses: Sequence[float], config: SFTConfig) -> dict[str, Any]:
    tail = losses[-config.log_every :]
    return {
        "sft": asdict(config),
        "steps": config.steps,
        "first_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
    }
