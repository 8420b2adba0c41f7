"""``thundersync perfmodel``: analytic model, trace predictor and run simulator.

    thundersync perfmodel analytic --rho R [--waves W] [--suffix S] [--release-lag D]
                                   [--sources N] [--rollout-s SEC]
    thundersync perfmodel trace --trace FILE [FILE ...]
    thundersync perfmodel simulate [--config FILE | --preset talk-stragglers] [--steps N]

Each prints JSON. Handlers import their module when run so ``thundersync --help`` stays light.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PRESETS = ("talk-stragglers",)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "perfmodel",
        help="predict schedule step times: analytic model, release traces, simulation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inner = p.add_subparsers(dest="perfmodel_command", required=True)
    _add_analytic(inner)
    _add_trace(inner)
    _add_simulate(inner)


def _add_analytic(inner: Any) -> None:
    p = inner.add_parser("analytic", help="closed-form sync vs overlapped step times")
    p.add_argument("--rho", required=True, type=float, help="learner work / rollout time")
    p.add_argument("--waves", default=1, type=int, help="back-to-back rollout waves W")
    p.add_argument("--suffix", default=0.0, type=float, help="suffix S in units of R")
    p.add_argument(
        "--release-lag", default=0.0, type=float, help="lag D behind uniform release, per wave"
    )
    p.add_argument("--sources", default=None, type=int, help="finite batch of N sources")
    p.add_argument("--rollout-s", default=None, type=float, help="R in seconds: adds seconds")


def _add_trace(inner: Any) -> None:
    p = inner.add_parser("trace", help="predict steps from recorded release traces")
    p.add_argument(
        "--trace",
        required=True,
        nargs="+",
        type=Path,
        help="trace JSON file(s), or bench / sweep reports (their sync release traces)",
    )


def _add_simulate(inner: Any) -> None:
    p = inner.add_parser("simulate", help="discrete-event simulation of all four schedules")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--config", type=Path, help="SimConfig YAML file")
    source.add_argument("--preset", choices=PRESETS, default="talk-stragglers")
    p.add_argument("--steps", type=int, default=None, help="override the number of updates")
    p.add_argument("--seed", type=int, default=None, help="override the RNG seed")
    p.add_argument("--max-staleness", type=int, default=None, help="override (pipeline)")


def run(args: argparse.Namespace) -> int:
    handler = {"analytic": _run_analytic, "trace": _run_trace, "simulate": _run_simulate}
    print(json.dumps(handler[args.perfmodel_command](args), indent=2))
    return 0


def _run_analytic(args: argparse.Namespace) -> dict[str, Any]:
    from thundersync_core.perfmodel.analytic import predict_json  # noqa: PLC0415

    if args.sources is not None and args.sources < 1:
        raise ValueError(f"--sources must be >= 1, got {args.sources}")
    return predict_json(
        args.rho,
        waves=args.waves,
        suffix_r=args.suffix,
        release_lag=args.release_lag,
        n_sources=args.sources,
        rollout_s=args.rollout_s,
    )


def _run_trace(args: argparse.Namespace) -> dict[str, Any]:
    from thundersync_core.perfmodel.trace import predict_files  # noqa: PLC0415

    return predict_files(list(args.trace))


def _run_simulate(args: argparse.Namespace) -> dict[str, Any]:
    # numpy and pydantic load only when a simulation is asked for.
    from thundersync_core.perfmodel.config import load_sim_config  # noqa: PLC0415
    from thundersync_core.perfmodel.simulate import (  # noqa: PLC0415
        simulate,
        talk_straggler_config,
    )

    config = load_sim_config(args.config) if args.config else talk_straggler_config()
    overrides = {
        "steps": args.steps,
        "seed": args.seed,
        "max_staleness": args.max_staleness,
    }
    updates = {k: v for k, v in overrides.items() if v is not None}
    if updates:
        config = type(config).model_validate({**config.model_dump(), **updates})
    result = simulate(config)
    result["source"] = str(args.config) if args.config else f"preset:{args.preset}"
    return result
