"""Per-rank memory of the distributed learner: replicated vs FSDP2 at W ranks (gloo, CPU).

    .venv/bin/python benchmarks/learner_memory.py [--world 2] [--hidden 512 --layers 8]

For each layout, W ranks are spawned (one process group per layout, so their resident sets
do not mix) and take two GRPO steps on random trajectories. Each rank reports:

- ``peak_rss_above_baseline_bytes``: peak resident set (ru_maxrss) minus its value after
  imports and the process-group start, before the model exists;
- tracked state at the second barrier (after clipping, before the optimizer step):
  ``params`` (replica + master shard for fsdp2), ``grads`` (the reduced gradient: full in
  replicated, this rank's shard in fsdp2), ``optimizer`` (AdamW moments held by the rank)
  and ``accumulators`` (the streaming executor's float32 batch gradient: replicated in
  both layouts; GRPO's open-group statistics come on top while groups are open).
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import random_batch
from thundersync_core.parallel.data_parallel import init_process_group, stream_rank_share
from thundersync_core.parallel.fsdp import build_train_state
from thundersync_core.policy import build_model
from thundersync_core.streaming import StreamingGRPOLearner, groups_of


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank(rank: int, world: int, port: int, run: tuple[str, dict, str]) -> None:
    sharding, model_args, out = run
    torch.set_num_threads(1)
    init_process_group(
        "gloo", rank=rank, world_size=world, address="127.0.0.1", port=port, timeout_s=300
    )
    baseline = _peak_rss_bytes()
    model = build_model("tiny", seed=0, **model_args)
    state = build_train_state(model, sharding=sharding, lr=1e-4)  # type: ignore[arg-type]
    n_params = sum(p.numel() for p in model.parameters())
    tracked: dict[str, int] = {}
    for step in range(2):
        batch = random_batch(seed=step, vocab=model.config.vocab_size, n_groups=4, group_size=2)
        learner = StreamingGRPOLearner(model, max_open_groups=2)
        stream_rank_share(learner, batch, groups_of(batch), rank=rank, world_size=world)
        learner.finish()
        state.clip(1.0)
        tracked = state.state_bytes() | {"accumulators": learner.accumulator_bytes()}
        state.apply()
    record = {
        "rank": rank,
        "sharding": sharding,
        "parameters": n_params,
        "peak_rss_above_baseline_bytes": _peak_rss_bytes() - baseline,
        **{f"{k}_bytes": v for k, v in tracked.items()},
    }
    Path(out, f"{sharding}-rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    model_args = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "intermediate_size": 3 * args.hidden,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(args.hidden // 256, 1),
        "vocab_size": args.vocab,
    }
    records = []
    with tempfile.TemporaryDirectory() as out:
        for sharding in ("replicated", "fsdp2"):
            mp.spawn(
                _rank,
                args=(args.world, _free_port(), (sharding, model_args, out)),
                nprocs=args.world,
                join=True,
            )
            records.extend(
                json.loads(Path(out, f"{sharding}-rank{rank}.json").read_text())
                for rank in range(args.world)
            )
    mib = 1 << 20
    print(
        f"{'layout':<11} {'rank':>4} {'peak RSS+':>10} {'params':>8} {'grads':>8} "
        f"{'optim':>8} {'accum':>8}  (MiB)"
    )
    for r in records:
        print(
            f"{r['sharding']:<11} {r['rank']:>4} {r['peak_rss_above_baseline_bytes'] / mib:>10.1f}"
            f" {r['params_bytes'] / mib:>8.1f} {r['grads_bytes'] / mib:>8.1f}"
            f" {r['optimizer_bytes'] / mib:>8.1f} {r['accumulators_bytes'] / mib:>8.1f}"
        )
    print(json.dumps({"parameters": records[0]["parameters"], "ranks": records}))


if __name__ == "__main__":
    main()
