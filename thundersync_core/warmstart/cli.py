"""``thundersync warm-start``: fine-tune a policy on reference solutions, print a summary."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "warm-start",
        help="supervised warm start on reference solutions, in the bash agent's format",
        description=(
            "Run each task's reference solution in the local sandbox, keep those the grader "
            "passes, fine-tune the policy on them as agent episodes and save it to --out."
        ),
    )
    p.add_argument(
        "--tasks",
        required=True,
        type=Path,
        action="append",
        help="task folder, folder of task folders, or prep terminal/*.parquet (repeatable)",
    )
    p.add_argument("--out", required=True, type=Path, help="policy folder to write (HF format)")
    p.add_argument(
        "--steps", default=140, type=int, help="optimizer steps (140: student, 400: OPD teacher)"
    )
    p.add_argument("--lr", default=3e-3, type=float)
    p.add_argument("--batch-size", default=16, type=int)
    p.add_argument("--preset", default="tiny", help="model preset of a fresh policy")
    p.add_argument("--init-from", type=Path, help="start from this policy folder instead")
    p.add_argument(
        "--tokenizer-from",
        type=Path,
        help="take the tokenizer of this policy folder (a teacher must share its student's)",
    )
    p.add_argument("--seed", default=0, type=int)
    p.add_argument("--families", default="", help="comma-separated task families to keep")
    p.add_argument("--limit", default=0, type=int, help="use only the first N tasks (0: all)")
    p.add_argument(
        "--max-action-tokens",
        default=64,
        type=int,
        help="drop tasks whose solution turn is longer (the rollout's tokens per turn)",
    )
    p.add_argument("--threads", default=2, type=int, help="torch CPU threads")
    p.add_argument(
        "--compute-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="matrix products of the fine-tuning (bfloat16: autocast, float32 weights)",
    )


def run(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415 (keeps `thundersync --help` instant)

    from thundersync_core.runtime.child import die_with_parent  # noqa: PLC0415
    from thundersync_core.warmstart.sft import warm_start  # noqa: PLC0415

    die_with_parent()
    for source in args.tasks:
        if not source.exists():
            raise FileNotFoundError(f"--tasks {source}: no such file or folder")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    families = [f.strip() for f in args.families.split(",") if f.strip()] or None
    summary = warm_start(
        args.tasks,
        args.out,
        preset=args.preset,
        init_from=args.init_from,
        tokenizer_from=args.tokenizer_from,
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
        compute_dtype=args.compute_dtype,
        families=families,
        limit=args.limit,
        max_action_tokens=args.max_action_tokens,
    )
    print(json.dumps(summary))
    return 0
