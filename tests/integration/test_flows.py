"""The flows against a real Prefect backend, real MLflow (SQLite) and real training on Ray.

One ephemeral Prefect server (its own PREFECT_HOME) and one Ray instance serve the module;
the experiment trains a random tiny policy for two steps under two schedules on the two
fixture tasks, prepared by the real prep stage, and everything is checked through the
MLflow and Prefect clients.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from flows.experiment import experiment_flow
from flows.params import EvalParams, ExperimentParams, PrepParams, TrackingParams
from flows.prep import data_prep_flow
from tasks import tracking
from tasks.jobs import SubprocessJob

pytestmark = pytest.mark.integration

FIXTURE_TASKS = Path(__file__).resolve().parent.parent / "fixtures" / "tasks"


@pytest.fixture(scope="module")
def prefect_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    from prefect.settings import (  # noqa: PLC0415
        PREFECT_HOME,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness  # noqa: PLC0415

    home = tmp_path_factory.mktemp("prefect-home")
    saved = {k: os.environ.get(k) for k in ("PREFECT_HOME", "PREFECT_SERVER_ANALYTICS_ENABLED")}
    os.environ |= {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    try:
        with (
            temporary_settings({PREFECT_HOME: home, PREFECT_SERVER_ANALYTICS_ENABLED: False}),
            prefect_test_harness(server_startup_timeout=120),
        ):
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def ray_session() -> None:
    """Ray for the training runs: the session's instance if a test started one, else one
    started here and left up for the rest of the session (train() joins it)."""
    from thundersync_core.config import TrainConfig  # noqa: PLC0415
    from thundersync_core.runtime.placement import start_ray  # noqa: PLC0415

    start_ray(TrainConfig().resources)


def _prep_config(root: Path) -> Path:
    """The fixture tasks through the real prep stage (sandbox validation off: it is slow)."""
    path = root / "prep.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "seed": 0,
                "terminal_sources": [
                    {"kind": "dir", "name": "fixture", "path": str(FIXTURE_TASKS)}
                ],
                "validation": {"enabled": False},
            }
        )
    )
    return path


def _train_config(root: Path, policy: Path, prep_dir: Path) -> Path:
    path = root / "train.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "flows-test",
                "steps": 2,
                "groups_per_step": 2,
                "group_size": 2,
                "checkpoint_every": 1,
                "policy": {"path": str(policy)},
                "warm_start": {"enabled": False},
                "rollout": {
                    "engine": "hf",
                    "max_turns": 2,
                    "max_tokens_per_turn": 16,
                    "max_total_tokens": 32,
                },
                "tasks": {"prep_dir": str(prep_dir), "dev_tasks": 0},
            }
        )
    )
    return path


def _task_states(flow_run_id: object) -> dict[str, list[str]]:
    from prefect.client.orchestration import get_client  # noqa: PLC0415
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId  # noqa: PLC0415

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    states: dict[str, list[str]] = {}
    for run in runs:
        states.setdefault(run.name.rsplit("-", 1)[0], []).append(run.state.name)
    return states


def _steps(client: object, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))  # type: ignore[attr-defined]


@pytest.mark.slow
def test_experiment_flow_end_to_end(
    prefect_backend: None, ray_session: None, tiny_policy_dir: Path, tmp_path: Path
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = ExperimentParams(
        train_config=str(_train_config(tmp_path, tiny_policy_dir, tmp_path / "unused")),
        schedules=["sync", "thundersync"],
        seeds=[0],
        out=str(tmp_path / "out"),
        launcher="inprocess",
        prep=PrepParams(config=str(_prep_config(tmp_path)), out_root=str(tmp_path / "prep")),
        # The fixture pool is too small for a dev split: evaluate on the training tasks.
        eval=EvalParams(k=1, split="train", engine="hf"),
        tracking=TrackingParams(tracking_uri=uri, study="flows-test"),
    )
    state = experiment_flow(params, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    client = tracking.connect(uri)

    experiment = client.get_experiment_by_name("flows-test")
    parent = client.get_run(result["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["stage"] == "experiment"
    assert "report.md" in {a.path for a in client.list_artifacts(parent.info.run_id)}

    children = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
    )
    by_stage: dict[str, list] = {}
    for child in children:
        by_stage.setdefault(child.data.tags["stage"], []).append(child)
    assert sorted(by_stage) == ["compare", "prep", "train"]
    train_runs = {r.info.run_name: r for r in by_stage["train"]}
    assert sorted(train_runs) == ["sync-seed0", "thundersync-seed0"]

    prep_dir = Path(by_stage["prep"][0].data.tags["prep_dir"])
    digest = hashlib.sha256((prep_dir / "manifest.json").read_bytes()).hexdigest()
    for name, run in train_runs.items():
        run_id, tags = run.info.run_id, run.data.tags
        schedule = name.split("-")[0]
        assert run.info.status == "FINISHED"
        assert tags["schedule"] == schedule
        assert (tags["objective"], tags["model"]) == ("grpo", str(tiny_policy_dir))
        assert tags["dataset_sha256"] == digest
        assert run.data.params["schedule"] == schedule
        assert run.data.params["rollout.engine"] == "hf"
        assert run.data.params["tasks.prep_dir"] == str(prep_dir)
        # Every step once, with the values the trainer wrote.
        run_dir = Path(tags["run_dir"])
        records = [
            json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        wall = {m.step: m.value for m in client.get_metric_history(run_id, "step_wall_s")}
        assert wall == {r["step"]: pytest.approx(r["step_wall_s"]) for r in records}
        for key in ("reward_mean", "learner_idle_fraction", "device_hours", "staleness_lag_0"):
            assert _steps(client, run_id, key) == [0, 1], key
        # Checkpoints after steps 1 and 2, each evaluated, by step and by device-hours.
        assert _steps(client, run_id, "eval_pass_at_1") == [1, 2]
        summary = [json.loads(line) for line in (run_dir / "eval" / "summary.jsonl").open()]
        assert _steps(client, run_id, "eval_pass_at_1_by_device_microhours") == [
            round(line["device_hours"] * 1e6) for line in summary
        ]
        datasets = {i.dataset.name: i.dataset.digest for i in run.inputs.dataset_inputs}
        assert datasets == {f"{prep_dir.name}/terminal-train": digest[:32]} | {
            f"{prep_dir.name}/{name}": digest[:32]
            for name in ("terminal-dev", "swe-train", "swe-dev")
        }
        artifacts = {a.path for a in client.list_artifacts(run_id)}
        assert {"config.yaml", "summary.json", "traces", "checkpoints.json", "eval", "prep"} <= (
            artifacts
        )
        pointers = json.loads(
            Path(client.download_artifacts(run_id, "checkpoints.json", str(tmp_path))).read_text()
        )
        assert [c["step"] for c in pointers["checkpoints"]] == [1, 2]
        assert all(Path(c["model"], "config.json").is_file() for c in pointers["checkpoints"])

    compare_run = by_stage["compare"][0].info.run_id
    files = {a.path for a in client.list_artifacts(compare_run, "comparison")}
    assert {
        "comparison/table.md",
        "comparison/score_vs_device_hours.png",
        "comparison/step_walltime.png",
    } <= files
    assert "sync-seed0" in Path(result["comparison_dir"], "table.md").read_text()

    from prefect.client.orchestration import get_client  # noqa: PLC0415
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey  # noqa: PLC0415

    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["experiment"]))
        )
    assert artifacts, "the experiment flow published no report"
    assert parent.info.run_id in artifacts[0].data


def test_prep_flow_reuses_its_result_for_the_same_config(
    prefect_backend: None, tmp_path: Path
) -> None:
    config = _prep_config(tmp_path)
    params = PrepParams(config=str(config), out_root=str(tmp_path / "prep"))
    settings = TrackingParams(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", study="prep")
    first = data_prep_flow(params, settings, return_state=True)
    second = data_prep_flow(params, settings, return_state=True)
    assert first.result()["prep_dir"] == second.result()["prep_dir"]
    assert _task_states(first.state_details.flow_run_id)["prepare_pools"] == ["Completed"]
    assert _task_states(second.state_details.flow_run_id)["prepare_pools"] == ["Cached"]
    # A cached result whose folder is gone is prepared again.
    shutil.rmtree(first.result()["prep_dir"])
    third = data_prep_flow(params, settings, return_state=True)
    assert (Path(third.result()["prep_dir"]) / "manifest.json").is_file()
    # A changed config is another key, hence another folder.
    config.write_text(config.read_text().replace("seed: 0", "seed: 1"))
    fourth = data_prep_flow(params, settings, return_state=True)
    assert fourth.result()["prep_dir"] != first.result()["prep_dir"]
    assert _task_states(fourth.state_details.flow_run_id)["prepare_pools"] == ["Completed"]


def test_a_failing_stage_fails_the_flow_with_its_cause(
    prefect_backend: None, tiny_policy_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-prep"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = ExperimentParams(
        train_config=str(_train_config(tmp_path, tiny_policy_dir, missing)),
        schedules=["sync"],
        out=str(tmp_path / "out"),
        tracking=TrackingParams(tracking_uri=uri, study="failing"),
    )
    state = experiment_flow(params, return_state=True)
    assert state.is_failed()
    assert "tasks.prep_dir" in state.message
    assert str(missing) in state.message
    client = tracking.connect(uri)
    experiment = client.get_experiment_by_name("failing")
    (parent,) = client.search_runs([experiment.experiment_id], "tags.stage = 'experiment'")
    assert parent.info.status == "FAILED"
    assert "tasks.prep_dir" in parent.data.tags["error"]


def test_a_retried_logging_task_logs_each_step_once(
    prefect_backend: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect import flow  # noqa: PLC0415
    from prefect.client.orchestration import get_client  # noqa: PLC0415

    import tasks.train  # noqa: PLC0415

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = tracking.connect(uri)
    run_id = tracking.find_or_create_run(
        client, tracking.open_experiment(client, "retry"), name="r", key_tags={"stage": "train"}
    )
    real = tracking.log_step_metrics
    calls: list[int] = []

    def flaky(*args: object, **kwargs: object) -> list[int]:
        steps = real(*args, **kwargs)  # type: ignore[arg-type]
        calls.append(len(steps))
        if len(calls) == 1:
            raise ConnectionError("connection reset after the write")
        return steps

    monkeypatch.setattr(tasks.train.tracking, "log_step_metrics", flaky)
    records = [
        {"step": s, "step_wall_s": 1.0 + s, "wall_s": 2.0 * s, "loss": 0.1} for s in range(3)
    ]

    @flow
    def log_three_steps() -> object:
        return tasks.train.log_steps(uri, run_id, records, return_state=True)

    task_state = log_three_steps()
    assert task_state.is_completed()
    with get_client(sync_client=True) as prefect:
        assert prefect.read_task_run(task_state.state_details.task_run_id).run_count == 2
    assert calls == [3, 0]  # the retry found every step logged already
    for key in ("step_wall_s", "loss"):
        assert _steps(client, run_id, key) == [0, 1, 2]


def test_subprocess_launcher_reports_the_trainers_own_message(
    tiny_policy_dir: Path, tmp_path: Path
) -> None:
    config = _train_config(tmp_path, tiny_policy_dir, tmp_path / "absent")
    job = SubprocessJob(config, tmp_path / "runs" / "sync-seed0")
    deadline = time.monotonic() + 120
    while job.poll() == "running" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job.poll() == "failed"
    assert "tasks.prep_dir" in job.failure()
    assert "exit code 2" in job.failure()


def test_the_schedules_of_a_seed_share_one_warm_start(tmp_path: Path) -> None:
    from data_prep.config import load_prep_config  # noqa: PLC0415
    from data_prep.pipeline import prepare  # noqa: PLC0415
    from tasks.train import shared_start  # noqa: PLC0415
    from thundersync_core.config import load_config  # noqa: PLC0415

    prep = tmp_path / "prep"
    prepare(load_prep_config(_prep_config(tmp_path)), prep)
    overrides = {"tasks.prep_dir": str(prep), "warm_start.steps": 1}
    config = load_config(None, overrides).model_dump(mode="json")
    out = tmp_path / "seed0"
    first = shared_start.fn(config, out)
    policy = Path(first["policy.path"])
    assert policy == out / "warmstart" / "policy"
    weights = policy / "model.safetensors"
    written = weights.stat().st_mtime_ns
    # The next schedule of the seed gets the same folder, not a second warm start.
    assert shared_start.fn(config, out) == first
    assert weights.stat().st_mtime_ns == written
    # A config that names its policy needs none.
    named = config | {"policy": config["policy"] | {"path": str(policy)}}
    assert shared_start.fn(named, out) == {}


def test_checkpoints_are_evaluated_on_the_trained_families(tmp_path: Path) -> None:
    from data_prep.config import load_prep_config  # noqa: PLC0415
    from data_prep.pipeline import prepare  # noqa: PLC0415
    from tasks.evaluate import dev_pools  # noqa: PLC0415

    prep = tmp_path / "prep"
    prepare(load_prep_config(_prep_config(tmp_path)), prep)

    def ids(families: list[str], limit: int = 0) -> list[str]:
        return [t.task_id for t in dev_pools(prep, "train", families, limit, 60.0)["terminal"]]

    assert ids(["count-lines"]) == ["count-lines"]
    assert ids([]) == ["count-lines", "write-hello"]
    assert ids([], limit=1) == ["count-lines"]
    with pytest.raises(ValueError, match=r"tasks\.families"):
        ids(["no-such-family"])


@pytest.mark.slow
def test_a_killed_trainer_is_retried_and_finishes_from_its_latest_checkpoint(
    prefect_backend: None,
    tiny_prep_dir: Path,
    solver_policy_dir: Path,
    uninterrupted_run: Path,
    tmp_path: Path,
) -> None:
    from prefect.client.orchestration import get_client  # noqa: PLC0415

    from flows.params import TrainParams  # noqa: PLC0415
    from flows.train import train_flow  # noqa: PLC0415
    from tests.helpers import checkpoint_weights, train_config_file  # noqa: PLC0415
    from thundersync_core.checkpoint import latest_checkpoint  # noqa: PLC0415

    prep = tmp_path / "prep"  # the fixture pool, with the manifest a prep run writes
    shutil.copytree(tiny_prep_dir, prep)
    (prep / "manifest.json").write_text(json.dumps({"sources": ["tests/fixtures/tasks"]}))
    settings = {"steps": 3, "checkpoint_every": 1, "learner_order": "fixed"}
    config = train_config_file(tmp_path, prep, solver_policy_dir, **settings)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = TrainParams(
        train_config=str(config),
        schedule="thundersync",
        out=str(tmp_path / "out"),
        launcher="subprocess",
        retries=1,
        retry_delay_s=0,
        poll_s=0.2,
        tracking=TrackingParams(tracking_uri=uri, study="retry"),
    )
    run_dir = tmp_path / "out" / params.run_name
    killed: list[int] = []

    def kill_after_the_second_checkpoint() -> None:
        # As a node lost mid-run: the trainer and the Ray it started, all at once.
        deadline = time.time() + 300
        while time.time() < deadline:
            found = latest_checkpoint(run_dir / "checkpoints")
            if found is not None and found.name == "step-000002":
                driver = json.loads((run_dir / "roles.json").read_text())["driver"]
                os.killpg(driver, signal.SIGKILL)
                killed.append(driver)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_after_the_second_checkpoint, daemon=True)
    killer.start()
    state = train_flow(params, return_state=True)
    killer.join(timeout=1)
    assert killed, "the trainer was not killed"
    assert state.is_completed(), state.message
    states = _task_states(state.state_details.flow_run_id)
    with get_client(sync_client=True) as prefect:
        runs = prefect.read_task_runs()
    [attempts] = [
        r
        for r in runs
        if r.flow_run_id == state.state_details.flow_run_id and r.name.startswith("run_training")
    ]
    assert attempts.run_count == 2, states
    log = (tmp_path / "out" / f"{params.run_name}.log").read_text()
    assert "checkpoints/step-000002 (step 2)" in log  # the retry resumed, not restarted
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    client = tracking.connect(uri)
    (run,) = client.search_runs(
        [client.get_experiment_by_name("retry").experiment_id], "tags.stage = 'train'"
    )
    assert run.info.status == "FINISHED"
    assert _steps(client, run.info.run_id, "step_wall_s") == [0, 1, 2]
    whole, resumed = (  # the session's uninterrupted sync run is the reference
        checkpoint_weights(uninterrupted_run, 3),
        checkpoint_weights(run_dir, 3),
    )
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
