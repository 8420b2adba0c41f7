"""LoRA on two gloo learner ranks takes the one-process LoRA learner's step.

Two ranks are spawned once per module (torch.multiprocessing, gloo on 127.0.0.1, a 60 s
collective timeout) and run every case: each applies the same seeded adapters to the micro
model (B drawn non-zero, so the gradients with respect to A and to B are both dense),
streams its share of a GRPO batch (``stream_rank_share``: whole groups per rank) and takes
the barrier's step in a replicated or an FSDP2 state, in float32 or with a bfloat16 base.
This process compares them with the one-process LoRA learner and with a plainly written
reference (full forwards, one backward of the whole batch loss over the adapters).

Why a pass cannot be chance: a rank normalising by its own groups, a missed reduction or
adapters drawn differently on the two ranks move the gradient by O(1); a frozen base left
out of a checkpoint is caught because the resumed state starts from another base. Tolerances:
float32 1e-5 of the largest entry (per-source backwards and the cross-rank sum add in another
order than one backward: ~1e-6). bfloat16 base: against the float32 reference 5e-2 (8
mantissa bits, ~4e-3 per op; measured ~1e-2, as in ``tests/unit/test_mixed_precision.py``);
against the one-process bfloat16 LoRA learner 1e-5, since both run the same bfloat16
forwards and only the float32 sums differ in order (measured 6e-8).

The runtime on top: the one-process ``LearnerWorker`` with a bfloat16 base steps, publishes
and resumes; a Ray ``LearnerGroup`` of two fsdp2 ranks built from a config with
``policy.lora`` takes its step, and its checkpoint resumes in the one-process learner.
"""

from __future__ import annotations

import socket
import statistics
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests import dp_workers
from tests.helpers import rel_diff
from thundersync_core.batch import Trajectory
from thundersync_core.config import (
    LearnerResources,
    LoraConfig,
    PolicyConfig,
    ResourcesConfig,
    TrainConfig,
)
from thundersync_core.parallel.data_parallel import ShardedGradient, init_process_group
from thundersync_core.parallel.dcp import load_group_checkpoint, save_group_checkpoint
from thundersync_core.parallel.fsdp import (
    Sharding,
    TrainState,
    build_train_state,
    load_sharded_state,
    trainable_parameters,
)
from thundersync_core.policy import build_model
from thundersync_core.policy.io import load_model
from thundersync_core.policy.lora import LoraSettings, apply_lora
from thundersync_core.runtime.learner_group import LearnerGroup
from thundersync_core.runtime.learner_worker import LearnerWorker
from thundersync_core.runtime.placement import remote_role
from thundersync_core.streaming import StreamingGRPOLearner, StreamingOPDLearner, groups_of

pytestmark = pytest.mark.integration

WORLD = 2
TOLERANCE = 1e-5
BF16_TOLERANCE = 5e-2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SETTINGS = LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
#: Large enough that grad A (proportional to B) is far above rounding.
INIT_B_STD = 0.05
UPDATE_CASES = [f"update:{s}:{d}" for s in ("replicated", "fsdp2") for d in DTYPES]
CHECKPOINT_CASES = ["checkpoint:replicated:fp32", "checkpoint:fsdp2:bf16"]
OPD_CASES = ["opd:replicated", "opd:fsdp2"]
CASES = [*UPDATE_CASES, *CHECKPOINT_CASES, "load:bf16", "sharded:fp32", *OPD_CASES]


def lora_model(base_seed: int = 3, lora_seed: int = 5) -> torch.nn.Module:
    model = build_model("micro", seed=base_seed, dtype=torch.float32)
    return apply_lora(model, SETTINGS, seed=lora_seed, init_b_std=INIT_B_STD)


