"""The figures of a finished `make demo`, as the README quotes them, into a JSON file.

    python scripts/demo_figures.py runs/experiment/<stamp> --wall-s 1500 --commit abc1234 \
        --out docs/demo/make_demo_<date>.json

Per schedule: the schedule table's row (tasks/schedules_table.py), the mean of each named
part of the step wall, the unnamed share, and the reward of every step; then whether sync
and thundersync had the same reward at every step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.schedules_table import schedule_rows

PARTS = ("generation", "grading", "sandbox", "learner", "tail", "optimizer", "publication",
         "overhead")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("experiment", type=Path, help="runs/experiment/<stamp>")
    p.add_argument("--wall-s", type=float, required=True, help="`time make demo`, seconds")
    p.add_argument("--commit", required=True)
    p.add_argument("--command", default="git clone ... && bash .ci/run && time make demo")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    run_dirs = sorted(d for d in (args.experiment / "runs").iterdir() if d.is_dir())
    runs = [{"schedule": json.loads((d / "summary.json").read_text())["schedule"],
             "run_dir": str(d)} for d in run_dirs]  # fmt: skip
    schedules = {}
    for row in schedule_rows(runs):
        records = [
            json.loads(line)
            for run in runs
            if run["schedule"] == row["schedule"]
            for line in (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        ]
        schedules[row["schedule"]] = row | {
            "mean_wall_parts_s": {
                part: statistics.fmean(r[f"wall_{part}_s"] for r in records) for part in PARTS
            },
            "max_overhead_fraction": max(r["wall_overhead_fraction"] for r in records),
            "reward_mean_per_step": [r["reward_mean"] for r in records],
        }
    rewards = {name: s["reward_mean_per_step"] for name, s in schedules.items()}
    figures = {
        "command": args.command,
        "commit": args.commit,
        "make_demo_wall_s": args.wall_s,
        "schedules": schedules,
        "rewards_identical_sync_thundersync": rewards.get("sync") == rewards.get("thundersync"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=1) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
