from __future__ import annotations

from pathlib import Path

import pytest
import torch

from thundersync_core.policy import build_model, build_tokenizer, save_policy
from thundersync_core.rollout.vllm_engine import VLLMEngine, vllm_available


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random micro policy saved in Hugging Face format, shared by the session."""
    directory = tmp_path_factory.mktemp("micro-policy")
    model = build_model("micro", seed=7)
    save_policy(model, build_tokenizer(vocab_size=model.config.vocab_size), directory)
    return directory


@pytest.fixture(scope="session")
def micro64() -> torch.nn.Module:
    return build_model("micro", seed=3, dtype=torch.float64)


@pytest.fixture(scope="session")
def micro32() -> torch.nn.Module:
    return build_model("micro", seed=3, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny policy (random weights) in Hugging Face format."""
    directory = tmp_path_factory.mktemp("tiny-policy")
    model = build_model("tiny", seed=0)
    save_policy(model, build_tokenizer(vocab_size=model.config.vocab_size), directory)
    return directory


@pytest.fixture(scope="session")
def vllm_engine(tiny_policy_dir: Path):
    """One vLLM engine per test session (start-up takes 15-35 s on two cores)."""
    if not vllm_available():
        pytest.skip("vLLM is not installed (install the `cpu` or `gpu` extra)")
    engine = VLLMEngine(tiny_policy_dir, max_model_len=2048)
    yield engine
    engine.close()
