"""``tasks.frontier``: the reference actions run in the sandbox and are scored under the
starting policy; ``p`` is the chance that the sampler opens an episode with exactly that
action (checked by sampling), the band cuts the pool, the scores are kept by key."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from thundersync_core.config import load_config
from thundersync_core.policy.io import load_model, load_tokenizer
from thundersync_core.pools import load_pool
from thundersync_core.rollout.agent import AgentConfig
from thundersync_core.rollout.chat import chat_format
from thundersync_core.warmstart.examples import AgentFormat, solve_task
from thundersync_core.warmstart.frontier import RUN_FILE, frontier_pool
from thundersync_core.warmstart.tasks import collect_tasks

pytestmark = pytest.mark.integration


def _config(prep: Path, cache: Path | None, band: dict[str, float], **extra: object):
    return load_config(
        None,
        {
            "tasks.prep_dir": str(prep),
            "tasks.frontier": band,
            "groups_per_step": 1,
            "rollout.max_tokens_per_turn": 64,
            **({"warm_start.cache_dir": str(cache)} if cache else {}),
            **extra,
        },
    )


def test_the_band_cuts_the_pool_and_scores_are_kept_by_key(
    tmp_path: Path, tiny_prep_dir: Path, solver_policy_dir: Path
) -> None:
    prep = tmp_path / "prep"
    shutil.copytree(tiny_prep_dir, prep)
    pool = load_pool(prep, "train")
    cache = tmp_path / "cache"
    lines: list[str] = []
    config = _config(prep, cache, {"min_p": 0.0, "max_p": 1.0})
    kept = frontier_pool(config, solver_policy_dir, pool, tmp_path / "a", report=lines.append)
    assert kept == pool
    record = json.loads((tmp_path / "a" / RUN_FILE).read_text())
    p = record["p"]
    assert sorted(p) == sorted(pool)
    assert all(0.0 < v < 1.0 for v in p.values()), p
    assert "scored in" in lines[-1]
    (cached,) = cache.glob("frontier-*.json")
    written = cached.stat().st_mtime_ns

    # A band around one task keeps it alone; the scores come from the cache.
    low, high = sorted(p.values())
    one = _config(prep, cache, {"min_p": (low + high) / 2, "max_p": 1.0})
    kept = frontier_pool(one, solver_policy_dir, pool, tmp_path / "b", report=lines.append)
    assert list(kept) == [task for task, v in p.items() if v == high]
    assert "cached" in lines[-1]
    assert cached.stat().st_mtime_ns == written

    # Fewer tasks than a step's groups: refused, naming the key; nothing kept in the run.
    wide = _config(prep, cache, {"min_p": (low + high) / 2, "max_p": 1.0}, groups_per_step=2)
    with pytest.raises(ValueError, match=r"tasks.frontier: 1 of 2 train tasks .*groups_per_step"):
        frontier_pool(wide, solver_policy_dir, pool, tmp_path / "c")
    assert not (tmp_path / "c" / RUN_FILE).exists()

    # Another sampler, or one changed byte of a task, is another score.
    hot = _config(prep, cache, {"min_p": 0.0, "max_p": 1.0}, **{"rollout.temperature": 2.0})
    frontier_pool(hot, solver_policy_dir, pool, tmp_path / "d", report=lines.append)
    assert "scored in" in lines[-1]
    assert len(list(cache.glob("frontier-*.json"))) == 2
    hotter = json.loads((tmp_path / "d" / RUN_FILE).read_text())["p"]
    assert all(hotter[t] < p[t] for t in p), "a flatter sampler opens with the reference less"
    instruction = next(iter(pool.values())) / "instruction.md"
    instruction.write_text(instruction.read_text() + " ")
    frontier_pool(config, solver_policy_dir, pool, tmp_path / "e", report=lines.append)
    assert "scored in" in lines[-1]
    assert len(list(cache.glob("frontier-*.json"))) == 3


def test_p_is_the_chance_of_sampling_the_reference_action(
    tmp_path: Path, tiny_prep_dir: Path, solver_policy_dir: Path
) -> None:
    """Sample the first action at temperature 1 from the policy, many times: the share of
    samples that are exactly the reference action is p, within the binomial spread."""
    pool = load_pool(tiny_prep_dir, "train")
    config = _config(tiny_prep_dir, None, {"min_p": 0.0, "max_p": 1.0})
    frontier_pool(config, solver_policy_dir, pool, tmp_path, report=lambda _: None)
    p = json.loads((tmp_path / RUN_FILE).read_text())["p"]
    tokenizer = load_tokenizer(solver_policy_dir)
    model = load_model(solver_policy_dir)
    chat = chat_format(tokenizer, solver_policy_dir, config.rollout)
    fmt = AgentFormat(tokenizer, AgentConfig.of(config.rollout), chat=chat)
    torch.manual_seed(0)
    n = 400
    for task in collect_tasks(list(pool.values())):
        solved, _ = solve_task(task, _sandbox_factory(), timeout_s=10.0)
        assert solved is not None
        episode = fmt.episode(solved)
        action = episode.segments[0]
        assert all(action.scored), "every token of the action is the policy's choice"
        prompt = torch.tensor([episode.prompt_ids])
        with torch.no_grad():
            out = model.generate(
                prompt.expand(n, -1),
                attention_mask=torch.ones(n, prompt.shape[1], dtype=torch.long),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=len(action.ids),
                min_new_tokens=len(action.ids),
                pad_token_id=int(tokenizer.pad_token_id),
            )
        hits = int((out[:, prompt.shape[1] :] == torch.tensor(action.ids)).all(1).sum())
        expected = p[solved.task_id]
        spread = 4 * math.sqrt(expected * (1 - expected) / n)
        assert abs(hits / n - expected) <= spread, (solved.task_id, hits / n, expected)


def _sandbox_factory():
    from thundersync_core.rollout.sandbox import SandboxLimits, open_sandbox  # noqa: PLC0415

    return lambda: open_sandbox("local", limits=SandboxLimits(timeout_s=10.0))
