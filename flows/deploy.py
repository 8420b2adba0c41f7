"""Serve the deployments of prefect.yaml from this process (no work pool, no worker).

    python -m flows.deploy                 serve every deployment in prefect.yaml
    python -m flows.deploy --check         build them and print name, schedule, parameters

The schedules, parameters and descriptions come from prefect.yaml, the file ``prefect
deploy --all`` reads, so the two ways of deploying cannot disagree. Serving registers the
deployments with the Prefect API (PREFECT_API_URL, e.g. the server of ``make ui``) and runs
their scheduled and UI-triggered runs in this process until it is stopped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml
from prefect import serve
from prefect.deployments.runner import RunnerDeployment
from prefect.flows import load_flow_from_entrypoint
from prefect.schedules import Cron

__all__ = ["PREFECT_YAML", "build_deployments", "main"]

PREFECT_YAML = Path(__file__).resolve().parent.parent / "prefect.yaml"


def _schedule(spec: dict[str, Any]) -> Cron:
    if set(spec) - {"cron", "timezone", "active"}:
        raise ValueError(f"prefect.yaml: schedule {spec}: only cron schedules are served here")
    return Cron(spec["cron"], timezone=spec.get("timezone"), active=spec.get("active", True))


def build_deployments(path: Path = PREFECT_YAML) -> list[RunnerDeployment]:
    """One RunnerDeployment per entry of ``deployments`` in ``path``."""
    spec = yaml.safe_load(Path(path).read_text())
    root = Path(path).resolve().parent
    deployments = []
    for entry in spec["deployments"]:
        module_path, _, name = entry["entrypoint"].partition(":")
        flow = load_flow_from_entrypoint(f"{root / module_path}:{name}")
        deployments.append(
            flow.to_deployment(
                entry["name"],
                schedules=[_schedule(s) for s in entry.get("schedules", [])],
                parameters=entry.get("parameters", {}),
                description=entry.get("description"),
                tags=entry.get("tags", []),
                concurrency_limit=entry.get("concurrency_limit"),
            )
        )
    return deployments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__)
    parser.add_argument("--file", type=Path, default=PREFECT_YAML)
    parser.add_argument("--check", action="store_true", help="build and print; do not serve")
    args = parser.parse_args(argv)
    deployments = build_deployments(args.file)
    if args.check:
        for deployment in deployments:
            summary = {
                "name": f"{deployment.flow_name}/{deployment.name}",
                "schedules": [s.schedule.model_dump(mode="json") for s in deployment.schedules],
                "parameters": deployment.parameters,
            }
            print(json.dumps(summary, indent=2))
        return 0
    serve(*deployments)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