# -- the rank side (run in the spawned processes) ----------------------------------------------
def step(state: TrainState, batch: list[Trajectory], order_seed: int, sharded: bool = False):
    """One streamed GRPO step of this rank's share (the whole batch without a process group);
    returns the batch gradient of J, the clipped norm and the objective."""
    learner = StreamingGRPOLearner(state.model, max_open_groups=2)  # type: ignore[arg-type]
    if sharded:
        learner.sharded_grad = ShardedGradient(learner.params, dtype=learner.accum_dtype)
    sources = dp_workers.arrivals("grpo", batch, order_seed)
    if dist.is_initialized():
        dp_workers.stream_rank(learner, batch, sources)
    else:
        learner.begin_batch(groups_of(batch))
        for traj in sources:
            learner.submit(traj)
    result = learner.finish()
    grads = {k: v.clone() for k, v in result.grad_objective.items()}
    if sharded:
        norm = state.clip_shards(dp_workers.MAX_GRAD_NORM, result.grad_objective, -1.0)  # type: ignore[attr-defined]
    else:
        norm = state.clip(dp_workers.MAX_GRAD_NORM, result.grad_objective, -1.0)
    state.apply()
    return {"grads": grads, "norm": norm, "objective": result.objective}


def params_of(state: TrainState) -> dict[str, torch.Tensor]:
    """The replica's parameters (base and adapters) by name, as the learner runs them."""
    return {n: p.detach().clone() for n, p in state.model.named_parameters()}


