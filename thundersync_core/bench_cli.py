"""``thundersync bench``: sync vs thundersync step time on the same workload and cores."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="run sync and thundersync alternately on one workload; print step-time ratio",
        description="Alternate sync and thundersync steps on the same batches and cores.",
    )
    p.add_argument("--config", type=Path, help="experiment YAML (the training config)")
    p.add_argument("--steps", default=4, type=int, help="measured steps per schedule")
    p.add_argument("--objective", choices=["grpo", "opd"], help="override the objective")
    p.add_argument("--engine", choices=["auto", "vllm", "hf"], help="override rollout.engine")
    p.add_argument("--work", type=Path, default=Path("runs/bench"), help="scratch folder")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")


def run(args: argparse.Namespace) -> int:
    from thundersync_core.bench import run_bench
    from thundersync_core.config import load_config

    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    overrides = {
        k: v for k, v in [("objective", args.objective), ("rollout.engine", args.engine)] if v
    }
    config = load_config(args.config, overrides)
    report = run_bench(config, args.work, steps=args.steps)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    idle = report["median_learner_idle_fraction"]
    tail = report["median_tail_s"]
    print(
        f"sync/thundersync step time: median {report['median_sync_over_thundersync']:.2f}x "
        f"over {report['steps']} steps; learner idle sync {idle['sync']:.0%}, thundersync "
        f"{idle['thundersync']:.0%}; tail sync {tail['sync']:.2f}s, thundersync "
        f"{tail['thundersync']:.2f}s ({report['median_tail_fraction_of_sync']:.1%} of sync's "
        f"post-rollout learner time); balance rho {report['balance_rho']:.2f}"
    )
    return 0
