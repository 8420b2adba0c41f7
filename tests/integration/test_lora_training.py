"""LoRA through the training stage: sync and thundersync, checkpoints, exact resume.

The learner trains only the adapters (``policy.lora``); the engines are given the merged
weights each step, so what they sample is the adapted policy. From the same start, sync
and thundersync (sums in trajectory-id order) take the same rewards and reach the same
weights; a run stopped after step 2 and resumed ends bitwise as the uninterrupted one. A
checkpoint holds the merged weights (``model/``, what evaluation loads), the adapter in
peft's format (``adapter/``) and the frozen base with the adapters by name (the master).
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from tests.helpers import checkpoint_weights, max_rel_diff, train_config_file
from thundersync_core.config import load_config
from thundersync_core.policy.io import load_model
from thundersync_core.train import train

pytestmark = pytest.mark.integration
LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _config(tmp_path, prep, policy, schedule, steps):
    return load_config(
        train_config_file(
            tmp_path,
            prep,
            policy,
            schedule=schedule,
            steps=steps,
            learner_order="fixed",
            lr=5e-3,
            policy__lora=LORA,
        )
    )


def _rewards(run) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["reward_mean"] for x in lines]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_prep_dir, solver_policy_dir):
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for schedule in ("sync", "thundersync"):
        out[schedule] = root / schedule
        config = _config(root, tiny_prep_dir, solver_policy_dir, schedule, 3)
        assert train(config, out[schedule])["status"] == "finished"
    # Stopped after step 2, resumed to 3.
    out["resumed"] = root / "resumed"
    assert (
        train(_config(root, tiny_prep_dir, solver_policy_dir, "sync", 2), out["resumed"])["status"]
        == "finished"
    )
    resumed = _config(root, tiny_prep_dir, solver_policy_dir, "sync", 3)
    assert train(resumed, out["resumed"], resume=True)["status"] == "finished"
    return out


def test_sync_and_thundersync_lora_take_the_same_rewards_and_updates(runs, solver_policy_dir):
    assert _rewards(runs["sync"]) == _rewards(runs["thundersync"])
    start = load_file(str(solver_policy_dir / "model.safetensors"))
    for step in (1, 2, 3):
        sync, stream = (checkpoint_weights(runs[s], step) for s in ("sync", "thundersync"))
        assert max_rel_diff(sync, stream) <= 1e-5
    moved = {k for k in start if not torch.equal(start[k], sync[k])}
    # Only the adapted weights moved (as merged), every other weight is the base's.
    assert moved
    assert {k.rsplit(".", 2)[-2] for k in moved} <= {"q_proj", "v_proj", "down_proj"}


def test_a_resumed_lora_run_ends_bitwise_as_the_uninterrupted_one(runs):
    last = "checkpoints/step-000003/master.safetensors"
    whole = load_file(str(runs["sync"] / last))
    resumed = load_file(str(runs["resumed"] / last))
    assert whole.keys() == resumed.keys()
    assert any(".lora_B." in k for k in whole)
    assert max_rel_diff(whole, resumed) == 0.0
    assert _rewards(runs["resumed"]) == _rewards(runs["sync"])


def test_checkpoint_holds_the_base_the_adapter_and_the_merged_weights(runs, solver_policy_dir):
    folder = runs["thundersync"] / "checkpoints" / "step-000003"
    master = load_file(str(folder / "master.safetensors"))
    start = load_file(str(solver_policy_dir / "model.safetensors"))
    bases = {k.replace(".base_layer.", "."): v for k, v in master.items() if ".lora_" not in k}
    assert all(torch.equal(bases[k], start[k]) for k in start if k in bases)  # base frozen
    assert any(float(v.abs().max()) > 0 for k, v in master.items() if ".lora_B." in k)
    config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    ids = torch.tensor([[3, 17, 42, 7, 99, 5]])
    merged = load_model(folder / "model")
    with_adapter = PeftModel.from_pretrained(load_model(solver_policy_dir), folder / "adapter")
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, with_adapter(input_ids=ids).logits
    assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max())