def optimizer_state(state: TrainState) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state by parameter name, gathered whole (every rank calls)."""
    masters = dict(state.checkpoint_module().named_parameters())
    out = {}
    for name, param in masters.items():
        entries = state.optimizer.state.get(param, {})
        out[name] = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
            for k, v in entries.items()
        }
    return out


def update_case(sharding: Sharding, dtype: torch.dtype) -> dict[str, Any]:
    state = build_train_state(
        lora_model(), sharding=sharding, lr=dp_workers.LR, compute_dtype=dtype
    )
    result = step(state, dp_workers.grpo_batch(), 4)
    stepped = [p for group in state.optimizer.param_groups for p in group["params"]]
    result |= {
        "after": params_of(state),
        "published": {n: t.clone() for n, t in state.named_weights()},
        "optimizer_params": len(stepped),
        "optimizer_entries": sum(len(state.optimizer.state[p]) > 0 for p in stepped),
        "bytes": state.state_bytes(),
    }
    return result


def checkpoint_case(sharding: Sharding, dtype: torch.dtype, out: Path) -> dict[str, Any]:
    """Step on batch A, checkpoint, step on batch B (uninterrupted); then a state built from
    another base and other adapters resumes from the checkpoint and steps on batch B."""
    root = out / f"checkpoints-{sharding}"
    state = build_train_state(
        lora_model(), sharding=sharding, lr=dp_workers.LR, compute_dtype=dtype
    )
    step(state, dp_workers.grpo_batch(21), 1)
    save_group_checkpoint(
        root,
        step=1,
        state=state,
        policy_version=1,
        sharding=sharding,
        model_config=state.model.config,
    )
    at_checkpoint = params_of(state)
    optimizer_at_checkpoint = optimizer_state(state)
    uninterrupted = step(state, dp_workers.grpo_batch(22), 2)
    fresh = lora_model(base_seed=99, lora_seed=7)
    resumed = build_train_state(fresh, sharding=sharding, lr=dp_workers.LR, compute_dtype=dtype)
    load_group_checkpoint(
        root / "step-000001",
        module=resumed.checkpoint_module(),
        optimizer=resumed.optimizer,
    )
    resumed.refresh_replica()
    loaded = params_of(resumed)
    optimizer_loaded = optimizer_state(resumed)
    again = step(resumed, dp_workers.grpo_batch(22), 2)
    return {
        "at_checkpoint": at_checkpoint,
        "loaded": loaded,
        "optimizer_at_checkpoint": optimizer_at_checkpoint,
        "optimizer_loaded": optimizer_loaded,
        "uninterrupted": uninterrupted["grads"],
        "uninterrupted_after": params_of(state),
        "resumed": again["grads"],
        "resumed_after": params_of(resumed),
    }


def load_case(out: Path, dtype: torch.dtype) -> dict[str, Any]:
    """fsdp2 with LoRA built two ways from one float32 folder: rank 0 reading it alone
    (``load_sharded_state``) and every rank loading the model; then one step on each."""
    folder = out / "base-model"
    if dist.get_rank() == 0:
        build_model("micro", seed=5, dtype=torch.float32).save_pretrained(folder)
    dist.barrier()
    every = apply_lora(load_model(folder), SETTINGS, seed=5)
    states = {
        "every": build_train_state(every, sharding="fsdp2", lr=dp_workers.LR, compute_dtype=dtype),
        "rank0": load_sharded_state(
            folder, lr=dp_workers.LR, compute_dtype=dtype, lora=SETTINGS, lora_seed=5
        ),
    }
    result: dict[str, Any] = {}
    for how, state in states.items():
        result[f"{how}:before"] = params_of(state)
        step(state, dp_workers.grpo_batch(23), 1)
        result[f"{how}:after"] = params_of(state)
    return result


def sharded_case() -> dict[str, Any]:
    """fsdp2 float32 with the batch gradient sharded over the ranks, and with it whole."""
    result: dict[str, Any] = {}
    for how in ("whole", "sharded"):
        state = build_train_state(lora_model(), sharding="fsdp2", lr=dp_workers.LR)
        out = step(state, dp_workers.grpo_batch(31), 5, sharded=how == "sharded")
        result[how] = out | {"after": params_of(state)}
    return result


def opd_case(sharding: Sharding) -> dict[str, Any]:
    """One streamed OPD step (turns arriving interleaved, groups routed over the ranks) on
    the adapters, float32."""
    state = build_train_state(lora_model(), sharding=sharding, lr=dp_workers.LR)
    batch = dp_workers.opd_batch()
    learner = StreamingOPDLearner(state.model)
    dp_workers.stream_rank(learner, batch, dp_workers.arrivals("opd", batch, 2))
    result = learner.finish()
    grads = {k: v.clone() for k, v in result.grad_objective.items()}
    state.clip(dp_workers.MAX_GRAD_NORM, result.grad_objective, -1.0)
    state.apply()
    return {"grads": grads, "objective": result.objective, "after": params_of(state)}


def rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_process_group(
        "gloo", rank=rank, world_size=WORLD, address="127.0.0.1", port=port, timeout_s=60
    )
    out = Path(out_dir)
    try:
        for case in CASES:
            kind, *args = case.split(":")
            if kind == "update":
                result = update_case(cast(Sharding, args[0]), DTYPES[args[1]])
            elif kind == "checkpoint":
                result = checkpoint_case(cast(Sharding, args[0]), DTYPES[args[1]], out)
            elif kind == "load":
                result = load_case(out, DTYPES[args[0]])
            elif kind == "opd":
                result = opd_case(cast(Sharding, args[0]))
            else:
                result = sharded_case()
            torch.save(result, out / f"{case.replace(':', '_')}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# -- this process ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """{case: [rank 0 result, rank 1 result]} from one spawn of two gloo ranks, and the folder."""
    out = tmp_path_factory.mktemp("lora-ranks")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.start_processes(
        rank_main, args=(port, str(out)), nprocs=WORLD, join=False, start_method="spawn"
    )
    # join(timeout) returns False while ranks run; a failed rank raises here with its trace.
    for _ in range(24):
        if context.join(timeout=10):
            break
    else:
        for process in context.processes:
            process.kill()
        pytest.fail("the two learner ranks did not finish within 240 s")
    results = {
        case: [torch.load(out / f"{case.replace(':', '_')}-rank{r}.pt") for r in range(WORLD)]
        for case in CASES
    }
    return results, out


@pytest.fixture(scope="module")
def single():
    """The one-process LoRA learner's step in float32 and with a bfloat16 base (one thread,
    as the ranks run: the bfloat16 products then round alike)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name, dtype in DTYPES.items():
            state = build_train_state(
                lora_model(), sharding="replicated", lr=dp_workers.LR, compute_dtype=dtype
            )
            out[name] = step(state, dp_workers.grpo_batch(), 4) | {"after": params_of(state)}
        return out
    finally:
        torch.set_num_threads(threads)


def reference_grad_j(model: torch.nn.Module, batch: list[Trajectory]) -> dict[str, torch.Tensor]:
    """grad J over the adapters: J = (1/G) sum_g sum_i A_i S_i, the advantage from the group's
    mean and population std, full forwards and full-vocabulary log-softmax, one backward."""
    groups: dict[str, list[Trajectory]] = {}
    for traj in batch:
        groups.setdefault(traj.group_id, []).append(traj)
    objective = torch.zeros((), dtype=torch.float32)
    for members in groups.values():
        rewards = [t.reward for t in members]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        for traj in members:
            advantage = 0.0 if len(set(rewards)) == 1 else (traj.reward - mean) / (std + 1e-6)
            tokens = list(traj.prompt_ids) + [i for s in traj.segments for i in s.ids]
            scored = [False] * len(traj.prompt_ids) + [b for s in traj.segments for b in s.scored]
            logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), -1)
            total = sum(logp[pos - 1, tokens[pos]] for pos in range(1, len(tokens)) if scored[pos])
            objective = objective + advantage * total
    params = dict(trainable_parameters(model))
    grads = torch.autograd.grad(objective / len(groups), list(params.values()))
    return dict(zip(params, grads, strict=True))


