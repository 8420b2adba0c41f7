"""Pipeline's in-flight weight update, on the real rollout worker (engine, bash agent,
bubblewrap sandbox, grader): weights published while episodes are mid-trajectory are
swapped in before the next generation round, each turn records the version that sampled
it, and the behaviour log-probs of the later turns are the new weights'. Once in-process
on the transformers engine, once as the training runtime runs it: the rollout role a Ray
actor on vLLM, with the staleness bound and the guard against a swap mid-rollout."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from thundersync_core.batch import Trajectory
from thundersync_core.config import ResourcesConfig, RoleResources, RolloutConfig
from thundersync_core.metrics import staleness_tokens, turn_token_versions
from thundersync_core.policy import (
    build_model,
    build_tokenizer,
    load_model,
    save_policy,
    scored_logprobs,
)
from thundersync_core.rollout.agent import TurnReady
from thundersync_core.rollout.vllm_engine import vllm_available
from thundersync_core.runtime.placement import remote_role, start_ray
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


def _new_weights(tmp_path: Path) -> Path:
    new_weights = tmp_path / "v1"
    model = build_model("tiny", seed=1)
    save_policy(model, build_tokenizer(vocab_size=model.config.vocab_size), new_weights)
    return new_weights


def _assert_sampled_by_their_versions(
    trajectories: list[Trajectory], old_dir: Path, new_dir: Path
) -> None:
    """Each turn's behaviour log-probs are those of the weights its version names."""
    old, new = load_model(old_dir), load_model(new_dir)
    for traj in trajectories:
        versions = list(traj.metadata["turn_versions"])
        behaviour = torch.tensor(traj.behaviour_logprobs, dtype=torch.float32)
        logp_old, logp_new = _turn_logprobs(old, traj), _turn_logprobs(new, traj)
        by_turn = torch.split(behaviour, [len(x) for x in logp_old])
        for version, sampled, o, n in zip(versions, by_turn, logp_old, logp_new, strict=True):
            sampler, other = (o, n) if version == 0 else (n, o)
            where = (traj.trajectory_id, version)
            assert torch.allclose(sampled, sampler.float(), atol=1e-4), where
            assert not torch.allclose(sampled, other.float(), atol=1e-2)


def test_weights_published_mid_trajectory_sample_the_later_turns(
    tmp_path: Path, tiny_policy_dir: Path
) -> None:
    new_weights = _new_weights(tmp_path)
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
    spanning = 0
    for traj in trajectories:
        versions = list(traj.metadata["turn_versions"])
        assert versions == sorted(versions), versions
        assert versions[0] == 0, versions
        spanning += versions[-1] == 1
    assert spanning == len(trajectories)
    _assert_sampled_by_their_versions(trajectories, tiny_policy_dir, new_weights)
    # The learner at version 1 counts the first turns one version old, the rest current.
    counts = [pair for traj in trajectories for pair in turn_token_versions(traj)]
    lags = staleness_tokens(counts, learner_version=1)
    assert set(lags) == {"0", "1"}
    assert all(lags.values())


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_in_the_ray_runtime_on_vllm_a_published_version_samples_the_later_turns(
    tmp_path: Path, tiny_policy_dir: Path
) -> None:
    """The rollout role as training starts it (a two-thread Ray actor, vLLM engine): a swap
    mid-rollout is refused, a publication mid-episode samples the later turns, and batch 2
    under ``max_staleness: 1`` starts only once version 1 is live."""
    start_ray(ResourcesConfig())
    weights = str(_new_weights(tmp_path) / "model.safetensors")
    config = RolloutConfig(engine="vllm", max_turns=3, max_tokens_per_turn=8, max_total_tokens=64)
    role = remote_role(RolloutWorker, RoleResources(num_cpus=1), max_concurrency=2).remote(
        tiny_policy_dir, {"write-hello": TASKS / "write-hello"}, config
    )
    specs = [RolloutSpec("write-hello", "b0", f"b0/{i}", batch=0) for i in range(3)]
    specs += [RolloutSpec("write-hello", "b2", f"b2/{i}", batch=2) for i in range(2)]
    trajectories: list[Trajectory] = []
    published = False
    try:
        stream = role.rollout.options(num_returns="streaming").remote(
            specs, max_live=len(specs), max_staleness=1, emit_turns=True
        )
        for ref in stream:
            event = ray.get(ref)
            if isinstance(event, TurnReady) and not published:
                with pytest.raises(ray.exceptions.RayTaskError, match="a rollout is under way"):
                    ray.get(role.load_weights.remote(weights, 1))
                ray.get(role.publish.remote(weights, 1))
                published = True
            elif isinstance(event, Trajectory):
                trajectories.append(event)
        # No rollout under way: a swap between batches is taken.
        ray.get(role.load_weights.remote(weights, 2))
        assert ray.get(role.version.remote()) == 2
        ray.get(role.close.remote())
    finally:
        ray.kill(role)

    by_id = {t.trajectory_id: list(t.metadata["turn_versions"]) for t in trajectories}
    assert sorted(by_id) == sorted(s.trajectory_id for s in specs)
    for tid, versions in by_id.items():
        assert versions == sorted(versions), (tid, versions)
        # Batch 0 starts on version 0 and swaps mid-episode; batch 2 waits for version 1.
        assert versions[0] == (0 if tid.startswith("b0/") else 1), (tid, versions)
        assert versions[-1] == 1, (tid, versions)
    _assert_sampled_by_their_versions(trajectories, tiny_policy_dir, Path(weights).parent)
