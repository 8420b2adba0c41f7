"""``thundersync plan --config FILE [--json]``: rank device splits per schedule.

Prints the ranked table, the pruned candidates with their reasons and the winner (text), or
the whole plan as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="allocation planner: rank rollout/learner(/teacher) device splits per schedule",
        description=__doc__,
    )
    p.add_argument("--config", required=True, type=Path, help="planner YAML (PlanConfig)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    # numpy and pydantic load only when a plan is asked for.
    from thundersync_core.perfmodel.config import load_plan_config  # noqa: PLC0415
    from thundersync_core.perfmodel.planner import format_table, plan  # noqa: PLC0415

    if not args.config.is_file():
        raise FileNotFoundError(f"--config: no such file: {args.config}")
    result = plan(load_plan_config(args.config))
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0