@pytest.fixture(scope="module")
def reference():
    return reference_grad_j(lora_model(), dp_workers.grpo_batch())


def by_part(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, float]:
    """``rel_diff`` over the A tensors and over the B tensors (a wrong A part could hide under
    the larger B part of one global maximum)."""
    return {
        part: rel_diff(
            {n: t for n, t in ref.items() if f".{part}." in n},
            {n: t for n, t in got.items() if f".{part}." in n},
        )
        for part in ("lora_A", "lora_B")
    }


def clear_update_diff(
    ref: dict[str, torch.Tensor], start: dict, a: dict, b: dict
) -> tuple[float, float]:
    """(max difference of two updates, fraction compared) over the entries whose reference
    gradient is clear of zero: AdamW's first step is lr * g / (|g| + eps), so an entry within
    rounding of zero may move either way when sums change order."""
    largest = max(float(g.abs().max()) for g in ref.values())
    worst, compared, total = 0.0, 0, 0
    for name, grad in ref.items():
        clear = grad.abs() > 1e-4 * largest
        diff = ((a[name] - start[name]) - (b[name] - start[name]))[clear]
        worst = max(worst, float(diff.abs().max()))
        compared += int(clear.sum())
        total += grad.numel()
    return worst, compared / total


def test_fp32_ranks_take_the_one_process_and_the_reference_step(ranks, single, reference):
    results, _ = ranks
    start = {n: p.detach() for n, p in lora_model().named_parameters()}
    for sharding in ("replicated", "fsdp2"):
        rank0, rank1 = results[f"update:{sharding}:fp32"]
        for part, error in by_part(reference, rank0["grads"]).items():
            assert error <= TOLERANCE, (sharding, part, error)
        assert rel_diff(single["fp32"]["grads"], rank0["grads"]) <= TOLERANCE
        assert rank0["objective"] == pytest.approx(single["fp32"]["objective"], rel=TOLERANCE)
        assert rank0["norm"] == pytest.approx(single["fp32"]["norm"], rel=TOLERANCE)
        worst, share = clear_update_diff(reference, start, rank0["after"], single["fp32"]["after"])
        assert worst <= TOLERANCE * dp_workers.LR, sharding
        assert share > 0.9
        # The all-reduce hands both ranks one gradient: one update, bit for bit.
        for name, value in rank0["after"].items():
            assert torch.equal(value, rank1["after"][name]), (sharding, name)
        # Only the adapters move, and only they have optimizer state.
        for name, value in rank0["after"].items():
            assert torch.equal(value, start[name]) == (".lora_" not in name), name
        assert rank0["optimizer_params"] == rank0["optimizer_entries"] == len(reference)


def test_fsdp2_shards_only_the_adapters_master(ranks):
    """The frozen base needs no master: fsdp2's extra bytes over the replica are the
    adapters' float32 master shards, half the adapters on each of two ranks."""
    results, _ = ranks
    adapters = sum(p.numel() for _, p in trainable_parameters(lora_model()))
    replica = sum(p.numel() * 4 for p in lora_model().parameters())
    for rank in results["update:fsdp2:fp32"]:
        held = rank["bytes"]["params"] - replica
        assert held == pytest.approx(adapters * 4 / WORLD, rel=0.05), held


def test_bf16_base_ranks_take_the_one_process_bf16_step(ranks, single, reference):
    results, _ = ranks
    for sharding in ("replicated", "fsdp2"):
        rank0, rank1 = results[f"update:{sharding}:bf16"]
        dtypes = {("lora" in n, p.dtype) for n, p in rank0["after"].items()}
        assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
        assert {g.dtype for g in rank0["grads"].values()} == {torch.float32}
        assert rel_diff(single["bf16"]["grads"], rank0["grads"]) <= TOLERANCE, sharding
        errors = by_part(reference, rank0["grads"])
        assert all(0 < e <= BF16_TOLERANCE for e in errors.values()), (sharding, errors)
        for name, value in rank0["after"].items():
            assert torch.equal(value, rank1["after"][name]), (sharding, name)


