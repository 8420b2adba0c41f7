"""The cluster configs load, and their learners meet the memory model as their comments say."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from thundersync_core.config import load_config
from thundersync_core.perfmodel.memory import (
    GB,
    ModelShape,
    check_config_fits,
    layout_of,
    memory_per_gpu,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "name", ["cluster_grpo", "cluster_opd", "cluster_grpo_2nodes", "cluster_qwen3_8b"]
)
def test_a_cluster_config_loads_with_its_roles_on_gpus(name):
    config = load_config(ROOT / "configs" / f"{name}.yaml")
    res = config.resources
    assert res.learner.num_gpus == res.learner.ranks > 1
    assert res.rollout.num_gpus == res.rollout.engines
    assert config.rollout.engine == "vllm"
    assert config.checkpoint_export_dtype == "bfloat16"


def _policy(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(ROOT / "configs" / "hf" / f"{name}.json", folder / "config.json")
    return folder


def test_the_two_node_layout_fits_an_8b_learner_and_refuses_a_32b_one(tmp_path):
    config = load_config(ROOT / "configs" / "cluster_grpo_2nodes.yaml")
    assert config.rollout.publication == "collective"  # engines on another node: no file
    assert config.learner_sharded_gradient
    assert config.resources.learner.gpu_memory_gb == 180
    check_config_fits(config, _policy(tmp_path, "qwen3-8b"))
    with pytest.raises(ValueError, match="gpu_memory_gb 180: the learner does not fit"):
        check_config_fits(config, _policy(tmp_path, "qwen3-32b"))


def test_the_one_node_grpo_config_does_not_fit_an_8b_learner_as_its_comment_says():
    config = load_config(ROOT / "configs" / "cluster_grpo.yaml")
    shape = ModelShape.from_hf_config(ROOT / "configs" / "hf" / "qwen3-8b.json")
    assert memory_per_gpu(shape, layout_of(config)).total_bytes > 180 * GB


def test_the_qwen3_8b_config_speaks_qwen_and_fits(tmp_path):
    config = load_config(ROOT / "configs" / "cluster_qwen3_8b.yaml")
    rollout = config.rollout
    assert (rollout.action_format, rollout.tool_call_format) == ("tool_calls", "hermes")
    assert rollout.enable_thinking is True
    assert (rollout.temperature, rollout.top_p, rollout.top_k) == (0.6, 0.95, 20)
    # Per-trajectory release with 4 open groups fits because the ranks share the groups.
    assert (config.grpo_release, config.max_open_groups) == ("trajectory", 4)
    assert config.learner_shared_groups
    policy = _policy(tmp_path, "qwen3-8b")
    check_config_fits(config, policy)
    whole = config.model_copy(update={"learner_shared_groups": False})
    with pytest.raises(ValueError, match=r"does not fit: .* group_statistics 264\.5"):
        check_config_fits(whole, policy)
