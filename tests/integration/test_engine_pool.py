"""Several rollout engines (``resources.rollout.engines``), each its own Ray actor, train as
one: a trajectory's tokens are seeded per request, so the batches, and with sums in
trajectory-id order the weights, are bitwise those of a one-engine run, while both engines
served requests. The two-engine run publishes by collective (a gloo broadcast from the
learner to both engines' workers) with ``verify_publication``: after every step each
engine checks that its loaded parameters are bitwise what the learner sent, and that what
arrived hashes as what was sent; the one-engine run publishes files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import checkpoint_weights, max_rel_diff, train_config_file
from thundersync_core.config import load_config
from thundersync_core.rollout.vllm_engine import vllm_available
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


def test_two_engines_train_bitwise_as_one(tmp_path, tiny_prep_dir, solver_policy_dir):
    if not vllm_available():
        pytest.skip("vLLM is not installed (collective publication loads into vLLM engines)")
    engine = "vllm"
    common = {
        "schedule": "thundersync",
        "steps": 2,
        "learner_order": "fixed",
        "rollout__engine": engine,
    }
    runs = {}
    collective = {"rollout__publication": "collective", "rollout__verify_publication": True}
    for engines in (1, 2):
        config = train_config_file(
            tmp_path,
            tiny_prep_dir,
            solver_policy_dir,
            resources__rollout__engines=engines,
            **common,
            **(collective if engines == 2 else {}),
        )
        assert train(load_config(config), tmp_path / f"e{engines}")["status"] == "finished"
        runs[engines] = [
            json.loads(line)
            for line in (tmp_path / f"e{engines}" / "metrics.jsonl").read_text().splitlines()
        ]
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
    for step in (0, 1):
        sampled = [
            _sampled(tmp_path / f"e{n}" / "batches" / f"step-{step:06d}.jsonl") for n in (1, 2)
        ]
        assert sampled[0] == sampled[1], f"step {step}: two engines sampled other tokens"
    one, two = checkpoint_weights(tmp_path / "e1", 2), checkpoint_weights(tmp_path / "e2", 2)
    start = load_file(str(solver_policy_dir / "model.safetensors"))
    assert max_rel_diff(start, one) > 1e-4, "training must have moved the weights"
    assert max_rel_diff(one, two) == 0.0