def test_publication_is_the_merged_plain_model(ranks):
    """Both layouts publish the plain model's names with the adapters merged (W + s B A),
    the same weights; the frozen base as it is."""
    results, _ = ranks
    plain = build_model("micro", seed=3, dtype=torch.float32)
    names = {n for n, _ in plain.named_parameters()}
    for dtype in DTYPES:
        replicated = results[f"update:replicated:{dtype}"][0]["published"]
        sharded = results[f"update:fsdp2:{dtype}"][0]["published"]
        assert replicated.keys() == sharded.keys() == names
        assert rel_diff(replicated, sharded) <= TOLERANCE
        after = results[f"update:fsdp2:{dtype}"][0]["after"]
        layer = "model.layers.0.self_attn.q_proj"
        a, b = after[f"{layer}.lora_A.default.weight"], after[f"{layer}.lora_B.default.weight"]
        base = after[f"{layer}.base_layer.weight"]
        merged = (base.float() + SETTINGS.scaling * (b @ a)).to(base.dtype)
        assert torch.equal(sharded[f"{layer}.weight"], merged), dtype
        k_proj = "model.layers.0.self_attn.k_proj.weight"  # not adapted: the base as it is
        assert torch.equal(sharded[k_proj], after[k_proj])


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_group_checkpoint_resumes_bitwise(ranks, case):
    """A state from another base and other adapters, resumed, holds the checkpoint's base,
    adapters and AdamW state bit for bit and takes the uninterrupted step bit for bit."""
    results, out = ranks
    for rank in results[case]:
        for name, value in rank["at_checkpoint"].items():
            assert torch.equal(rank["loaded"][name], value), name
        for name, entries in rank["optimizer_at_checkpoint"].items():
            for key, value in entries.items():
                assert torch.equal(rank["optimizer_loaded"][name][key], value), (name, key)
        assert rel_diff(rank["uninterrupted"], rank["resumed"]) == 0.0
        for name, value in rank["uninterrupted_after"].items():
            assert torch.equal(rank["resumed_after"][name], value), name
    folder = out / f"checkpoints-{case.split(':')[1]}" / "step-000001"
    adapter = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
    at_checkpoint = results[case][0]["at_checkpoint"]
    assert len(adapter) == sum(".lora_" in n for n in at_checkpoint)
    exported = load_file(str(folder / "model" / "model.safetensors"))
    assert not any(".lora_" in k or ".base_layer." in k for k in exported)


def test_fsdp2_group_checkpoint_resumes_in_one_process(ranks):
    """The two-rank bfloat16 fsdp2 checkpoint loads into the one-process bfloat16 LoRA
    learner: the same base, adapters and AdamW state, and the next gradient within 1e-5."""
    results, out = ranks
    expected = results["checkpoint:fsdp2:bf16"][0]
    state = build_train_state(
        lora_model(base_seed=99, lora_seed=7),
        sharding="replicated",
        lr=dp_workers.LR,
        compute_dtype=torch.bfloat16,
    )
    load_group_checkpoint(
        out / "checkpoints-fsdp2" / "step-000001",
        module=state.checkpoint_module(),
        optimizer=state.optimizer,
    )
    for name, value in params_of(state).items():
        assert torch.equal(value, expected["at_checkpoint"][name]), name
    for name, entries in optimizer_state(state).items():
        for key, value in entries.items():
            assert torch.equal(value, expected["optimizer_at_checkpoint"][name][key]), name
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        again = step(state, dp_workers.grpo_batch(22), 2)
    finally:
        torch.set_num_threads(threads)
    assert rel_diff(expected["uninterrupted"], again["grads"]) <= TOLERANCE


def test_rank_0_reads_the_base_and_every_rank_draws_the_same_adapters(ranks):
    results, _ = ranks
    for rank in results["load:bf16"]:
        for part in ("before", "after"):
            every, rank0 = rank[f"every:{part}"], rank[f"rank0:{part}"]
            assert every.keys() == rank0.keys()
            for name, value in every.items():
                assert torch.equal(value, rank0[name]), (part, name)
        assert {p.dtype for n, p in rank["rank0:before"].items() if ".lora_" not in n} == {
            torch.bfloat16
        }
    before, after = results["load:bf16"][0]["rank0:before"], results["load:bf16"][0]["rank0:after"]
    assert any(not torch.equal(before[n], after[n]) for n in before if ".lora_B." in n)


