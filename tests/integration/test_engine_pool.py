"""Several rollout engines (``resources.rollout.engines``), each its own Ray actor, train as
one: a trajectory's tokens are seeded per request, so the batches, and with sums in
trajectory-id order the weights, are bitwise those of a one-engine run, while both engines
served requests. The two-engine run publishes by collective (a gloo broadcast from the
learner to both engines' workers) with ``verify_publication``: after every step each
engine checks that its loaded parameters are bitwise what the learner sent, and that what
arrived hashes as what was sent. The one-engine run is the session's sync reference on vLLM
(file publication), so the two-engine thundersync run also meets sync's update."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import checkpoint_weights, max_rel_diff, train_config_file
from thundersync_core.config import load_config
from thundersync_core.train import train

pytestmark = pytest.mark.integration


def _sampled(batch: Path) -> dict[str, tuple]:
    """What the engines decided, by trajectory (the file is in arrival order, with times)."""
    out = {}
    for line in batch.read_text().splitlines():
        t = json.loads(line)
        out[t["trajectory_id"]] = (
            json.dumps(t["segments"]),
            t["reward"],
            t["behaviour_logprobs"],
            t["metadata"]["turn_versions"],
        )
    return out


def test_two_engines_train_bitwise_as_one(
    tmp_path, tiny_prep_dir, solver_policy_dir, uninterrupted_vllm_run
):
    steps = 2
    config = train_config_file(
        tmp_path,
        tiny_prep_dir,
        solver_policy_dir,
        schedule="thundersync",
        steps=steps,
        learner_order="fixed",
        rollout__engine="vllm",
        rollout__publication="collective",
        rollout__verify_publication=True,
        resources__rollout__engines=2,
    )
    assert train(load_config(config), tmp_path / "e2")["status"] == "finished"
    folders = {1: uninterrupted_vllm_run, 2: tmp_path / "e2"}
    runs = {
        n: [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()][
            :steps
        ]
        for n, folder in folders.items()
    }
    served = runs[2][-1]["engine_requests"]
    assert len(served) == 2
    assert min(served) > 0, f"an engine served nothing: {served}"
    assert "engine_requests" not in runs[1][-1]
    # The broadcast carried the whole float32 model each step; the file run sent nothing.
    sizes = {r["publication_bytes"] for r in runs[2]}
    assert len(sizes) == 1
    assert sizes.pop() == 4 * sum(
        t.numel() for t in load_file(str(solver_policy_dir / "model.safetensors")).values()
    )
    assert "publication_bytes" not in runs[1][-1]
    assert [r["reward_mean"] for r in runs[1]] == [r["reward_mean"] for r in runs[2]]
    for step in range(steps):
        sampled = [_sampled(folders[n] / "batches" / f"step-{step:06d}.jsonl") for n in (1, 2)]
        assert sampled[0] == sampled[1], f"step {step}: two engines sampled other tokens"
    one, two = checkpoint_weights(folders[1], steps), checkpoint_weights(folders[2], steps)
    start = load_file(str(solver_policy_dir / "model.safetensors"))
    assert max_rel_diff(start, one) > 1e-4, "training must have moved the weights"
    assert max_rel_diff(one, two) == 0.0
