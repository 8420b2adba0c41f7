"""``thundersync prep --config FILE --out DIR``: build the training pools."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "prep",
        help="prepare validated, benchmark-separated train/dev task pools",
        description="Load, filter, validate and split task pools; see data_prep/config.py.",
    )
    p.add_argument("--config", required=True, type=Path, help="prep YAML")
    p.add_argument("--out", required=True, type=Path, help="new or empty output folder")


def run(args: argparse.Namespace) -> int:
    from data_prep.config import load_prep_config  # noqa: PLC0415 - keeps --help instant
    from data_prep.pipeline import prepare  # noqa: PLC0415

    manifest = prepare(load_prep_config(args.config), args.out)
    print(json.dumps({"out": str(args.out), "splits": manifest["splits"]}))
    return 0
