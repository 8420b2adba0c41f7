"""Learner work left after the last teacher score: streaming OPD vs sync, by turn count.

Each trajectory is a chain of turns: the policy writes an action, the teacher scores it,
the tool runs, the next action follows. Turn release times are spread over the rollout
window, uneven per trajectory, and the last turn of the batch lands at the window's end.
The sync learner starts its batch forward/backward after the last teacher score; the
streaming learner backpropagates each turn as its scores land (while the tool runs) and
replays boundary adjoints at trajectory close. Teacher log-probs come from a real frozen
teacher model, scored before the timed run so that only learner work is timed. Each
(turn count, schedule) runs in its own process so that peak memory is its own.

    python benchmarks/opd_turn_release.py [--turns 4,16,64 ...]
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

from thundersync_core.batch import Segment, Trajectory, Turn, turns_of
from thundersync_core.objectives.opd import split_by_turn
from thundersync_core.policy import build_model
from thundersync_core.replay import relative_difference
from thundersync_core.streaming import StreamingOPDLearner, SyncOPDLearner, groups_of
from thundersync_core.teacher import Teacher


def make_batch(args: argparse.Namespace, turns: int, vocab: int) -> list[Trajectory]:
    rng = random.Random(args.seed)
    teacher = Teacher(build_model(args.preset, seed=1))
    batch = []
    for g in range(args.groups):
        prompt = tuple(rng.randrange(vocab) for _ in range(args.prompt_tokens))
        for i in range(args.group_size):
            segments: list[Segment] = []
            for k in range(turns):
                if k:
                    obs = [rng.randrange(vocab) for _ in range(args.observation_tokens)]
                    segments.append(Segment.observation(obs))
                ids = [rng.randrange(vocab) for _ in range(args.action_tokens)]
                segments.append(Segment.action(ids))
            draft = Trajectory(f"g{g}", f"g{g}-{i}", prompt, tuple(segments), 0.0)
            scores: list[float] = []
            empty = [()] * turns
            for turn in turns_of(draft, empty):
                scores += teacher.score(turn)
            batch.append(Trajectory(**{**draft.__dict__, "teacher_logprobs": tuple(scores)}))
    return batch


def turn_releases(batch: list[Trajectory], window_s: float, seed: int) -> list[tuple[float, Turn]]:
    """Per trajectory, turns at increasing times; trajectories finish unevenly, the last at
    window_s (a straggler), the others earlier."""
    rng = random.Random(seed + 1)
    releases = []
    ends = sorted(rng.uniform(0.5, 1.0) for _ in batch)
    ends[-1] = 1.0
    for traj, end in zip(rng.sample(batch, len(batch)), ends, strict=True):
        turns = turns_of(traj, split_by_turn(traj))
        gaps = [rng.expovariate(1.0) for _ in turns]
        clock = 0.0
        for turn, gap in zip(turns, gaps, strict=True):
            clock += gap
            releases.append((window_s * end * clock / sum(gaps), turn))
    return releases


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model = build_model(args.preset, seed=0)
    batch = make_batch(args, args.worker_turns, model.config.vocab_size)
    warm = batch[:1]
    for learner in (SyncOPDLearner(model), StreamingOPDLearner(model)):
        # Warm-up only: kernels and allocator, on one trajectory.
        learner.begin_batch(groups_of(warm))
        learner.submit(warm[0])
        learner.finish()
    model.zero_grad(set_to_none=True)

    baseline = rss_bytes()
    if args.worker == "sync":
        sync = SyncOPDLearner(model, micro_batch_tokens=args.micro_batch_tokens or None)
        sync.begin_batch(groups_of(batch))
        by_id = {t.trajectory_id: t for t in batch}

        def submit(turn: Turn) -> None:
            if turn.last:  # the sync learner only takes whole trajectories
                sync.submit(by_id[turn.trajectory_id])

        finish, counters = sync.finish, lambda: {}
    else:
        stream = StreamingOPDLearner(model)
        stream.begin_batch(groups_of(batch))
        submit, finish, counters = stream.submit_turn, stream.finish, stream.counters_so_far
    releases = turn_releases(batch, args.window_s, args.seed)
    result, timing = feed_on_schedule(releases, submit, finish)
    peak = peak_rss_bytes()
    torch.save({k: v.double() for k, v in result.grad_objective.items()}, args.grad_out)
    row = {"schedule": args.worker, "turns": args.worker_turns, **timing}
    row |= {"peak_rss_above_baseline_mib": (peak - baseline) / 2**20, "counters": counters()}
    print(json.dumps(row))


def run(schedule: str, turns: int, window_s: float, args: argparse.Namespace, out: Path) -> dict:
    argv = ["--worker", schedule, "--worker-turns", str(turns), "--grad-out", str(out)]
    argv += ["--window-s", str(window_s)]
    for key in ("preset", "groups", "group_size", "prompt_tokens", "action_tokens"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    argv += ["--observation-tokens", str(args.observation_tokens), "--seed", str(args.seed)]
    argv += ["--threads", str(args.threads), "--micro-batch-tokens", str(args.micro_batch_tokens)]
    return run_worker(__file__, argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", default="4,16,64")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--action-tokens", type=int, default=24)
    parser.add_argument("--observation-tokens", type=int, default=40)
    parser.add_argument("--window-s", type=float, default=0.0, help="0: 1.5x sync's learner time")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="sync; 0: one batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=["sync", "stream"], help=argparse.SUPPRESS)
    parser.add_argument("--worker-turns", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--grad-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        for turns in [int(t) for t in args.turns.split(",")]:
            window_s = args.window_s
            if window_s <= 0:
                # The regime the method targets: rollout (window) longer than the learner's
                # work, so the streaming learner keeps up. Streaming does more total work
                # than sync (it recomputes each trajectory once to replay adjoints), so the
                # window is calibrated on the streaming learner's busy time.
                probe = run("stream", turns, 0.01, args, Path(tmp) / "probe.pt")
                window_s = round(1.5 * probe["learner_busy_s"], 2)
            rows = {
                s: run(s, turns, window_s, args, Path(tmp) / f"{s}.pt") for s in ("sync", "stream")
            }
            for row in rows.values():
                print(json.dumps(row))
            a, b = (torch.load(Path(tmp) / f"{s}.pt") for s in ("sync", "stream"))
            tail = {s: rows[s]["tail_after_last_release_s"] for s in rows}
            summary.append(
                {
                    "turns": turns,
                    "tokens_per_trajectory": args.prompt_tokens
                    + turns * args.action_tokens
                    + (turns - 1) * args.observation_tokens,
                    "window_s": window_s,
                    "tail_after_last_score_s": {s: round(v, 3) for s, v in tail.items()},
                    "tail_ratio_sync_over_stream": round(tail["sync"] / tail["stream"], 1),
                    "learner_busy_s": {s: round(rows[s]["learner_busy_s"], 2) for s in rows},
                    "peak_rss_above_baseline_mib": {
                        s: round(rows[s]["peak_rss_above_baseline_mib"], 1) for s in rows
                    },
                    "stream_peak_live_kv_mib": round(
                        rows["stream"]["counters"]["peak_live_kv_bytes"] / 2**20, 2
                    ),
                    "grad_rel_diff_fp32": relative_difference(a, b),
                }
            )
    for line in summary:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
