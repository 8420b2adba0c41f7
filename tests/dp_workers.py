"""Rank-side code of the data-parallel tests: run in processes spawned by torch.multiprocessing.

Each rank builds the same micro model (seed 3, as the ``micro32`` fixture), joins a gloo
group, routes the batch's sources with the shared ``GroupAssigner`` (a pure function of the
arrival order, so every rank computes the same routing without talking) and keeps only its
own. Results are written to ``out/<case>-rank<r>.pt`` for the test process to compare.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers import multi_turn_batch, random_batch
from thundersync_core.batch import turns_of
from thundersync_core.objectives.opd import split_by_turn
from thundersync_core.parallel.data_parallel import (
    ShardedGradient,
    init_process_group,
    stream_rank_share,
)
from thundersync_core.parallel.dcp import load_group_checkpoint, save_group_checkpoint
from thundersync_core.parallel.fsdp import build_train_state, load_sharded_state
from thundersync_core.parallel.shared_groups import (
    SharedGroupsGRPOLearner,
    stream_shared_groups,
)
from thundersync_core.policy import build_model
from thundersync_core.policy.io import load_model
from thundersync_core.replay import interleave
from thundersync_core.streaming import (
    LearnerRefusal,
    StreamingGRPOLearner,
    StreamingOPDLearner,
    groups_of,
)

# Updates are compared as float32 parameters after minus before: a one-ulp difference in a
# parameter near 1 (the norm weights) is 1.2e-7, i.e. 1.2e-4 of a 1e-3 step but 2.4e-6 of
# a 5e-2 step, which leaves the 1e-5 tolerance to the update itself.
LR = 5e-2
MAX_GRAD_NORM = 1.0


#: Groups g0-g2 on rank 0, g3 on rank 1.
SPLIT_3_1 = {"g0": 0, "g1": 0, "g2": 0, "g3": 1}


def grpo_batch(seed: int = 11):
    """Four groups of three: enough to split 3 + 1 over two ranks."""
    return random_batch(seed=seed, vocab=1024, n_groups=4, group_size=3)


def opd_batch(seed: int = 13):
    return multi_turn_batch(seed=seed, vocab=1024, n_groups=3, group_size=2)


def arrivals(objective: str, batch, order_seed: int) -> list[Any]:
    """Sources in an arrival order: trajectories (GRPO) or interleaved turns (OPD)."""
    rng = random.Random(order_seed)
    if objective == "grpo":
        return rng.sample(batch, len(batch))
    turns = {t.trajectory_id: turns_of(t, split_by_turn(t)) for t in batch}
    return list(interleave(turns, rng))


def make_learner(objective: str, model, loss_agg: str = "seq-sum"):
    if objective == "grpo":
        return StreamingGRPOLearner(model, loss_agg=loss_agg, max_open_groups=2)  # type: ignore[arg-type]
    return StreamingOPDLearner(model)


def stream_rank(learner, batch, sources, forced: dict[str, int] | None = None) -> list[str]:
    """Run this rank's share of ``sources`` through ``learner``; returns its groups."""
    return stream_rank_share(
        learner,
        sources,
        groups_of(batch),
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        forced=forced,
    )


def gradient_case(objective: str, loss_agg: str, order_seed: int, forced=None) -> dict:
    model = build_model("micro", seed=3, dtype=torch.float32)
    batch = grpo_batch() if objective == "grpo" else opd_batch()
    learner = make_learner(objective, model, loss_agg)
    mine = stream_rank(learner, batch, arrivals(objective, batch, order_seed), forced)
    result = learner.finish()
    return {
        "groups": mine,
        "grads": {k: v.clone() for k, v in result.grad_objective.items()},
        "objective": result.objective,
        "n_groups": result.n_groups,
        "n_scored_tokens": result.n_scored_tokens,
    }


def refusal_case() -> dict:
    """Rank 1 never receives the last trajectory of its group g3, so it refuses the barrier;
    rank 0 has all of its groups and would otherwise wait in the reduction."""
    model = build_model("micro", seed=3, dtype=torch.float32)
    batch = grpo_batch()
    sources = arrivals("grpo", batch, 0)
    dropped = [t for t in sources if t.group_id == "g3"][-1]
    learner = make_learner("grpo", model)
    stream_rank(learner, batch, [t for t in sources if t is not dropped], SPLIT_3_1)
    start = time.monotonic()
    try:
        learner.finish()
    except LearnerRefusal as exc:
        return {"error": str(exc), "elapsed_s": time.monotonic() - start}
    return {"error": None, "elapsed_s": time.monotonic() - start}


