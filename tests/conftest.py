from __future__ import annotations

from pathlib import Path

import pytest
import torch

from thundersync_core.policy import build_model, build_tokenizer, save_policy


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