def test_sharded_batch_gradient_of_the_adapters(ranks):
    """``learner_sharded_gradient`` with LoRA: each rank holds its rows of each adapter's
    gradient; stacked they are the whole accumulators' gradient, and the update is the same."""
    results, _ = ranks
    per_rank = [r["sharded"] for r in results["sharded:fp32"]]
    whole = results["sharded:fp32"][0]["whole"]
    stacked = {
        name: torch.cat([r["grads"][name] for r in per_rank], dim=0) for name in whole["grads"]
    }
    assert rel_diff(whole["grads"], stacked) <= TOLERANCE
    start = {n: p.detach() for n, p in lora_model().named_parameters()}
    for r in per_rank:
        assert r["norm"] == pytest.approx(whole["norm"], rel=TOLERANCE)
        worst, share = clear_update_diff(whole["grads"], start, whole["after"], r["after"])
        assert worst <= TOLERANCE * dp_workers.LR
        assert share > 0.9


def test_config_accepts_lora_on_ranks_and_bfloat16():
    shardings: tuple[Sharding, ...] = ("replicated", "fsdp2")
    for sharding in shardings:
        config = TrainConfig(
            learner_sharding=sharding,
            learner_dtype="bfloat16",
            policy=PolicyConfig(lora=LoraConfig(r=4, alpha=8.0)),
            resources=ResourcesConfig(learner=LearnerResources(ranks=2)),
        )
        assert config.policy.lora is not None


# -- the runtime: LearnerWorker (one process) and LearnerGroup (Ray ranks) ----------------------
def lora_config(ranks: int, dtype: str = "float32") -> TrainConfig:
    learner = LearnerResources(num_cpus=1.0, cores=(), ranks=ranks)
    lora = LoraConfig(r=SETTINGS.r, alpha=SETTINGS.alpha, target_modules=SETTINGS.target_modules)
    return TrainConfig(
        objective="grpo",
        schedule="thundersync",
        loss_agg="seq-sum",
        lr=dp_workers.LR,
        max_open_groups=2,
        learner_sharding="fsdp2" if ranks > 1 else "replicated",
        learner_dtype=dtype,  # type: ignore[arg-type]
        policy=PolicyConfig(lora=lora),
        resources=ResourcesConfig(learner=learner, learner_peak_flops=1e9),
    )


def groups_spec(batch: list[Trajectory]) -> dict[str, tuple[tuple[int, ...], int]]:
    return {g: (spec.prompt_ids, spec.size) for g, spec in groups_of(batch).items()}