def train_step(state, objective: str, batch, order_seed: int) -> dict[str, torch.Tensor]:
    """One step; returns the reduced gradient of the objective (before clipping)."""
    learner = make_learner(objective, state.model)
    stream_rank(learner, batch, arrivals(objective, batch, order_seed))
    result = learner.finish()
    grads = {k: v.clone() for k, v in result.grad_objective.items()}
    state.clip(MAX_GRAD_NORM)
    state.apply()
    return grads


def optimizer_state(state) -> dict[str, dict[str, torch.Tensor]]:
    """The sharded AdamW state gathered in full, by parameter name (every rank calls)."""
    gathered = {}
    for name, _, master_p in state.pairs:
        entries = state.optimizer.state[master_p]
        gathered[name] = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
            for k, v in entries.items()
        }
    return gathered


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def update_case(sharding: str, dtype: torch.dtype = torch.float32) -> dict:
    """One GRPO step: the parameter update of ``sharding`` and the tracked state bytes."""
    model = build_model("micro", seed=3, dtype=dtype)
    before = full_params(model)
    state = build_train_state(model, sharding=sharding, lr=LR)  # type: ignore[arg-type]
    learner = make_learner("grpo", model)
    stream_rank(learner, grpo_batch(), arrivals("grpo", grpo_batch(), 4))
    learner.finish()
    norm = state.clip(MAX_GRAD_NORM)
    state.apply()
    after = full_params(state.model)
    return {"delta": {n: after[n] - before[n] for n in after}, "grad_norm": norm}


def checkpoint_case(out: Path) -> dict:
    """fsdp2: step on batch A, checkpoint, step on batch B (uninterrupted); then a fresh
    state resumes from the checkpoint and steps on batch B."""
    first, second = grpo_batch(21), grpo_batch(22)
    model = build_model("micro", seed=3, dtype=torch.float32)
    state = build_train_state(model, sharding="fsdp2", lr=LR)
    train_step(state, "grpo", first, 1)
    save_group_checkpoint(
        out / "checkpoints",
        step=1,
        state=state,
        policy_version=1,
        sharding="fsdp2",
        model_config=model.config,
        export_dtype=torch.bfloat16,  # the export; the master is in the DCP state
    )
    at_checkpoint = full_params(state.model)
    optimizer_at_checkpoint = optimizer_state(state)
    next_grads = train_step(state, "grpo", second, 2)
    uninterrupted = full_params(state.model)
    fresh = build_model("micro", seed=99, dtype=torch.float32)
    resumed_state = build_train_state(fresh, sharding="fsdp2", lr=LR)
    record = load_group_checkpoint(
        out / "checkpoints" / "step-000001",
        module=resumed_state.checkpoint_module(),
        optimizer=resumed_state.optimizer,
    )
    resumed_state.refresh_replica()
    loaded = full_params(resumed_state.model)
    resumed_grads = train_step(resumed_state, "grpo", second, 2)
    return {
        "at_checkpoint": at_checkpoint,
        "optimizer_at_checkpoint": optimizer_at_checkpoint,
        "next_grads": next_grads,
        "resumed_grads": resumed_grads,
        "loaded": loaded,
        "uninterrupted": uninterrupted,
        "resumed": full_params(resumed_state.model),
        "record": record,
    }


def load_case(out: Path, dtype: torch.dtype) -> dict:
    """fsdp2 state built two ways from one float32 folder: every rank loading the model
    (``build_train_state``), and rank 0 alone reading it (``load_sharded_state``); then one
    GRPO step on each."""
    folder = out / "load-model"
    if dist.get_rank() == 0 and not folder.exists():
        build_model("micro", seed=5, dtype=torch.float32).save_pretrained(folder)
    dist.barrier()
    states = {
        "every": build_train_state(
            load_model(folder), sharding="fsdp2", lr=LR, compute_dtype=dtype
        ),
        "rank0": load_sharded_state(folder, lr=LR, compute_dtype=dtype),
    }
    result: dict = {}
    for how, state in states.items():
        result[f"{how}:replica"] = full_params(state.model)
        result[f"{how}:replica_dtype"] = {p.dtype for p in state.model.parameters()}
        result[f"{how}:master"] = {n: t.clone() for n, t in state._gathered()}
        train_step(state, "grpo", grpo_batch(23), 1)
        result[f"{how}:after"] = {n: t.clone() for n, t in state._gathered()}
    return result


