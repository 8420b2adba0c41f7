from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.helpers import train_config_file
from thundersync_core.config import load_config
from thundersync_core.policy import build_model, build_tokenizer, save_policy
from thundersync_core.rollout.vllm_engine import VLLMEngine, vllm_available
from thundersync_core.train import train
from thundersync_core.warmstart import warm_start


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


FIXTURE_TASKS = Path(__file__).parent / "fixtures" / "tasks"


@pytest.fixture(scope="session")
def tiny_prep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prep folder (``terminal/{train,dev}.parquet``) over the two fixture tasks.

    Train and dev hold the same two tasks: training tests need a pool, not a held-out split.
    """
    root = tmp_path_factory.mktemp("prep")
    rows = []
    for task in ("write-hello", "count-lines"):
        shutil.copytree(FIXTURE_TASKS / task, root / "tasks" / task)
        rows.append({"task_id": task, "family": task, "path": f"tasks/{task}"})
    (root / "terminal").mkdir()
    for split in ("train", "dev"):
        pq.write_table(pa.Table.from_pylist(rows), root / "terminal" / f"{split}.parquet")
    return root


@pytest.fixture(scope="session")
def solver_policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny policy warm-started briefly on the fixture tasks: it solves them about half
    the time at temperature 1, so GRPO groups have rewards that differ (non-zero updates)."""
    directory = tmp_path_factory.mktemp("solver-policy")
    warm_start(
        [FIXTURE_TASKS / "write-hello", FIXTURE_TASKS / "count-lines"],
        directory,
        preset="tiny",
        steps=20,
        lr=3e-3,
        batch_size=4,
        log=lambda _: None,
    )
    return directory


#: The reference runs below: 3 steps, a checkpoint after each, sums in trajectory-id order
#: (``learner_order: fixed``), so sync and thundersync reach bitwise the same weights and a
#: run that was interrupted and resumed must end bitwise as these.
REFERENCE_STEPS = 3


def _reference_run(root: Path, prep: Path, policy: Path, **extra: object) -> Path:
    config = train_config_file(
        root,
        prep,
        policy,
        schedule="sync",
        steps=REFERENCE_STEPS,
        checkpoint_every=1,
        learner_order="fixed",
        **extra,
    )
    out = root / "run"
    assert train(load_config(config), out)["status"] == "finished"
    return out


@pytest.fixture(scope="session")
def uninterrupted_run(
    tmp_path_factory: pytest.TempPathFactory, tiny_prep_dir: Path, solver_policy_dir: Path
) -> Path:
    """3 uninterrupted sync steps on the transformers engine (the run folder)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    return _reference_run(root, tiny_prep_dir, solver_policy_dir)


@pytest.fixture(scope="session")
def uninterrupted_vllm_run(
    tmp_path_factory: pytest.TempPathFactory, tiny_prep_dir: Path, solver_policy_dir: Path
) -> Path:
    """3 uninterrupted sync steps on one vLLM engine, publishing files (the run folder). The
    rollout role is pinned to core 0, as the embedded config pins it, so the engine core
    runs inline in it (``rollout.engine_core: auto``)."""
    if not vllm_available():
        pytest.skip("vLLM is not installed (install the `cpu` or `gpu` extra)")
    root = tmp_path_factory.mktemp("uninterrupted-vllm")
    return _reference_run(
        root,
        tiny_prep_dir,
        solver_policy_dir,
        rollout__engine="vllm",
        resources__rollout__cores=[0],
    )
