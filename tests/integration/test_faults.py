"""Faults injected into real training runs, and what the run does about each.

Every run trains 3 steps with a checkpoint after each, summing in trajectory-id order
(``learner_order: fixed``), so sync and thundersync reach bitwise the same weights and a run
that recovered must end bitwise as the uninterrupted one. Each fault is a real one: a role's
process (or vLLM's engine core) is sent SIGKILL while step 1 is in flight; a verifier's
task.toml is broken on disk while the run grades.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import checkpoint_weights, train_config_file
from thundersync_core.checkpoint import latest_checkpoint
from thundersync_core.config import load_config
from thundersync_core.rollout.vllm_engine import vllm_available
from thundersync_core.train import TrainingError, train

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 3
SETTINGS = {"steps": STEPS, "checkpoint_every": 1, "learner_order": "fixed"}


def _config(tmp: Path, prep: Path, policy: Path, schedule: str, **extra: object) -> Path:
    return train_config_file(tmp, prep, policy, schedule=schedule, **SETTINGS, **extra)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run: Path, solver_policy_dir: Path) -> dict[str, torch.Tensor]:
    """The weights after 3 uninterrupted sync steps (the session's reference run, with the
    settings above); thundersync is shown bitwise equal below."""
    weights = checkpoint_weights(uninterrupted_run, STEPS)
    start = load_file(str(solver_policy_dir / "model.safetensors"))
    assert not _equal(weights, start), "training must move the weights"
    return weights


def _when_step_in_flight(out: Path, act: Callable[[], None]) -> threading.Thread:
    """Run ``act`` shortly after the run's checkpoint of step 1 is complete: step 1 (the
    second) is then rolling out."""

    def watch() -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            found = latest_checkpoint(out / "checkpoints")
            if found is not None and found.name == "step-000001":
                time.sleep(0.3)
                act()
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _kill(out: Path, role: str) -> Callable[[], None]:
    def kill() -> None:
        pids = json.loads((out / "roles.json").read_text())
        pid = pids["engine"][0] if role == "engine" else pids[role]
        os.kill(pid, signal.SIGKILL)

    return kill


def _steps(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


# Each role once: sync's rollout worker and thundersync's learner, which dies holding a
# half-streamed batch (a killed vLLM engine core under thundersync: below).
@pytest.mark.parametrize(("schedule", "role"), [("sync", "rollout"), ("thundersync", "learner")])
def test_a_killed_role_is_restarted_and_the_run_ends_as_uninterrupted(
    tmp_path, tiny_prep_dir, solver_policy_dir, uninterrupted, schedule, role
):
    out = tmp_path / "run"
    config = load_config(_config(tmp_path, tiny_prep_dir, solver_policy_dir, schedule))
    killer = _when_step_in_flight(out, _kill(out, role))
    summary = train(config, out)
    killer.join(timeout=1)
    assert summary["status"] == "finished"
    [recovery] = summary["recoveries"]
    assert f"the {role} role's process died" in recovery["fault"]
    # Step 1 was in flight: it is replayed from its checkpoint; no completed step is lost.
    assert (recovery["step"], recovery["resumed_from_step"]) == (1, 1)
    assert recovery["completed_steps_redone"] == 0
    assert _steps(out) == [0, 1, 2]
    assert _equal(checkpoint_weights(out, STEPS), uninterrupted)
    assert json.loads((out / "roles.json").read_text())["restarts"] == 1


def test_past_max_role_restarts_the_run_stops_naming_the_fault_and_resumes_exactly(
    tmp_path, tiny_prep_dir, solver_policy_dir, uninterrupted
):
    out = tmp_path / "run"
    path = _config(tmp_path, tiny_prep_dir, solver_policy_dir, "thundersync", max_role_restarts=0)
    killer = _when_step_in_flight(out, _kill(out, "learner"))
    with pytest.raises(TrainingError, match=r"step 1: the learner role's process died"):
        train(load_config(path), out)
    killer.join(timeout=1)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["retryable"] is True
    assert "max_role_restarts (0) used, latest checkpoint" in summary["error"]
    assert train(load_config(path), out, resume=True)["status"] == "finished"
    assert _steps(out) == [0, 1, 2]
    assert _equal(checkpoint_weights(out, STEPS), uninterrupted)


def test_a_grader_that_raises_stops_the_run_naming_it_and_resume_ends_as_uninterrupted(
    tmp_path, tiny_prep_dir, solver_policy_dir, uninterrupted
):
    prep = tmp_path / "prep"
    shutil.copytree(tiny_prep_dir, prep)
    tomls = sorted(prep.rglob("task.toml"))
    assert tomls, "the fixture tasks carry task.toml"
    saved = {p: p.read_text() for p in tomls}

    def break_verifiers() -> None:
        for path in tomls:
            path.write_text("[verifier]\ntimeout_sec = -1\n")

    out = tmp_path / "run"
    config = load_config(_config(tmp_path, prep, solver_policy_dir, "thundersync"))
    breaker = _when_step_in_flight(out, break_verifiers)
    with pytest.raises(TrainingError, match=r"grading trajectory s0000[12]-g\d-\S+ of task"):
        train(config, out)
    breaker.join(timeout=1)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["retryable"] is False  # the same verifier fails the same way again
    assert "timeout_sec must be a positive number" in summary["error"]
    for path, text in saved.items():
        path.write_text(text)
    assert train(config, out, resume=True)["status"] == "finished"
    assert _steps(out) == [0, 1, 2]
    assert _equal(checkpoint_weights(out, STEPS), uninterrupted)


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_a_killed_vllm_engine_core_is_restarted_and_the_run_ends_as_uninterrupted(
    tmp_path, tiny_prep_dir, solver_policy_dir, uninterrupted_vllm_run
):
    """The engine core in a process of its own (``rollout.engine_core: child``) is killed
    mid-step: the watchdog names it, the step is replayed, and the run ends with the weights
    of the uninterrupted run, whose engine core ran inline in its one-core rollout role: the
    two placements sample the same tokens."""
    whole = uninterrupted_vllm_run  # sync, 3 steps on one vLLM engine
    assert json.loads((whole / "roles.json").read_text())["engine"] == [], "inline: no child"
    out = tmp_path / "faulted"
    path = _config(
        tmp_path,
        tiny_prep_dir,
        solver_policy_dir,
        "thundersync",
        rollout__engine="vllm",
        rollout__engine_core="child",
    )
    killer = _when_step_in_flight(out, _kill(out, "engine"))
    summary = train(load_config(path), out)
    killer.join(timeout=1)
    assert summary["status"] == "finished"
    [recovery] = summary["recoveries"]
    assert "rollout engine failed: the vLLM engine core process died" in recovery["fault"]
    assert recovery["resumed_from_step"] == 1
    assert _steps(out) == [0, 1, 2]
    assert _equal(checkpoint_weights(out, STEPS), checkpoint_weights(whole, STEPS))
    # The new engine core is found, and it is gone with its run.
    [engine_pid] = json.loads((out / "roles.json").read_text())["engine"]
    t0 = time.time()
    while psutil.pid_exists(engine_pid) and psutil.Process(engine_pid).status() != "zombie":
        assert time.time() - t0 < 20, f"engine core {engine_pid} outlived its run"
        time.sleep(0.1)
