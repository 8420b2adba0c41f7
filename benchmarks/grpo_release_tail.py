"""Learner work left after the last reward: streaming GRPO vs sync, same batch, same arrivals.

Rewards arrive over a rollout window with a long tail (log-normal release times). The sync
learner starts its batch forward/backward after the last reward; the streaming learner
backpropagates each trajectory as its reward lands and closes groups as they complete, so
after the last reward only that trajectory and its group close remain. Each schedule runs
in its own subprocess so that its peak resident memory is its own.

    python benchmarks/grpo_release_tail.py [--groups 8 --group-size 8 ...]

Prints one JSON line per schedule and a summary line with the tail ratio and the two
gradients' relative difference (the benchmark checks exactness too).
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from thundersync_core.batch import Segment, Trajectory
from thundersync_core.policy import build_model
from thundersync_core.streaming import StreamingGRPOLearner, SyncGRPOLearner, groups_of


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
    return StreamingGRPOLearner(model, max_open_groups=args.max_open_groups)


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model = build_model(args.preset, seed=0)
    batch = make_batch(args, model.config.vocab_size)
    # Warm up kernels on two trajectories (small, so the baseline RSS stays small too).
    warm = [t for t in batch if t.group_id == "g0"][:2]
    learner = learner_for(args.worker, model, args)
    learner.begin_batch(groups_of(warm))
    for traj in warm:
        learner.submit(traj)
    learner.finish()
    model.zero_grad(set_to_none=True)

    arrival_order = random.Random(args.seed + 2).sample(batch, len(batch))
    times = release_times(len(batch), args.window_s, args.seed)
    inbox: queue.Queue[Trajectory] = queue.Queue()
    baseline_bytes = psutil.Process().memory_info().rss

    def feeder(start: float) -> None:
        for traj, at in zip(arrival_order, times, strict=True):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            inbox.put(traj)

    learner = learner_for(args.worker, model, args)
    learner.begin_batch(groups_of(batch))
    start = time.perf_counter()
    thread = threading.Thread(target=feeder, args=(start,), daemon=True)
    thread.start()
    busy_s = 0.0
    for _ in batch:
        traj = inbox.get()
        t0 = time.perf_counter()
        learner.submit(traj)
        busy_s += time.perf_counter() - t0
    last_reward_s = start + times[-1]
    t0 = time.perf_counter()
    result = learner.finish()
    done = time.perf_counter()
    busy_s += done - t0
    peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grad_path = Path(args.grad_out)
    torch.save({k: v.double() for k, v in result.grad_objective.items()}, grad_path)
    print(
        json.dumps(
            {
                "schedule": args.worker,
                "tail_after_last_reward_s": done - last_reward_s,
                "learner_busy_s": busy_s,
                "step_wall_s": done - start,
                "window_s": args.window_s,
                "peak_rss_above_baseline_mib": (peak_bytes - baseline_bytes) / 2**20,
                "peak_rss_mib": peak_bytes / 2**20,
                "counters": result.counters,
            }
        )
    )


def run_schedule(schedule: str, args: argparse.Namespace, grad_out: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", schedule, "--grad-out", str(grad_out)]
    for key in ("preset", "groups", "group_size", "prompt_tokens", "response_tokens", "segments"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    cmd += ["--seed", str(args.seed), "--window-s", str(args.window_s)]
    cmd += ["--max-open-groups", str(args.max_open_groups), "--threads", str(args.threads)]
    if args.micro_batch_tokens:
        cmd += ["--micro-batch-tokens", str(args.micro_batch_tokens)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


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
    parser.add_argument("--micro-batch-tokens", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=["sync", "stream"], help=argparse.SUPPRESS)
    parser.add_argument("--grad-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.window_s <= 0:
            # Calibrate: a window shorter than the learner's own work would measure the
            # learner, not the overlap.
            args.window_s = 0.01
            probe = run_schedule("sync", args, Path(tmp) / "probe.pt")
            args.window_s = round(1.5 * probe["learner_busy_s"], 2)
        rows = {s: run_schedule(s, args, Path(tmp) / f"{s}.pt") for s in ("sync", "stream")}
        a, b = (torch.load(Path(tmp) / f"{s}.pt") for s in ("sync", "stream"))
    rel = max(float((a[k] - b[k]).abs().max()) for k in a) / max(float(a[k].abs().max()) for k in a)
    for row in rows.values():
        print(json.dumps(row))
    sync, stream = rows["sync"], rows["stream"]
    summary = {
        "batch": f"{args.groups}x{args.group_size} trajectories, prompt {args.prompt_tokens} "
        f"tokens, ~{args.response_tokens} response tokens, preset {args.preset}",
        "window_s": args.window_s,
        "tail_sync_s": round(sync["tail_after_last_reward_s"], 3),
        "tail_stream_s": round(stream["tail_after_last_reward_s"], 3),
        "tail_ratio_sync_over_stream": round(
            sync["tail_after_last_reward_s"] / stream["tail_after_last_reward_s"], 1
        ),
        "step_wall_sync_s": round(sync["step_wall_s"], 3),
        "step_wall_stream_s": round(stream["step_wall_s"], 3),
        "peak_rss_above_baseline_mib": {
            "sync": round(sync["peak_rss_above_baseline_mib"], 1),
            "stream": round(stream["peak_rss_above_baseline_mib"], 1),
        },
        "grad_rel_diff_fp32": rel,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
