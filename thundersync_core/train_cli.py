"""``thundersync train``: the training stage from a YAML config, with overrides."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from thundersync_core.config import SCHEDULES

# 128 + SIGTERM, as a shell reports a process that SIGTERM ended.
PREEMPTED_EXIT = 143


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "train",
        help="train a policy with GRPO or OPD under one schedule (Ray roles, real rollouts)",
        description="Train under one schedule; writes metrics, traces and checkpoints to --out.",
    )
    p.add_argument("--config", type=Path, help="experiment YAML (default: built-in defaults)")
    p.add_argument("--out", required=True, type=Path, help="run folder")
    p.add_argument("--schedule", choices=SCHEDULES, help="override the config's schedule")
    p.add_argument("--objective", choices=["grpo", "opd"], help="override the objective")
    p.add_argument("--steps", type=int, help="override the number of steps")
    p.add_argument("--seed", type=int, help="override the seed")
    p.add_argument("--engine", choices=["auto", "vllm", "hf"], help="override rollout.engine")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, dotted (repeatable; VALUE is read as YAML, a path in it "
        "is relative to where the command runs): --set resources.learner.cores=[0,1]",
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items as dotted overrides, each value read as YAML."""
    import yaml

    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with a dotted KEY")
        try:
            overrides[key.strip()] = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"--set {item!r}: VALUE is not YAML ({exc})") from None
    return overrides


def run(args: argparse.Namespace) -> int:
    from thundersync_core.config import dump_config, load_config

    overrides = {
        key: value
        for key, value in [
            ("schedule", args.schedule),
            ("objective", args.objective),
            ("steps", args.steps),
            ("seed", args.seed),
            ("rollout.engine", args.engine),
        ]
        if value is not None
    }
    overrides |= parse_sets(args.set)
    config = load_config(args.config, overrides)
    if args.dry_run:
        print(dump_config(config), end="")
        return 0
    from thundersync_core.train import Preempted, TrainingError, train

    try:
        summary = train(config, args.out, resume=args.resume)
    except Preempted as exc:
        print(f"thundersync train: preempted: {exc}", flush=True)
        return PREEMPTED_EXIT
    except TrainingError as exc:
        print(f"thundersync train: stopped: {exc}")
        return 1
    print(json.dumps(summary))
    return 0
