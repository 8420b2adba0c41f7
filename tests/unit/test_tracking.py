"""MLflow helpers on a real SQLite store: one point per step, runs found again, no drift."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks import tracking
from tasks.common import retry_is_useful
from tasks.jobs import RayJob
from tasks.train import log_steps, read_new_records


def _record(step: int, **extra: object) -> dict:
    """A record shaped like the trainer's metrics.jsonl lines."""
    return {
        "step": step,
        "schedule": "sync",
        "objective": "grpo",
        "step_wall_s": 1.5 + step,
        "learner_idle_fraction": 0.5,
        "reward_mean": 0.25 * step,
        "loss": -0.01,
        "staleness_tokens": {"0": 96, "1": 32},
        "is_weight_mean": None,
        "wall_s": 2.0 * (step + 1),
        "device_hours": 0.001 * (step + 1),
        **extra,
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite tracking store for the module (its schema migration takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def run_id(store: str, request: pytest.FixtureRequest) -> str:
    client = tracking.connect(store)
    experiment = tracking.open_experiment(client, "unit")
    return tracking.find_or_create_run(
        client, experiment, name=request.node.name, key_tags={"test": request.node.name}
    )


def _steps(store: str, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in tracking.connect(store).get_metric_history(run_id, key))


def test_logging_the_same_steps_twice_keeps_one_point_per_step(store: str, run_id: str) -> None:
    client = tracking.connect(store)
    first = tracking.log_step_metrics(client, run_id, [_record(0), _record(1)])
    # The retry sees steps 0 and 1 again, plus a step that landed meanwhile.
    second = tracking.log_step_metrics(client, run_id, [_record(0), _record(1), _record(2)])
    assert (first, second) == ([0, 1], [2])
    for key in ("step_wall_s", "reward_mean", "staleness_lag_0", "staleness_lag_1"):
        assert _steps(store, run_id, key) == [0, 1, 2], key
    history = {m.step: m.value for m in client.get_metric_history(run_id, "step_wall_s")}
    assert history == {0: 1.5, 1: 2.5, 2: 3.5}
    assert {m.value for m in client.get_metric_history(run_id, "staleness_lag_1")} == {32.0}
    # Strings, None and the step itself are not metrics.
    logged = client.get_run(run_id).data.metrics
    assert not {"schedule", "objective", "is_weight_mean", "step", "staleness_tokens"} & set(logged)


def test_the_logging_task_body_run_twice_does_not_duplicate(store: str, run_id: str) -> None:
    records = [_record(0), _record(1)]
    assert log_steps.fn(store, run_id, records) == [0, 1]
    assert log_steps.fn(store, run_id, records) == []
    assert _steps(store, run_id, "loss") == [0, 1]


def test_eval_scores_by_checkpoint_step_and_by_device_hours(store: str, run_id: str) -> None:
    lines = [
        {
            "step": step,
            "device_hours": dh,
            "k": 2,
            "pass@1": p1,
            "pass@2": p1 + 0.1,
            "pools": {"terminal": {"pass@1": p1, "pass@2": p1 + 0.1, "n_tasks": 2}},
        }
        for step, dh, p1 in [(2, 0.0021, 0.25), (4, 0.0043, 0.5)]
    ]
    client = tracking.connect(store)
    assert tracking.log_eval_summary(client, run_id, lines) == [2, 4]
    assert tracking.log_eval_summary(client, run_id, lines) == []
    assert _steps(store, run_id, "eval_pass_at_1") == [2, 4]
    assert _steps(store, run_id, "eval_terminal_pass_at_2") == [2, 4]
    by_dh = client.get_metric_history(run_id, "eval_pass_at_1_by_device_microhours")
    assert sorted((m.step, m.value) for m in by_dh) == [(2100, 0.25), (4300, 0.5)]


def test_runs_are_found_by_their_key_tags_before_one_is_created(store: str) -> None:
    client = tracking.connect(store)
    experiment = tracking.open_experiment(client, "lookup")
    assert tracking.open_experiment(client, "lookup") == experiment
    parent = tracking.find_or_create_run(client, experiment, name="p", key_tags={"stage": "x"})
    key = {"stage": "train", "run_dir": "/runs/sync-seed0"}
    child = tracking.find_or_create_run(
        client, experiment, name="sync-seed0", key_tags=key, parent_run_id=parent
    )
    again = tracking.find_or_create_run(
        client, experiment, name="sync-seed0", key_tags=key, parent_run_id=parent
    )
    assert again == child != parent
    assert client.get_run(child).data.tags["mlflow.parentRunId"] == parent
    # The same key under another parent is another run.
    other = tracking.find_or_create_run(
        client, experiment, name="sync-seed0", key_tags=key, parent_run_id=again
    )
    assert other not in (child, parent)


def test_params_are_written_once_and_a_changed_value_is_refused(store: str, run_id: str) -> None:
    client = tracking.connect(store)
    config = {"schedule": "sync", "rollout": {"engine": "hf", "max_turns": 2}, "families": ["a"]}
    tracking.log_params(client, run_id, config)
    tracking.log_params(client, run_id, config)
    params = client.get_run(run_id).data.params
    assert params["rollout.engine"] == "hf"
    assert params["rollout.max_turns"] == "2"
    assert json.loads(params["families"]) == ["a"]
    with pytest.raises(ValueError, match=r"rollout\.max_turns"):
        tracking.log_params(client, run_id, config | {"rollout": {"engine": "hf", "max_turns": 3}})


def _prep_folder(root: Path) -> Path:
    rows = [{"task_id": "t1", "family": "f", "path": "tasks/t1"}]
    (root / "terminal").mkdir(parents=True)
    for split in ("train", "dev"):
        pq.write_table(pa.Table.from_pylist(rows), root / "terminal" / f"{split}.parquet")
    (root / "manifest.json").write_text(json.dumps({"splits": {"terminal": {"train": 1}}}))
    return root


def test_prep_datasets_carry_the_manifest_hash_and_are_logged_once(
    store: str, run_id: str, tmp_path: Path
) -> None:
    prep = _prep_folder(tmp_path / "pools")
    client = tracking.connect(store)
    names = tracking.log_prep_datasets(client, run_id, prep)
    tracking.log_prep_datasets(client, run_id, prep)
    assert names == ["pools/terminal-train", "pools/terminal-dev"]
    inputs = client.get_run(run_id).inputs.dataset_inputs
    expected = hashlib.sha256((prep / "manifest.json").read_bytes()).hexdigest()[:32]
    assert sorted(i.dataset.name for i in inputs) == sorted(names)
    assert {i.dataset.digest for i in inputs} == {expected}
    contexts = {i.dataset.name: {t.key: t.value for t in i.tags} for i in inputs}
    assert contexts["pools/terminal-dev"]["mlflow.data.context"] == "dev"


def test_a_folder_without_manifest_is_refused_naming_the_config_field(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tasks\.prep_dir"):
        tracking.dataset_digest(tmp_path)


def test_run_folder_artifacts_point_at_checkpoints(store: str, run_id: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "sync-seed0"
    state = run_dir / "checkpoints" / "step-000002" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"step": 2, "extra": {"device_hours": 0.002}}))
    (run_dir / "config.yaml").write_text("schedule: sync\n")
    (run_dir / "traces").mkdir()
    (run_dir / "traces" / "step-000000.json").write_text("{}\n")
    client = tracking.connect(store)
    tracking.log_run_folder(client, run_id, run_dir)
    tracking.log_run_folder(client, run_id, run_dir)
    paths = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "traces", "checkpoints.json"} <= paths
    local = Path(client.download_artifacts(run_id, "checkpoints.json", str(tmp_path)))
    pointers = json.loads(local.read_text())
    assert pointers["checkpoints"] == [
        {
            "step": 2,
            "path": str(state.parent.resolve()),
            "model": str(state.parent.resolve() / "model"),
            "device_hours": 0.002,
        }
    ]


