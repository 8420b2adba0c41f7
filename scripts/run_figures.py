"""The step figures of finished `thundersync train` runs, side by side, into a JSON file.

    python scripts/run_figures.py --baseline sync --commit abc1234 --command "..." \
        --out docs/bench/F.json sync=runs/a sync-both-cores=runs/b thundersync=runs/c

Per run (LABEL=RUN_DIR): its schedule and role cores (from the run's config.yaml), every
step's wall, rollout stage, learner busy time, tail and reward, the median step wall and
tail, and the median step's ratio to the baseline's (baseline median / run median: above 1
is faster); then which runs had the baseline's reward at every step. The medians, ratios
and reward pairing are the schedule table's (tasks/schedules_table.py), a row per label.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.schedules_table import schedule_rows

FIELDS = ("step_wall_s", "rollout_stage_s", "learner_busy_s", "learner_tail_s", "reward_mean")


def run_figures(run_dir: Path) -> dict:
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    if not records:
        raise ValueError(f"{run_dir}: metrics.jsonl has no step")
    return {
        "run_dir": str(run_dir),
        "schedule": config["schedule"],
        "cores": {
            role: spec.get("cores")
            for role, spec in config["resources"].items()
            if isinstance(spec, dict)
        },
        "steps": {field: [r[field] for r in records] for field in FIELDS},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR")
    p.add_argument("--baseline", required=True, help="the LABEL the ratios are taken against")
    p.add_argument("--commit", required=True)
    p.add_argument("--command", required=True, help="how the runs were made")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    runs = {}
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            p.error(f"{item!r}: expected LABEL=RUN_DIR")
        runs[label] = run_figures(Path(path))
    if args.baseline not in runs:
        p.error(f"--baseline {args.baseline!r}: not among {sorted(runs)}")
    table = [{"schedule": label, "run_dir": f["run_dir"]} for label, f in runs.items()]
    for row in schedule_rows(table, baseline=args.baseline):
        figures = runs[row["schedule"]]
        figures["median"] = {
            "step_wall_s": row["median_step_wall_s"],
            "learner_tail_s": row["median_tail_s"],
        }
        figures["speedup_vs_baseline"] = row["speedup"]
        figures["baseline_reward_every_step"] = row["same_rewards_steps"] == row["steps"]
    record = {"command": args.command, "commit": args.commit, "baseline": args.baseline}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record | {"runs": runs}, indent=1) + "\n")
    for label, figures in runs.items():
        print(
            f"{label}: median step {figures['median']['step_wall_s']:.1f} s, "
            f"{figures['speedup_vs_baseline']:.2f}x vs {args.baseline}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
