"""Pipeline's in-flight weight update, on the real rollout worker (engine, bash agent,
bubblewrap sandbox, grader): weights published while episodes are mid-trajectory are
swapped in before the next generation round, each turn records the version that sampled
it, and the behaviour log-probs of the later turns are the new weights'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from thundersync_core.batch import Trajectory
from thundersync_core.config import RolloutConfig
from thundersync_core.metrics import staleness_tokens, turn_token_versions
from thundersync_core.policy import (
    build_model,
    build_tokenizer,
    load_model,
    save_policy,
    scored_logprobs,
)
from thundersync_core.rollout.agent import TurnReady
from thundersync_core.runtime.rollout_worker import RolloutSpec, RolloutWorker
from thundersync_core.warmstart.sft import example_tensors

pytestmark = pytest.mark.integration
TASKS = Path(__file__).parents[1] / "fixtures" / "tasks"


def _turn_logprobs(model: torch.nn.Module, traj: Trajectory) -> list[torch.Tensor]:
    """The model's log-prob of each action token, one tensor per action turn."""
    ids, scored = example_tensors(traj)
    with torch.no_grad():
        logp, _ = scored_logprobs(model, torch.tensor([ids]), torch.tensor([scored]))
    sizes = [sum(s.scored) for s in traj.segments if s.kind == "action"]
    return list(torch.split(logp.flatten(), sizes))


def test_weights_published_mid_trajectory_sample_the_later_turns(
    tmp_path: Path, tiny_policy_dir: Path
) -> None:
    new_weights = tmp_path / "v1"
    model = build_model("tiny", seed=1)
    save_policy(model, build_tokenizer(vocab_size=model.config.vocab_size), new_weights)
    # Random weights rarely end a turn or submit: every episode runs its three turns.
    config = RolloutConfig(engine="hf", max_turns=3, max_tokens_per_turn=8, max_total_tokens=64)
    worker = RolloutWorker(tiny_policy_dir, {"write-hello": TASKS / "write-hello"}, config)
    specs = [RolloutSpec("write-hello", "g", f"g/{i}", batch=1) for i in range(3)]
    trajectories: list[Trajectory] = []
    try:
        for event in worker.rollout(specs, max_staleness=1, emit_turns=True):
            if isinstance(event, TurnReady) and worker.version() == 0:
                # Lands before the next generation round, mid-trajectory.
                worker.publish(str(new_weights / "model.safetensors"), 1)
            elif isinstance(event, Trajectory):
                trajectories.append(event)
    finally:
        worker.close()

    assert sorted(t.trajectory_id for t in trajectories) == ["g/0", "g/1", "g/2"]
    assert [swap[0] for swap in worker.weight_swaps] == [1]
    old, new = load_model(tiny_policy_dir), load_model(new_weights)
    spanning = 0
    for traj in trajectories:
        versions = list(traj.metadata["turn_versions"])
        assert versions == sorted(versions), versions
        assert versions[0] == 0, versions
        spanning += versions[-1] == 1
        behaviour = torch.tensor(traj.behaviour_logprobs, dtype=torch.float32)
        logp_old, logp_new = _turn_logprobs(old, traj), _turn_logprobs(new, traj)
        by_turn = torch.split(behaviour, [len(x) for x in logp_old])
        for version, sampled, o, n in zip(versions, by_turn, logp_old, logp_new, strict=True):
            sampler, other = (o, n) if version == 0 else (n, o)
            where = (traj.trajectory_id, version)
            assert torch.allclose(sampled, sampler.float(), atol=1e-4), where
            assert not torch.allclose(sampled, other.float(), atol=1e-2)
    assert spanning == len(trajectories)
    # The learner at version 1 counts the first turns one version old, the rest current.
    counts = [pair for traj in trajectories for pair in turn_token_versions(traj)]
    lags = staleness_tokens(counts, learner_version=1)
    assert set(lags) == {"0", "1"}
    assert all(lags.values())
