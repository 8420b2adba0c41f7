"""A warm-started policy solves a task through the real agent, sandbox and grader.

The micro policy is fine-tuned on the reference solution of the ``write-hello`` fixture
(solved in the local sandbox and graded first, as the warm start always does), then
sampled at temperature 1 by the transformers engine inside the real bash agent.

Why a pass cannot be chance: the reward needs the exact reply ```` ```bash\\necho hello >
hello.txt\\n``` ```` (about 15 tokens from a 1024-entry vocabulary) followed by a submit
block; the untrained policy, run first on the same task and seeds, solves nothing.
Memorising one example is all this test asks of the warm start.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from thundersync_core.policy import build_model, load_tokenizer, save_policy
from thundersync_core.rollout.agent import Agent, AgentConfig, EpisodeSpec
from thundersync_core.rollout.hf_engine import HFEngine
from thundersync_core.rollout.sandbox import SandboxLimits, open_sandbox
from thundersync_core.rollout.tasks import load_terminal_task
from thundersync_core.warmstart.sft import warm_start

pytestmark = pytest.mark.integration
TASK = Path(__file__).parent.parent / "fixtures" / "tasks" / "write-hello"


def _rewards(model_dir: Path, n: int) -> list[float]:
    engine = HFEngine(model_dir)
    limits = SandboxLimits(timeout_s=10)
    agent = Agent(
        engine,
        load_tokenizer(model_dir),  # type: ignore[arg-type]
        lambda: open_sandbox("local", limits=limits),
        config=AgentConfig(max_turns=2, max_tokens_per_turn=32),
        base_seed=0,
    )
    task = load_terminal_task(TASK)
    specs = [EpisodeSpec(task, "hello", f"hello/{i}") for i in range(n)]
    try:
        return [t.reward for t in agent.run(specs)]
    finally:
        agent.close()


def test_warm_started_policy_solves_the_task_it_was_trained_on(tmp_path):
    out = tmp_path / "policy"
    summary = warm_start([TASK], out, preset="micro", steps=80, lr=3e-3, batch_size=1, seed=0)
    assert summary["examples"] == 1
    assert summary["final_loss"] < 0.1 * summary["first_loss"]

    # The policy warm_start started from (same preset and seed), on the same sampling seeds.
    before = tmp_path / "before"
    save_policy(build_model("micro", seed=0), load_tokenizer(out), before)
    assert _rewards(before, 4) == [0.0] * 4

    rewards = _rewards(out, 4)
    assert sum(rewards) >= 3, rewards