def test_metrics_tail_reads_only_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert read_new_records(path, 0) == ([], 0)
    path.write_text(json.dumps(_record(0)) + "\n" + '{"step": 1, "step_w')
    records, offset = read_new_records(path, 0)
    assert [r["step"] for r in records] == [0]
    with path.open("a") as handle:
        handle.write('all_s": 2.0}\n')
    records, offset = read_new_records(path, offset)
    assert records == [{"step": 1, "step_wall_s": 2.0}]
    assert read_new_records(path, offset) == ([], offset)


def test_only_errors_a_retry_can_fix_are_retried() -> None:
    def state(exc: BaseException) -> SimpleNamespace:
        return SimpleNamespace(data=exc)

    assert retry_is_useful(None, None, state(ConnectionError("reset by peer")))
    assert retry_is_useful(None, None, state(OSError("database is locked")))
    assert not retry_is_useful(None, None, state(FileNotFoundError("tasks.prep_dir")))
    assert not retry_is_useful(None, None, state(ValueError("params differ")))


class _FakeJobServer:
    """Stands in for JobSubmissionClient: records the submission, replays statuses."""

    def __init__(self, statuses: list[str]) -> None:
        self.statuses = statuses
        self.submitted: dict = {}

    def submit_job(self, **kwargs: object) -> str:
        self.submitted = kwargs
        return str(kwargs["submission_id"])

    def get_job_status(self, job_id: str) -> str:
        return self.statuses.pop(0)

    def get_job_info(self, job_id: str) -> SimpleNamespace:
        return SimpleNamespace(message="Job entrypoint command failed with exit code 2")

    def get_job_logs(self, job_id: str) -> str:
        return "loading\nthundersync train: error: tasks.prep_dir: /x is missing\n"


def test_ray_job_submits_the_train_command_and_reports_its_cause(tmp_path: Path) -> None:
    server = _FakeJobServer(["PENDING", "RUNNING", "FAILED"])
    job = RayJob(
        tmp_path / "c.yaml", tmp_path / "run", address="http://h:8265", submission_id="x-1",
        client=server,
    )  # fmt: skip
    assert server.submitted["entrypoint"] == (
        f"thundersync train --config {tmp_path / 'c.yaml'} --out {tmp_path / 'run'}"
    )
    assert [job.poll(), job.poll(), job.poll()] == ["running", "running", "failed"]
    assert "tasks.prep_dir: /x is missing" in job.failure()
