"""LoRA adapter publication into a running vLLM engine (``rollout.lora_publication: adapter``).

Each published version is a new adapter over the engine's base weights, added without
restarting the engine; the previous one is removed. The behaviour log-probs the engine
reports must then be the learner's, the LoRA model's (equal to its merged weights), to the
1e-4 the engine tests allow for vLLM's CPU kernels against transformers in float32; the
base model's log-probs differ from them by far more (B is drawn non-zero, std 0.02), so a
match cannot come from an adapter that was never applied. A short training run publishing
adapters samples step 1 with the log-probs of its own step-1 checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import train_config_file
from tests.integration.test_engines import (
    SAMPLING,
    assert_logprobs_match,
    learner_logprobs,
    one_step,
    requests,
)
from thundersync_core.batch import read_batch
from thundersync_core.config import load_config
from thundersync_core.policy import load_model, scored_logprobs
from thundersync_core.policy.lora import LoraSettings, apply_lora, save_adapter
from thundersync_core.rollout.vllm_engine import VLLMEngine, lora_rank_slot, vllm_available
from thundersync_core.train import train

pytestmark = pytest.mark.integration
SETTINGS = LoraSettings(r=4, alpha=8.0)  # every linear layer of the blocks
#: The training runs' adapters: partial q/k/v and gate/up packs, as vLLM fuses them.
TRAIN_LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def lora_engine(tiny_policy_dir: Path):
    """A vLLM engine with LoRA support over the tiny policy (its own start: LoRA is fixed
    when the engine starts)."""
    if not vllm_available():
        pytest.skip("vLLM is not installed (install the `cpu` or `gpu` extra)")
    engine = VLLMEngine(tiny_policy_dir, max_model_len=512, lora_rank=SETTINGS.r)
    yield engine
    engine.close()


def worst_difference(model, reqs, results) -> float:
    return max(
        float((learner_logprobs(model, q, r) - torch.tensor(r.logprobs)).abs().max())
        for q, r in zip(reqs, results, strict=True)
    )


def test_each_version_is_a_new_adapter_in_the_running_engine(
    lora_engine, tiny_policy_dir, tmp_path
):
    engine, reqs = lora_engine, requests()
    pids = engine.engine_pids()
    base = load_model(tiny_policy_dir)
    policy = apply_lora(load_model(tiny_policy_dir), SETTINGS, init_b_std=0.02)
    # Version 0 is the base model (B = 0 in training): served with no adapter at all.
    start = engine.generate(reqs, SAMPLING)
    assert {r.policy_version for r in start} == {0}
    assert_logprobs_match(base, reqs, start)

    engine.load_adapter(save_adapter(policy, SETTINGS, tmp_path / "v1"), 1)
    [first_id] = engine.adapter_ids()
    v1 = engine.generate(reqs, SAMPLING)
    assert {r.policy_version for r in v1} == {1}
    print(f"\nv1 adapter: engine vs LoRA learner {assert_logprobs_match(policy, reqs, v1):.1e}")
    assert worst_difference(base, reqs, v1) > 1e-2  # the adapter is really applied

    # A real GRPO step on the adapters moves the policy: version 2 is another adapter.
    one_step(policy, reqs, v1, version=1)
    engine.load_adapter(save_adapter(policy, SETTINGS, tmp_path / "v2"), 2)
    [second_id] = engine.adapter_ids()
    assert second_id != first_id  # the old adapter is gone from the engine
    v2 = engine.generate(reqs, SAMPLING)
    assert {r.policy_version for r in v2} == {2}
    print(f"v2 adapter: engine vs LoRA learner {assert_logprobs_match(policy, reqs, v2):.1e}")
    moved = learner_logprobs(policy, reqs[0], v1[0]) - torch.tensor(v1[0].logprobs)
    assert float(moved.abs().max()) > 1e-2  # v1's log-probs no longer hold

    # A refused adapter fails the call naming it; the live one keeps serving.
    with pytest.raises(RuntimeError, match="refused adapter version 3"):
        engine.load_adapter(tmp_path / "missing", 3)
    assert engine.adapter_ids() == [second_id]
    assert engine.policy_version == 2
    assert [r.token_ids for r in engine.generate(reqs, SAMPLING)] == [r.token_ids for r in v2]

    # Full weights are the whole policy: loading them drops the adapter.
    engine.load_weights(tiny_policy_dir / "model.safetensors", 0)
    assert engine.adapter_ids() == []
    assert_logprobs_match(base, reqs, engine.generate(reqs, SAMPLING))
    assert engine.engine_pids() == pids  # never restarted


def test_lora_rank_slots_are_vllms_sizes():
    assert [lora_rank_slot(r) for r in (1, 2, 8, 9, 64, 300)] == [1, 8, 8, 16, 64, 320]
    with pytest.raises(ValueError, match="rank 1 to 512"):
        lora_rank_slot(513)


@pytest.mark.parametrize(
    ("extra", "needs"),
    [
        ({}, "needs policy.lora"),
        ({"policy__lora": TRAIN_LORA, "rollout__engine": "hf"}, "needs rollout.engine: vllm"),
        ({"policy__lora": TRAIN_LORA, "rollout__engine": "auto"}, "needs rollout.engine: vllm"),
        (
            {
                "policy__lora": TRAIN_LORA,
                "rollout__engine": "vllm",
                "rollout__publication": "collective",
            },
            "needs rollout.publication: file",
        ),
    ],
)
def test_adapter_publication_is_refused_where_it_cannot_work(tmp_path, extra, needs):
    config = train_config_file(
        tmp_path, tmp_path, tmp_path, rollout__lora_publication="adapter", **extra
    )
    with pytest.raises(ValueError, match=f"rollout.lora_publication.*{needs}"):
        load_config(config)


def test_a_run_publishing_adapters_samples_its_own_checkpoints(
    tmp_path, tiny_prep_dir, solver_policy_dir
):
    """A two-step sync run publishing adapters: step 1 is sampled through vLLM's LoRA
    kernels with the adapter of version 1. Its behaviour log-probs must be those of the
    run's own step-1 checkpoint (the merged weights, scored by transformers) and not the
    base model's under it."""
    if not vllm_available():
        pytest.skip("vLLM is not installed (install the `cpu` or `gpu` extra)")
    config = train_config_file(
        tmp_path,
        tiny_prep_dir,
        solver_policy_dir,
        schedule="sync",
        steps=2,
        learner_order="fixed",
        lr=5e-3,
        policy__lora=TRAIN_LORA,
        rollout__engine="vllm",
        rollout__lora_publication="adapter",
    )
    run = tmp_path / "adapter"
    assert train(load_config(config), run)["status"] == "finished"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # The adapter's bytes are published each step (peft's config and A, B in float32).
    assert len(records) == 2
    assert all(0 < r["publication_bytes"] < 200_000 for r in records)
    step1 = read_batch(run / "batches" / "step-000001.jsonl")
    assert {t.policy_version for t in step1} == {1}
    trained = load_model(run / "checkpoints" / "step-000001" / "model")
    base = load_model(solver_policy_dir)

    def worst(model) -> float:
        return max(
            float((_logprobs(model, t) - torch.tensor(t.behaviour_logprobs)).abs().max())
            for t in step1
        )

    served, moved = worst(trained), worst(base)
    print(f"\nstep 1 behaviour log-probs: vs its checkpoint {served:.1e}, vs the base {moved:.1e}")
    assert served <= 1e-4
    assert moved > 1e-3


def _logprobs(model, traj) -> torch.Tensor:
    ids = list(traj.prompt_ids) + list(traj.response_ids)
    scored = [False] * len(traj.prompt_ids) + list(traj.response_scored)
    with torch.no_grad():
        logp, _ = scored_logprobs(model, torch.tensor([ids]), torch.tensor([scored]))
    return logp