def sharded_case(release: str) -> dict:
    """One fsdp2 GRPO step with whole batch accumulators on every rank, and one with the batch
    gradient sharded over the ranks (``ShardedGradient``, flushed after each group): the
    gradients, the bytes each rank holds, the gradient norms and the updates."""
    result: dict = {}
    batch = grpo_batch(31)
    for how in ("whole", "sharded"):
        model = build_model("micro", seed=3, dtype=torch.float32)
        before = full_params(model)
        state = build_train_state(model, sharding="fsdp2", lr=LR)
        learner = StreamingGRPOLearner(model, max_open_groups=2, release=release)  # type: ignore[arg-type]
        if how == "sharded":
            learner.sharded_grad = ShardedGradient(learner.params, dtype=learner.accum_dtype)
        stream_rank(learner, batch, arrivals("grpo", batch, 5))
        peak = learner.accumulator_bytes()
        out = learner.finish()
        result[f"{how}:bytes"] = peak
        result[f"{how}:sharded"] = out.sharded
        result[f"{how}:grads"] = {k: v.clone() for k, v in out.grad_objective.items()}
        result[f"{how}:objective"] = out.objective
        if how == "sharded":
            norm = state.clip_shards(MAX_GRAD_NORM, out.grad_objective, -1.0)
        else:
            norm = state.clip(MAX_GRAD_NORM, out.grad_objective, -1.0)
        state.apply()
        result[f"{how}:norm"] = norm
        after = {n: t.clone() for n, t in state._gathered()}
        result[f"{how}:delta"] = {n: after[n] - before[n] for n in after}
    return result


def opd_sharded_case() -> dict:
    """Streaming OPD over fsdp2 ranks with the batch gradient sharded, flushed after every
    turn (a tick of one turn, as the learner group runs OPD turns): the gradient rows, the
    objective, and the most gradient bytes a rank held between ticks."""
    model = build_model("micro", seed=3, dtype=torch.float32)
    build_train_state(model, sharding="fsdp2", lr=LR)
    learner = StreamingOPDLearner(model)
    learner.sharded_grad = ShardedGradient(learner.params, dtype=learner.accum_dtype)
    batch = opd_batch()
    held = [0]
    flush = learner.sharded_grad.flush

    def tracked() -> None:
        flush()
        held[0] = max(held[0], learner.accumulator_bytes())

    learner.sharded_grad.flush = tracked  # type: ignore[method-assign]
    stream_rank(learner, batch, arrivals("opd", batch, 1))
    out = learner.finish()
    return {
        "grads": {k: v.clone() for k, v in out.grad_objective.items()},
        "objective": out.objective,
        "sharded": out.sharded,
        "held_bytes": held[0],
        "param_bytes": sum(p.numel() * 4 for p in learner.params),
    }


def shared_case(burst: int, cap: int, dtype: torch.dtype) -> dict:
    """GRPO over ranks that share their open groups (``SharedGroupsGRPOLearner``): ``burst``
    trajectories land between tick plannings, at most ``cap`` groups open over all ranks.
    The gradient rows, the objective, and the largest x1/x2 rows a rank held."""
    model = build_model("micro", seed=3, dtype=dtype)
    learner = SharedGroupsGRPOLearner(model, max_open_groups=cap)  # type: ignore[arg-type]
    learner.sharded_grad = ShardedGradient(learner.params, dtype=learner.accum_dtype)
    batch = grpo_batch(31)
    peak = {"stats": 0, "open": 0}

    def tracked() -> None:
        held = [t for g in learner._shared.values() for t in (g.x1 or []) + (g.x2 or [])]
        peak["stats"] = max(peak["stats"], sum(t.numel() * t.element_size() for t in held))
        peak["open"] = max(peak["open"], len(learner._shared))

    ticks = stream_shared_groups(
        learner,
        arrivals("grpo", batch, 7),
        groups_of(batch),
        max_open_groups=cap,
        burst=burst,
        on_tick=tracked,
    )
    out = learner.finish()
    return {
        "grads": {k: v.clone() for k, v in out.grad_objective.items()},
        "objective": out.objective,
        "n_groups": out.n_groups,
        "n_scored_tokens": out.n_scored_tokens,
        "ticks": [[(e.rank, e.trajectory_id) for e in tick] for tick in ticks],
        "peak_stats_bytes": peak["stats"],
        "peak_open": peak["open"],
        "param_bytes": sum(p.numel() * 8 for p in learner.params),  # float64 equivalent
        "counters": out.counters,
    }


