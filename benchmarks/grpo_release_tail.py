"""Learner work left after the last reward: streaming GRPO vs sync, same batch, same arrivals.

Rewards arrive over a rollout window with a long tail (log-normal release times). The sync
learner starts its batch forward/backward after the last reward (in micro-batches, as a
memory-bounded trainer would); the streaming learner backpropagates each trajectory as its
reward lands and closes groups as they complete, so after the last reward only that
trajectory and its group close remain. ``stream-group`` is the streaming learner releasing
per closed group (``grpo_release: group``): each trajectory waits for its group's last
reward and runs with its final advantage, so no group holds statistics (less memory) and
no backward of a group starts before its last reward (less overlap). Each schedule runs in
its own process so that its peak resident memory is its own.

    python benchmarks/grpo_release_tail.py [--groups 8 --group-size 8 ...]

Prints one JSON line per schedule and a summary line with the tail ratio and the two
gradients' relative difference (the benchmark checks exactness too).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import feed_on_schedule, peak_rss_bytes, rss_bytes, run_worker

from thundersync_core.batch import Segment, Trajectory
from thundersync_core.policy import build_model
from thundersync_core.replay import relative_difference
from thundersync_core.streaming import StreamingGRPOLearner, SyncGRPOLearner, groups_of

SCHEDULES = ("sync", "stream", "stream-group")
SHAPE_FLAGS = ("preset", "groups", "group_size", "prompt_tokens", "response_tokens", "segments")


def make_batch(args: argparse.Namespace, vocab: int) -> list[Trajectory]:
    rng = random.Random(args.seed)
    batch = []
    per_segment = max(1, args.response_tokens // (2 * args.segments - 1))
    for g in range(args.groups):
        prompt = tuple(rng.randrange(vocab) for _ in range(args.prompt_tokens))
        for i in range(args.group_size):
            segments: list[Segment] = []
            for k in range(args.segments):
                if k:
                    segments.append(Segment.observation([rng.randrange(vocab)] * per_segment))
                n = rng.randint(per_segment // 2, per_segment * 3 // 2)
                segments.append(Segment.action([rng.randrange(vocab) for _ in range(n)]))
            batch.append(Trajectory(f"g{g}", f"g{g}-{i}", prompt, tuple(segments), rng.random()))
    return batch


def release_times(n: int, window_s: float, seed: int) -> list[float]:
    """Long-tailed completion times scaled so the slowest lands at window_s."""
    rng = random.Random(seed + 1)
    raw = sorted(rng.lognormvariate(0.0, 0.6) for _ in range(n))
    return [window_s * r / raw[-1] for r in raw]


def learner_for(schedule: str, model: torch.nn.Module, args: argparse.Namespace):
    if schedule == "sync":
        return SyncGRPOLearner(model, micro_batch_tokens=args.micro_batch_tokens or None)
    release = "group" if schedule == "stream-group" else "trajectory"
    return StreamingGRPOLearner(model, max_open_groups=args.max_open_groups, release=release)


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model = build_model(args.preset, seed=0)
    batch = make_batch(args, model.config.vocab_size)
    # Warm up kernels on two trajectories (small, so the baseline stays small too).
    warm = [t for t in batch if t.group_id == "g0"][:2]
    learner = learner_for(args.worker, model, args)
    learner.begin_batch(groups_of(warm))
    for traj in warm:
        learner.submit(traj)
    learner.finish()
    model.zero_grad(set_to_none=True)

    arrival_order = random.Random(args.seed + 2).sample(batch, len(batch))
    times = release_times(len(batch), args.window_s, args.seed)
    baseline_bytes = rss_bytes()
    learner = learner_for(args.worker, model, args)
    learner.begin_batch(groups_of(batch))
    result, timing = feed_on_schedule(
        list(zip(times, arrival_order, strict=True)), learner.submit, learner.finish
    )
    peak = peak_rss_bytes()
    torch.save({k: v.double() for k, v in result.grad_objective.items()}, args.grad_out)
    row = {"schedule": args.worker, **timing, "window_s": args.window_s}
    row |= {"peak_rss_above_baseline_mib": (peak - baseline_bytes) / 2**20}
    print(json.dumps(row | {"counters": result.counters}))


def run_schedule(schedule: str, args: argparse.Namespace, grad_out: Path) -> dict:
    argv = ["--worker", schedule, "--grad-out", str(grad_out)]
    for key in (*SHAPE_FLAGS, "seed", "window_s", "max_open_groups", "threads"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    argv += ["--micro-batch-tokens", str(args.micro_batch_tokens)]
    return run_worker(__file__, argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--response-tokens", type=int, default=320)
    parser.add_argument("--segments", type=int, default=3, help="action segments a trajectory")
    parser.add_argument("--window-s", type=float, default=0.0, help="0: 1.5x sync's learner time")
    parser.add_argument("--max-open-groups", type=int, default=4)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="sync; 0: one batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=SCHEDULES, help=argparse.SUPPRESS)
    parser.add_argument("--grad-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.window_s <= 0:
            # A window shorter than the learner's own work would measure the learner, not
            # the overlap: calibrate it to 1.5x the sync learner's busy time.
            args.window_s = 0.01
            probe = run_schedule("sync", args, Path(tmp) / "probe.pt")
            args.window_s = round(1.5 * probe["learner_busy_s"], 2)
        rows = {s: run_schedule(s, args, Path(tmp) / f"{s}.pt") for s in SCHEDULES}
        grads = {s: torch.load(Path(tmp) / f"{s}.pt") for s in SCHEDULES}
    for row in rows.values():
        print(json.dumps(row))
    tail = {s: rows[s]["tail_after_last_release_s"] for s in rows}
    summary = {
        "batch": f"{args.groups}x{args.group_size} trajectories, prompt {args.prompt_tokens} "
        f"tokens, ~{args.response_tokens} response tokens, preset {args.preset}",
        "window_s": args.window_s,
        "tail_after_last_reward_s": {s: round(v, 3) for s, v in tail.items()},
        "tail_ratio_sync_over_stream": round(tail["sync"] / tail["stream"], 1),
        "tail_ratio_sync_over_stream_group": round(tail["sync"] / tail["stream-group"], 1),
        "learner_busy_s": {s: round(rows[s]["learner_busy_s"], 2) for s in rows},
        "step_wall_s": {s: round(rows[s]["step_wall_s"], 2) for s in rows},
        "peak_rss_above_baseline_mib": {
            s: round(rows[s]["peak_rss_above_baseline_mib"], 1) for s in rows
        },
        "grad_rel_diff_fp32": {
            s: relative_difference(grads["sync"], grads[s]) for s in SCHEDULES[1:]
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