def test_one_rank_bf16_lora_learner_steps_checkpoints_and_resumes(micro_model_dir, tmp_path):
    """The one-process learner with a bfloat16 base: only the float32 adapters move, the
    published weights are the merged plain model, and a checkpoint resumes bit for bit."""
    batch = dp_workers.grpo_batch()
    worker = LearnerWorker(micro_model_dir, lora_config(1, "bfloat16"), publish_dir=tmp_path / "a")
    base = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    worker.begin(groups_spec(batch))
    for traj in batch:
        worker.submit(traj, None)
    record = worker.step(0)
    assert record["grad_norm"] > 0
    for name, param in worker.model.named_parameters():
        assert torch.equal(param, base[name]) == (".lora_" not in name), name
        assert param.dtype == (torch.float32 if ".lora_" in name else torch.bfloat16), name
    published = load_file(record["weights"])
    assert published.keys() == load_file(str(micro_model_dir / "model.safetensors")).keys()
    path = worker.save_checkpoint(str(tmp_path / "ckpt"), 1, {})
    resumed = LearnerWorker(
        micro_model_dir,
        lora_config(1, "bfloat16"),
        publish_dir=tmp_path / "b",
        resume_from=Path(path),
    )
    assert resumed.version() == 1
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, dict(worker.model.named_parameters())[name]), name


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def test_lora_learner_group_takes_the_one_process_step(ray_session, micro_model_dir, tmp_path):
    """Two fsdp2 ``LearnerRank`` actors, each applying the run's adapters (B = 0, A seeded
    by the run's seed), take the one-process LoRA learner's step; the group's checkpoint
    (DCP, with adapter/) resumes in the one-process learner with the group's weights."""
    ray = ray_session
    batch = dp_workers.grpo_batch(17)
    single = LearnerWorker(micro_model_dir, lora_config(1), publish_dir=tmp_path / "single")
    start = {n: p.detach().clone() for n, p in single.model.named_parameters()}
    reference = reference_grad_j(single.model, batch)
    single.begin(groups_spec(batch))
    for traj in batch:
        single.submit(traj, None)
    expected = single.step(0)

    config = lora_config(2)
    role = config.resources.learner.model_copy(update={"num_cpus": 0.0})
    group = remote_role(LearnerGroup, role).remote(
        micro_model_dir, config, publish_dir=tmp_path / "group", timeout_s=60.0
    )
    try:  # killed passed or failed: a live group holds its ranks' CPUs for later tests
        assert ray.get(group.begin.remote(groups_spec(batch))) == 0
        for traj in reversed(batch):
            group.submit.remote(traj, None)
        got = ray.get(group.step.remote(0), timeout=120)
        path = ray.get(group.save_checkpoint.remote(str(tmp_path / "ckpt"), 1, {}), timeout=120)
    finally:
        ray.kill(group)
    assert got["loss"] == pytest.approx(expected["loss"], rel=TOLERANCE)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=TOLERANCE)

    resumed = LearnerWorker(
        micro_model_dir, lora_config(1), publish_dir=tmp_path / "resumed", resume_from=Path(path)
    )
    assert resumed.version() == 1
    after_group = {n: p.detach() for n, p in resumed.model.named_parameters()}
    after_single = {n: p.detach() for n, p in single.model.named_parameters()}
    # With B = 0 the gradient of A is exactly zero: A and the base are as the single
    # learner left them, bit for bit; B moved as the single learner's did.
    for name, value in after_single.items():
        if ".lora_B." not in name:
            assert torch.equal(after_group[name], value), name
    b_grads = {n: g for n, g in reference.items() if ".lora_B." in n}
    worst, share = clear_update_diff(b_grads, start, after_group, after_single)
    assert worst <= TOLERANCE * dp_workers.LR
    assert share > 0.9
    assert load_file(got["weights"]).keys() == load_file(expected["weights"]).keys()
    adapter = Path(path) / "adapter" / "adapter_config.json"
    assert adapter.is_file()


def reference_grad_l(model: torch.nn.Module, batch: list[Trajectory]) -> dict[str, torch.Tensor]:
    """grad L over the adapters: L = (1/N) sum_t sg(log pi_t - q_t) log pi_t over the N
    scored tokens of the batch, full forwards, one backward."""
    total = torch.zeros((), dtype=torch.float32)
    n_tokens = 0
    for traj in batch:
        tokens = list(traj.prompt_ids) + [i for s in traj.segments for i in s.ids]
        scored = [False] * len(traj.prompt_ids) + [b for s in traj.segments for b in s.scored]
        logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), -1)
        student = [logp[pos - 1, tokens[pos]] for pos in range(1, len(tokens)) if scored[pos]]
        assert traj.teacher_logprobs is not None
        for lp, q in zip(student, traj.teacher_logprobs, strict=True):
            total = total + (lp.detach() - q) * lp
        n_tokens += len(student)
    params = dict(trainable_parameters(model))
    grads = torch.autograd.grad(total / n_tokens, list(params.values()))
    return dict(zip(params, grads, strict=True))


def test_streamed_opd_on_ranks_takes_the_reference_adapter_gradient(ranks):
    """OPD's turns stream over two ranks (replicated and fsdp2): the reduced adapter gradient
    is the one-backward reference's, and both ranks take one update."""
    results, _ = ranks
    reference = reference_grad_l(lora_model(), dp_workers.opd_batch())
    start = {n: p.detach() for n, p in lora_model().named_parameters()}
    for case in OPD_CASES:
        rank0, rank1 = results[case]
        assert rank0["grads"].keys() == reference.keys()
        for part, error in by_part(reference, rank0["grads"]).items():
            assert error <= TOLERANCE, (case, part, error)
        for name, value in rank0["after"].items():
            assert torch.equal(value, rank1["after"][name]), (case, name)
            assert torch.equal(value, start[name]) == (".lora_" not in name), (case, name)
