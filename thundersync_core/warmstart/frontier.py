"""Frontier tasks: the train tasks the starting policy solves some of the time.

A GRPO group whose rewards are all equal has no advantage: it costs a rollout and teaches
nothing (the learner skips it). With ``tasks.frontier: {min_p, max_p}`` a run trains only
on the train tasks whose reference first action the starting policy samples with
probability ``p`` in ``[min_p, max_p]``::

    p = exp( sum_t log pi(a_t | prompt, a_<t) )     over the reference action's tokens

under the rollout's sampler (temperature, top-k, top-p), in the agent's exact token format
(the warm start's examples, ``examples.py``). ``p`` is the chance that an episode opens
with exactly the reference command, so it is a lower bound on the task's pass rate (another
command may solve it too); a group of n episodes then has two reward values with
probability at least about ``1 - p^n - (1 - p)^n``. Tasks whose reference does not solve
them in the sandbox, or does not fit the rollout's limits, are left out and counted.

The scores of a (policy, task set, sampler) are kept under ``warm_start.cache_dir`` when set
(``frontier-<key>.json``, the key a sha256 over the policy's files, every task's files,
the sampler and agent settings, and this code), so the schedules of an experiment score
once; the run folder gets ``frontier.json``: the band, the kept ids and every score.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from thundersync_core.config import TrainConfig

__all__ = ["RUN_FILE", "frontier_pool", "reference_action_logprobs", "select_frontier"]

RUN_FILE = "frontier.json"
#: Episodes scored per forward (right-padded; attention is causal, so padding after a row's
#: last token changes none of its log-probs).
_BATCH = 32


def reference_action_logprobs(
    model: Any, rows: Sequence[tuple[Sequence[int], Sequence[bool]]], pad_id: int
) -> list[float]:
    """Per row, the sum of the scored tokens' log-probs under ``model``'s sampling
    distribution (``policy/logprobs.py``): rows are (token ids, scored mask)."""
    import torch  # noqa: PLC0415

    from thundersync_core.policy.logprobs import scored_logprobs  # noqa: PLC0415
    from thundersync_core.warmstart.sft import collate  # noqa: PLC0415

    sums = [0.0] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    with torch.no_grad():
        for start in range(0, len(order), _BATCH):
            chunk = order[start : start + _BATCH]
            ids_BT, scored_BT = collate(
                [(list(rows[i][0]), list(rows[i][1])) for i in chunk], pad_id
            )
            logprobs_N, row_N = scored_logprobs(model, ids_BT, scored_BT)
            per_row = torch.zeros(len(chunk), dtype=torch.float64)
            per_row.index_add_(0, row_N, logprobs_N.double())
            for b, i in enumerate(chunk):
                sums[i] = float(per_row[b])
    return sums


def select_frontier(scores: Mapping[str, float], min_p: float, max_p: float) -> list[str]:
    """Ids whose ``p`` lies in ``[min_p, max_p]``, in id order."""
    return sorted(task for task, p in scores.items() if min_p <= p <= max_p)


def frontier_pool(
    config: TrainConfig,
    policy_dir: Path,
    pool: Mapping[str, Path],
    out: Path,
    report: Callable[[str], None] | None = None,
) -> dict[str, Path]:
    """``pool`` (train task id -> folder) cut to the frontier band of ``tasks.frontier``
    (all of it without one); writes ``out/frontier.json`` and reports one line (default:
    printed). Refuses, naming the key, when fewer tasks than ``groups_per_step`` remain."""
    band = config.tasks.frontier
    if band is None:
        return dict(pool)
    started = time.monotonic()
    scores, cached = _scores(config, Path(policy_dir), pool)
    kept = select_frontier(scores["p"], band.min_p, band.max_p)
    line = (
        f"{len(kept)} of {len(pool)} train tasks with p in [{band.min_p:g}, {band.max_p:g}]"
        f" ({'cached' if cached else f'scored in {time.monotonic() - started:.0f} s'}"
        + (f"; no reference episode: {scores['skipped']}" if scores["skipped"] else "")
        + ")"
    )
    if len(kept) < config.groups_per_step:
        raise ValueError(
            f"tasks.frontier: {line}, fewer than groups_per_step ({config.groups_per_step}); "
            "widen the band"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"min_p": band.min_p, "max_p": band.max_p, "kept": kept, "policy": str(policy_dir)}
    (out / RUN_FILE).write_text(json.dumps(record | scores, indent=1) + "\n")
    (report or _print)(line)
    return {task: pool[task] for task in kept}


def _print(line: str) -> None:
    print(f"[frontier] {line}", flush=True)


def _scores(
    config: TrainConfig, policy_dir: Path, pool: Mapping[str, Path]
) -> tuple[dict[str, Any], bool]:
    """({"p": {id: p}, "skipped": {reason: count}}, whether it came from the cache)."""
    cache_dir = config.warm_start.cache_dir
    target = None
    if cache_dir is not None:
        target = Path(cache_dir) / f"frontier-{_key(config, policy_dir, pool)[:16]}.json"
        if target.is_file():
            return json.loads(target.read_text()), True
    scores = _score(config, policy_dir, pool)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = target.with_name(f".{target.name}.{os.getpid()}")
        scratch.write_text(json.dumps(scores, indent=1) + "\n")
        scratch.replace(target)
    return scores, False


def _agent_settings(config: TrainConfig) -> dict[str, Any]:
    rollout = config.rollout
    return {
        "temperature": rollout.temperature,
        "top_k": rollout.top_k,
        "top_p": rollout.top_p,
        "max_turns": rollout.max_turns,
        "max_tokens_per_turn": rollout.max_tokens_per_turn,
        "max_total_tokens": rollout.max_total_tokens,
        "max_model_len": rollout.max_model_len,
        "observation_tokens": rollout.observation_tokens,
        "command_timeout_s": rollout.command_timeout_s,
        "action_format": rollout.action_format,
        "tool_call_format": rollout.tool_call_format,
        "enable_thinking": rollout.enable_thinking,
    }


def _key(config: TrainConfig, policy_dir: Path, pool: Mapping[str, Path]) -> str:
    from thundersync_core.warmstart.cache import digest_code, digest_files  # noqa: PLC0415

    digest = hashlib.sha256(json.dumps(_agent_settings(config), sort_keys=True).encode())
    digest_files(digest, policy_dir, "policy")
    for task, root in sorted(pool.items()):
        digest_files(digest, Path(root), task)
    digest_code(digest)
    return digest.hexdigest()


def _score(config: TrainConfig, policy_dir: Path, pool: Mapping[str, Path]) -> dict[str, Any]:
    from thundersync_core.policy.io import load_model, load_tokenizer  # noqa: PLC0415
    from thundersync_core.policy.logprobs import (  # noqa: PLC0415
        SamplingFilter,
        set_policy_sampling,
    )
    from thundersync_core.rollout.agent import AgentConfig  # noqa: PLC0415
    from thundersync_core.rollout.chat import chat_format  # noqa: PLC0415
    from thundersync_core.warmstart.examples import AgentFormat  # noqa: PLC0415
    from thundersync_core.warmstart.sft import _fit, _solve_all  # noqa: PLC0415
    from thundersync_core.warmstart.tasks import collect_tasks  # noqa: PLC0415

    rollout = config.rollout
    tasks = collect_tasks(list(pool.values()))
    solved, skipped = _solve_all(tasks, rollout.command_timeout_s, workers=4)
    tokenizer: Any = load_tokenizer(policy_dir)
    model = load_model(policy_dir)
    model.eval()
    set_policy_sampling(
        model, SamplingFilter(rollout.temperature, top_k=rollout.top_k, top_p=rollout.top_p)
    )
    agent = AgentConfig.of(rollout)
    fmt = AgentFormat(tokenizer, agent, chat=chat_format(tokenizer, policy_dir, rollout))
    context = min(agent.max_context_tokens, model.config.max_position_embeddings)
    episodes, too_long = _fit(
        [(s, fmt.episode(s)) for s in solved], rollout.max_tokens_per_turn, context
    )
    skipped.update(too_long)
    rows = []
    for _, episode in episodes:
        action = episode.segments[0]
        rows.append((list(episode.prompt_ids) + list(action.ids),
                     [False] * len(episode.prompt_ids) + list(action.scored)))  # fmt: skip
    sums = reference_action_logprobs(model, rows, int(tokenizer.pad_token_id))
    p = {solved.task_id: math.exp(s) for (solved, _), s in zip(episodes, sums, strict=True)}
    return {"p": dict(sorted(p.items())), "skipped": dict(sorted(skipped.items()))}
