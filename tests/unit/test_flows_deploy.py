"""Deployment, configuration and CLI wiring of the flows: parsed and built, nothing run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from flows.cli import add_parser, build_params
from flows.deploy import build_deployments
from flows.params import ExperimentParams
from thundersync_core.cli import main
from thundersync_core.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_nightly_deployment_has_its_cron_schedule_and_valid_parameters() -> None:
    (deployment,) = build_deployments(ROOT / "prefect.yaml")
    assert (deployment.flow_name, deployment.name) == ("experiment", "nightly-experiment")
    (schedule,) = deployment.schedules
    assert schedule.schedule.cron == "0 2 * * *"
    assert schedule.schedule.timezone == "UTC"
    assert schedule.active
    assert deployment.concurrency_limit == 1
    # The parameters are what the flow's form accepts, and name the files of this repo.
    params = ExperimentParams.model_validate(deployment.parameters["params"])
    assert params.schedules == ["sync", "thundersync", "async"]
    assert params.seeds == [0, 1]
    assert (ROOT / str(params.prep.config)).is_file()
    assert params.train_config == "configs/train_embedded.yaml"
    assert "params" in deployment._parameter_openapi_schema.properties


def test_prefect_yaml_and_the_compose_worker_agree_on_the_work_pool() -> None:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    (entry,) = spec["deployments"]
    assert (ROOT / entry["entrypoint"].split(":")[0]).is_file()
    compose = yaml.safe_load((ROOT / "infra" / "docker-compose.yml").read_text())
    assert f"--pool {entry['work_pool']['name']} " in compose["services"]["worker"]["command"]


def test_compose_builds_and_mounts_files_that_exist() -> None:
    infra = ROOT / "infra"
    compose = yaml.safe_load((infra / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        build = service.get("build")
        if build:
            assert (infra / build["context"] / build["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            # ../runs holds run outputs: git ignores it and compose creates it on first use.
            if source.startswith(".") and source != "../runs":
                assert (infra / source).exists(), f"{name}: {volume}"
    assert {"postgres", "minio", "mlflow", "prefect-server", "worker"} <= set(compose["services"])


def test_the_ray_cluster_config_is_valid_for_rays_launcher() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: PLC0415

    config = yaml.safe_load((ROOT / "infra" / "ray" / "cluster.yaml").read_text())
    validate_config(prepare_config(config))
    assert config["max_workers"] == len(config["provider"]["worker_ips"])
    for commands in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert any("--num-gpus=8" in c for c in config[commands]), commands
    assert "--gpus all" in config["docker"]["run_options"]


def test_the_embedded_experiment_config_resolves_and_validates() -> None:
    path = ROOT / "configs" / "experiment_embedded.yaml"
    params = ExperimentParams.from_yaml(path)
    assert Path(params.train_config) == ROOT / "configs" / "train_embedded.yaml"
    assert Path(str(params.prep.config)) == ROOT / "configs" / "prep_embedded.yaml"
    assert params.schedules == ["sync", "thundersync", "async", "pipeline"]
    # The training side is load_config(train_config, overrides).
    train_config = Path(params.train_config)
    config = load_config(train_config if train_config.is_file() else None, params.overrides)
    assert config.warm_start.enabled


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["experiment", *argv])


def test_the_cli_takes_a_training_config_and_puts_mlflow_in_the_output(tmp_path: Path) -> None:
    train = tmp_path / "train.yaml"
    train.write_text("name: cli\nsteps: 3\n")
    args = _parse(
        "--config", str(train), "--schedules", "sync,async", "--seeds", "0,1",
        "--steps", "2", "--out", str(tmp_path / "out"), "--no-eval",
    )  # fmt: skip
    params = build_params(args)
    assert params.train_config == str(train.resolve())
    assert (params.schedules, params.seeds, params.steps) == (["sync", "async"], [0, 1], 2)
    assert params.tracking.tracking_uri == f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}"
    assert not params.eval.enabled


def test_the_cli_refuses_an_unknown_schedule(tmp_path: Path) -> None:
    train = tmp_path / "train.yaml"
    train.write_text("name: cli\n")
    with pytest.raises(ValueError, match="schedules"):
        build_params(_parse("--config", str(train), "--schedules", "sync,fastest"))


def test_thundersync_experiment_dry_run_prints_the_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["experiment", "--config", str(ROOT / "configs/experiment_embedded.yaml"), "--dry-run",
         "--mlflow-uri", "sqlite:////tmp/x.db"]
    )  # fmt: skip
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["tracking"]["tracking_uri"] == "sqlite:////tmp/x.db"
    assert printed["train_config"] == str(ROOT / "configs" / "train_embedded.yaml")
