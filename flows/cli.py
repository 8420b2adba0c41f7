"""``thundersync experiment``: the experiment flow from the command line.

    thundersync experiment --config configs/experiment_embedded.yaml
    thundersync experiment --config configs/train_embedded.yaml --schedules sync,thundersync

``--config`` is an experiment file (it has a ``train_config`` key; see
configs/experiment_embedded.yaml) or a training config, trained under each of
``--schedules``. Prefect runs in ephemeral mode unless PREFECT_API_URL names a server;
MLflow logs to SQLite in the output folder unless --mlflow-uri says otherwise. At the end it
prints where to look.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import yaml

__all__ = ["add_parser", "build_params", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "experiment",
        help="run the experiment flow: train schedules, evaluate checkpoints, compare (Prefect)",
        description="Train each schedule with the same seeds and steps, evaluate, compare; "
        "every stage is a Prefect flow and lands in MLflow.",
    )
    p.add_argument("--config", required=True, type=Path, help="experiment or training YAML")
    p.add_argument("--schedules", help="comma-separated, e.g. sync,thundersync")
    p.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1")
    p.add_argument("--steps", type=int, help="steps of every run")
    p.add_argument("--out", type=Path, help="output folder (default: runs/experiment)")
    p.add_argument("--mlflow-uri", help="tracking URI (default: sqlite:///<out>/mlflow.db)")
    p.add_argument("--launcher", choices=["auto", "inprocess", "subprocess", "ray-job"])
    p.add_argument("--ray-address", help="Ray job server, http://HEAD:8265 (a Ray job per run)")
    p.add_argument("--no-eval", action="store_true", help="skip evaluation and comparison")
    p.add_argument("--dry-run", action="store_true", help="print the parameters and exit")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print every log line (default: a progress line per stage, the rest in "
        "<out>/experiment.log)",
    )


def build_params(args: argparse.Namespace) -> Any:
    from flows.params import ExperimentParams  # noqa: PLC0415

    if not args.config.is_file():
        raise FileNotFoundError(f"--config {args.config}: no such file")
    loaded = yaml.safe_load(args.config.read_text()) or {}
    if isinstance(loaded, dict) and "train_config" in loaded:
        params = ExperimentParams.from_yaml(args.config)
    else:
        params = ExperimentParams(train_config=str(args.config.resolve()))
    data = params.model_dump(mode="json")
    if args.schedules:
        data["schedules"] = [s.strip() for s in args.schedules.split(",") if s.strip()]
    if args.seeds:
        data["seeds"] = [int(s) for s in args.seeds.split(",") if s.strip()]
    for key in ("steps", "launcher", "ray_address"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    if args.out is not None:
        data["out"] = str(args.out)
    data["out"] = str(Path(data["out"]).resolve())
    if args.mlflow_uri:
        data["tracking"]["tracking_uri"] = args.mlflow_uri
    elif not data["tracking"]["tracking_uri"] and not os.environ.get("MLFLOW_TRACKING_URI"):
        data["tracking"]["tracking_uri"] = f"sqlite:///{Path(data['out']) / 'mlflow.db'}"
    if args.no_eval:
        data["eval"]["enabled"] = False
    return ExperimentParams.model_validate(data)


def run(args: argparse.Namespace) -> int:
    params = build_params(args)
    if args.dry_run:
        print(json.dumps(params.model_dump(mode="json"), indent=2))
        return 0
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from tasks.progress import quiet_console, restore_console  # noqa: PLC0415

    log_file = None
    try:
        if not args.verbose:
            log_file = Path(params.out) / "experiment.log"
            print(f"thundersync experiment: progress here, the full log in {log_file}", flush=True)
            quiet_console(log_file)
        from flows.experiment import experiment_flow  # noqa: PLC0415 - Prefect is slow to import

        state = experiment_flow(params, return_state=True)
    finally:
        # An error then reaches the console, not only the log file.
        restore_console()
    if not state.is_completed():
        print(f"thundersync experiment: {state.name}: {state.message}")
        return 1
    result = state.result()
    uri = result["tracking_uri"]
    print(result["report"])
    print(f"outputs:    {result['experiment_dir']}")
    print(f"MLflow:     {uri} (study {result['study']!r})")
    print(f"            mlflow server --workers 1 --backend-store-uri {uri}")
    print(f"Prefect:    flow runs in {_prefect_home()}; `make ui` serves both UIs")
    if result["comparison_dir"]:
        print(f"comparison: {Path(result['comparison_dir']) / 'table.md'}")
    if log_file is not None:
        print(f"log:        {log_file}")
    return 0


def _prefect_home() -> str:
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME  # noqa: PLC0415

    return PREFECT_API_URL.value() or str(PREFECT_HOME.value())