def shared_refusal_case() -> dict:
    """Rank 1's trajectory in the first tick claims another policy version: it refuses, and
    every rank refuses that tick at once (no wait in a reduction)."""
    import dataclasses  # noqa: PLC0415

    model = build_model("micro", seed=3, dtype=torch.float32)
    learner = SharedGroupsGRPOLearner(model, max_open_groups=4)  # type: ignore[arg-type]
    learner.sharded_grad = ShardedGradient(learner.params, dtype=learner.accum_dtype)
    batch = grpo_batch(31)
    sources = arrivals("grpo", batch, 7)
    sources[1] = dataclasses.replace(sources[1], policy_version=5)
    start = time.monotonic()
    try:
        stream_shared_groups(learner, sources, groups_of(batch), max_open_groups=4, burst=4)
    except LearnerRefusal as exc:
        return {"error": str(exc), "elapsed_s": time.monotonic() - start}
    return {"error": None, "elapsed_s": time.monotonic() - start}


def run_ranks(world: int, out: Path, cases: list[str], timeout_s: float = 240) -> dict:
    """Spawn ``world`` gloo ranks running ``cases``; {case: [rank 0's result, ...]}. A rank
    that fails raises here with its trace; ranks still running after ``timeout_s`` fail."""
    import socket  # noqa: PLC0415

    import pytest  # noqa: PLC0415
    import torch.multiprocessing as mp  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.start_processes(
        rank_main, args=(world, port, str(out), cases), nprocs=world, join=False,
        start_method="spawn",
    )  # fmt: skip
    # join(timeout) returns False while ranks run; a failed rank raises here with its trace.
    for _ in range(int(timeout_s // 10)):
        if context.join(timeout=10):
            break
    else:
        for process in context.processes:
            process.kill()
        pytest.fail(f"the {world} learner ranks did not finish within {timeout_s:.0f} s")
    return {
        case: [torch.load(out / f"{case.replace(':', '_')}-rank{r}.pt") for r in range(world)]
        for case in cases
    }


def rank_main(rank: int, world: int, port: int, out_dir: str, cases: list[str]) -> None:
    torch.set_num_threads(1)
    init_process_group(
        "gloo", rank=rank, world_size=world, address="127.0.0.1", port=port, timeout_s=60
    )
    out = Path(out_dir)
    try:
        for case in cases:
            kind, *args = case.split(":")
            if kind == "grad":
                objective, loss_agg, order, forced = args
                placed = {g.split("=")[0]: int(g.split("=")[1]) for g in forced.split(",") if g}
                result = gradient_case(objective, loss_agg, int(order), placed)
            elif kind == "update":
                dtype = torch.bfloat16 if args[1] == "bf16" else torch.float32
                result = update_case(args[0], dtype)
            elif kind == "refusal":
                result = refusal_case()
            elif kind == "checkpoint":
                result = checkpoint_case(out)
            elif kind == "shared":
                dtype = torch.float64 if args[2] == "fp64" else torch.float32
                result = shared_case(int(args[0]), int(args[1]), dtype)
            elif kind == "opd_sharded":
                result = opd_sharded_case()
            elif kind == "shared_refusal":
                result = shared_refusal_case()
            elif kind == "sharded":
                result = sharded_case(args[0])
            elif kind == "load":
                result = load_case(out, torch.bfloat16 if args[0] == "bf16" else torch.float32)
            else:
                raise ValueError(f"unknown case {case!r}")
            torch.save(result, out / f"{case.replace(':', '_')}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()
