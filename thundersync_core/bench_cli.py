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
    p.add_argument(
        "--sweep",
        metavar="KEY=V1,V2,...",
        help="one bench per value, on the same roles (rollout.max_live_episodes=4,8,16,...)",
    )
    p.add_argument("--plot", type=Path, help="with --sweep: predicted vs measured speedup PNG")


def run(args: argparse.Namespace) -> int:
    from thundersync_core.bench import run_bench
    from thundersync_core.config import load_config

    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    overrides = {
        k: v for k, v in [("objective", args.objective), ("rollout.engine", args.engine)] if v
    }
    config = load_config(args.config, overrides)
    if args.sweep:
        return _sweep(args, config)
    if args.plot is not None:
        raise ValueError("--plot needs --sweep")
    report = run_bench(config, args.work, steps=args.steps)
    _write(args.out, report)
    idle = report["median_learner_idle_fraction"]
    tail = report["median_tail_s"]
    learners = report["learners"]
    print(f"learners: sync {learners['sync']}; thundersync {learners['thundersync']}")
    print(
        f"sync/thundersync step time: median {report['median_sync_over_thundersync']:.2f}x "
        f"over {report['steps']} steps; learner idle sync {idle['sync']:.0%}, thundersync "
        f"{idle['thundersync']:.0%}; tail sync {tail['sync']:.2f}s, thundersync "
        f"{tail['thundersync']:.2f}s ({report['median_tail_fraction_of_sync']:.1%} of sync's "
        f"post-rollout learner time); balance rho {report['balance_rho']:.2f}"
    )
    check = report["rollout_stage_sync_vs_thundersync"]
    print(
        f"speedup {_interval(report['speedup'])}; schedule-attributable (thundersync given "
        f"sync's rollout stage) {_interval(report['schedule_attributable_speedup'])}; rollout "
        f"stage sync/thundersync median {check['median_sync_over_thundersync']:.3f}, sync "
        f"longer in {check['sync_longer']} of {report['steps']} steps (sign test "
        f"p={check['sign_test_p']:.2f})"
    )
    errors = [p["error"] for p in report["perfmodel"]]
    contention = report["contention"]
    beside = (
        f" and the learner's measured {contention['learner_slowdown']:.3f}x beside the rollout"
        if contention
        else ""
    )
    print(
        f"predicted from sync's release trace{beside}: "
        + ", ".join(f"{p['predicted']:.2f}x" for p in report["perfmodel"])
        + f" (errors {', '.join(f'{e:+.1%}' for e in errors)})"
    )
    return 0


def _interval(figure: dict[str, Any]) -> str:
    """``1.62x [1.55, 1.70]``: a geometric mean and its 95% interval when there is one."""
    text = f"{figure['geometric_mean']:.2f}x"
    if figure["low"] is not None:
        text += f" [95% CI {figure['low']:.2f}, {figure['high']:.2f}]"
    return text


def _write(path: Path | None, report: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")


def parse_sweep(text: str) -> tuple[str, list[int]]:
    key, sep, values = text.partition("=")
    try:
        parsed = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        parsed = []
    if not sep or not parsed or min(parsed) < 0:
        raise ValueError(f"--sweep {text!r}: expected KEY=V1,V2,... with integers >= 0")
    return key.strip(), parsed


def _sweep(args: argparse.Namespace, config: Any) -> int:
    from thundersync_core.bench import run_sweep

    key, values = parse_sweep(args.sweep)
    report = run_sweep(config, args.work, steps=args.steps, key=key, values=values)
    _write(args.out, report)
    if args.plot is not None:
        from eval.report import plot_predicted_vs_measured

        plot_predicted_vs_measured(report["points"], args.plot, label=key.rsplit(".", 1)[-1])
    for row in report["points"]:
        print(
            f"{key}={row['value']}: balance rho {row['balance_rho']:.2f}, predicted "
            f"{row['predicted_speedup']:.2f}x, measured {row['measured_speedup']:.2f}x "
            f"({row['error']:+.1%})"
        )
    print(f"mean absolute error of the trace predictions: {report['mean_absolute_error']:.1%}")
    return 0
