"""Learner busy time: the streaming GRPO learner, per trajectory and packed, against the
best sync learner, on the same batch.

Rewards land in waves (``--wave`` trajectories at a time, in a seeded random order), as
they do when a bounded number of episodes is in flight: the streaming learner gets each
wave as it lands, one trajectory at a time (``per-source``) or as one ``submit_many``
(``packed``, packs of at most ``--pack-tokens`` padded tokens, a group's rows cut by length
where padding costs more than another pack; ``fixed order``: a group runs once whole, in
trajectory-id order, bitwise the sync update; with ``--chunks N`` also each group as N
id-chunks, a chunk once its members landed with two reward values, sync running the same
chunks). ``uncut`` is the packed sync learner with
the rows of a group kept in trajectory-id order and cut only at the bound, one straggler
widening its group's every row. The sync learners get the
whole batch once it is complete: the per-source executor fed in trajectory-id order, the
padded whole-batch learner, and the packed executor. Busy time is the learner's own work
(submits and the barrier), the median of ``--repeats`` runs, on ``--threads`` threads (the
learner's one core in the embedded default). The gradients are checked against the first
sync learner's.

    python benchmarks/learner_packing.py [--groups 16 --group-size 8 ...] [--out FILE.json]
    python benchmarks/learner_packing.py --batch benchmarks/data/embedded_batch.jsonl --preset wide

``--batch`` times a logged batch (a run's ``batches/step-*.jsonl``) instead of the
synthetic one: real episodes, whose lengths in a group are uneven (most end in one turn,
a few run all three).

Prints a table and a JSON line: each learner's busy seconds and its ratio to the best sync
learner (the packed streaming learner's is the figure to watch: <= 1.05 means streaming
costs the learner almost nothing over the fastest way to train on a finished batch).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from grpo_release_tail import make_batch

from thundersync_core.batch import Trajectory, read_batch
from thundersync_core.policy import build_model
from thundersync_core.replay import relative_difference
from thundersync_core.streaming import StreamingGRPOLearner, SyncGRPOLearner, groups_of, grpo_stream


def waves(batch: list[Trajectory], size: int, seed: int) -> list[list[Trajectory]]:
    order = random.Random(seed).sample(batch, len(batch))
    return [order[i : i + size] for i in range(0, len(order), size)]


def timed(run: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = run()
    return time.perf_counter() - t0, result


def learners(
    model: torch.nn.Module, batch: list[Trajectory], args: argparse.Namespace
) -> dict[str, Callable[[], object]]:
    groups = groups_of(batch)
    ordered = sorted(batch, key=lambda t: t.trajectory_id)
    n_groups = len(groups)

    def per_source(sources: list[list[Trajectory]], cap: int) -> object:
        learner = StreamingGRPOLearner(model, loss_agg="token-mean", max_open_groups=cap)
        learner.begin_batch(groups)
        for wave in sources:
            for traj in wave:
                learner.submit(traj)
        return learner.finish()

    def packed(
        sources: list[list[Trajectory]], cap: int, order: str = "arrival", chunks: int = 1
    ) -> object:
        learner = StreamingGRPOLearner(
            model,
            loss_agg="token-mean",
            max_open_groups=cap,
            order=order,  # type: ignore[arg-type]
            chunks=chunks,
        )
        learner.begin_batch(groups_of(batch, with_members=True) if chunks > 1 else groups)
        for wave in sources:
            learner.submit_many(wave, pack_tokens=args.pack_tokens)
        return learner.finish()

    def uncut() -> object:
        length_aware = grpo_stream._packs
        grpo_stream._packs = _consecutive_packs
        try:
            return packed([ordered], n_groups, "fixed")
        finally:
            grpo_stream._packs = length_aware

    def batched() -> object:
        learner = SyncGRPOLearner(model, loss_agg="token-mean")
        learner.begin_batch(groups)
        for traj in ordered:
            learner.submit(traj)
        return learner.finish()

    arrivals = waves(batch, args.wave, args.seed)
    chunked: dict[str, Callable[[], object]] = {}
    if args.chunks > 1:
        n = args.chunks
        chunked = {
            f"sync packed, {n} chunks": lambda: packed([ordered], n_groups, "fixed", n),
            f"streaming packed, {n} chunks": lambda: packed(
                arrivals, args.max_open_groups, "fixed", n
            ),
        }
    return chunked | {
        "sync per-source": lambda: per_source([ordered], n_groups),
        "sync batched": batched,
        "sync packed": lambda: packed([ordered], n_groups),
        "streaming per-source": lambda: per_source(arrivals, args.max_open_groups),
        "streaming packed": lambda: packed(arrivals, args.max_open_groups),
        "sync packed, fixed order": lambda: packed([ordered], n_groups, "fixed"),
        "sync packed, uncut": uncut,
        "streaming packed, fixed order": lambda: packed(arrivals, args.max_open_groups, "fixed"),
    }


def _consecutive_packs(trajs: list[Trajectory], pack_tokens: int) -> list[list[Trajectory]]:
    """Consecutive runs of ``trajs`` whose padded size (rows x longest row) fits the bound."""
    packs: list[list[Trajectory]] = []
    current: list[Trajectory] = []
    width = 0
    for traj in trajs:
        row = 1 + len(traj.response_ids)
        if current and (len(current) + 1) * max(width, row) > pack_tokens:
            packs.append(current)
            current, width = [], 0
        current.append(traj)
        width = max(width, row)
    return [*packs, current] if current else packs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--response-tokens", type=int, default=160)
    parser.add_argument("--segments", type=int, default=3, help="action segments a trajectory")
    parser.add_argument("--wave", type=int, default=8, help="trajectories landing together")
    parser.add_argument("--pack-tokens", type=int, default=4096)
    parser.add_argument("--max-open-groups", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=1, help="also time N id-chunks a group")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=Path, help="a logged batch instead of the synthetic one")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.preset, seed=0)
    if args.batch:  # its policy version made version 0, the learners' here
        batch = [replace(t, policy_version=0) for t in read_batch(args.batch)]
    else:
        batch = make_batch(args, model.config.vocab_size)
    runs = learners(model, batch, args)
    runs["sync per-source"]()  # warm-up: kernels and allocator
    busy: dict[str, list[float]] = {name: [] for name in runs}
    results: dict[str, object] = {}
    for _ in range(args.repeats):
        for name, run in runs.items():  # interleaved: drift of the machine favours none
            seconds, results[name] = timed(run)
            busy[name].append(seconds)
            model.zero_grad(set_to_none=True)
    median = {name: statistics.median(times) for name, times in busy.items()}
    best_sync = min((n for n in median if n.startswith("sync")), key=median.__getitem__)
    reference = results["sync per-source"].grad_objective  # type: ignore[attr-defined]
    rows = {
        name: {
            "busy_s": median[name],
            "busy_s_all": busy[name],
            "over_best_sync": median[name] / median[best_sync],
            "grad_rel_diff": relative_difference(
                reference,
                results[name].grad_objective,  # type: ignore[attr-defined]
            ),
        }
        for name in runs
    }
    print(f"{'learner':<22} {'busy s':>8} {'/ best sync':>12} {'grad rel diff':>14}")
    for name, row in rows.items():
        print(
            f"{name:<22} {row['busy_s']:8.3f} {row['over_best_sync']:12.3f} "
            f"{row['grad_rel_diff']:14.1e}"
        )
    keys = ("preset", "groups", "group_size", "prompt_tokens", "response_tokens", "segments")
    keys += ("wave", "pack_tokens", "max_open_groups", "threads")
    if args.batch:  # the batch's own shape, not the synthetic one's flags
        keys = ("preset", "wave", "pack_tokens", "max_open_groups", "threads")
    shape = {k: getattr(args, k) for k in keys}
    if args.batch:
        rows_T = [1 + len(t.response_ids) for t in batch]
        shape |= {
            "batch": str(args.batch),
            "groups": len(groups_of(batch)),
            "trajectories": len(batch),
            "row_tokens": sum(rows_T),
            "row_tokens_padded_per_group": sum(
                len(m) * max(1 + len(t.response_ids) for t in m) for m in _by_group(batch).values()
            ),
        }
    summary = {
        "best_sync": best_sync,
        "streaming_packed_over_best_sync": rows["streaming packed"]["over_best_sync"],
        "streaming_per_source_over_best_sync": rows["streaming per-source"]["over_best_sync"],
        "streaming_packed_fixed_over_best_sync": rows["streaming packed, fixed order"][
            "over_best_sync"
        ],
        "fixed_order_bitwise_sync": all(
            torch.equal(a, b)
            for a, b in zip(
                results["sync packed, fixed order"].grad_objective.values(),  # type: ignore[attr-defined]
                results["streaming packed, fixed order"].grad_objective.values(),  # type: ignore[attr-defined]
                strict=True,
            )
        ),
        **_chunk_summary(args.chunks, rows, results),
        "length_aware_over_uncut": rows["sync packed, fixed order"]["busy_s"]
        / rows["sync packed, uncut"]["busy_s"],
        "learners": rows,
        "shape": shape,
        "command": "python " + " ".join(["benchmarks/learner_packing.py", *sys.argv[1:]]),
    }
    print(json.dumps(summary))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


def _chunk_summary(
    chunks: int, rows: dict[str, dict[str, object]], results: dict[str, object]
) -> dict[str, object]:
    """With ``--chunks``: the chunked learners against the best sync, and whether the
    streamed chunks are bitwise the sync chunks."""
    if chunks <= 1:
        return {}
    sync, stream = f"sync packed, {chunks} chunks", f"streaming packed, {chunks} chunks"
    return {
        "chunks": chunks,
        "sync_chunked_over_best_sync": rows[sync]["over_best_sync"],
        "streaming_chunked_over_best_sync": rows[stream]["over_best_sync"],
        "chunks_bitwise_sync": all(
            torch.equal(a, b)
            for a, b in zip(
                results[sync].grad_objective.values(),  # type: ignore[attr-defined]
                results[stream].grad_objective.values(),  # type: ignore[attr-defined]
                strict=True,
            )
        ),
    }


def _by_group(batch: list[Trajectory]) -> dict[str, list[Trajectory]]:
    out: dict[str, list[Trajectory]] = {}
    for traj in batch:
        out.setdefault(traj.group_id, []).append(traj)
    return out


if __name__ == "__main__":
    main()
