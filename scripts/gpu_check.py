"""One prepared check of the learner and rollout paths on CUDA; it runs on a CPU too.

    python scripts/gpu_check.py [--out runs/gpu_check] [--no-vllm] [--bench-repeats 3]

Each section reports ``ok`` (true, false, or null when skipped, with ``skipped`` saying why)
and what it measured; one JSON summary is printed last and written to ``OUT/summary.json``.
The device is CUDA when one is visible, else the CPU (CI runs it there).

1. ``learner``: one process on the device. Streaming GRPO in float32 against an independent
   float64 reference (the plain batch loss, one backward): max relative error <= 1e-5.
   bfloat16 compute beside a float32 master (``MixedPrecisionState``, the one-rank bf16
   learner): relative error <= 5e-2 against the same reference, and the master's gradient
   bitwise the learner's float32 accumulator.
   ``worker``: the learner role's class (``LearnerWorker``) on the device with bfloat16
   compute takes a step and publishes the float32 master.
2. ``ranks``: W ranks (min(2, GPUs) with NCCL; 2 with gloo on the CPU) stream the batch
   through the data-parallel barrier: the float32 gradient against the reference (1e-5);
   then FSDP2 with bfloat16 compute takes one full step (clip, sharded AdamW, replica
   refresh, publication) whose master gradient is bounded like the one-process bf16 one;
   step seconds and peak CUDA memory per rank. Last, FSDP2 state loaded with rank 0
   reading the weights and the batch gradient sharded over the ranks (reduce-scattered):
   its master gradient against the reference (1e-5), and the bytes each rank holds.
3. ``vllm``: where vLLM is installed: the engine loads the policy and generates, the
   learner's step is published (file), the engine reloads it and generates again, and the
   engine's log-probs of what it sampled are compared with the learner's own on the
   published weights (float32 engine: 1e-4; bfloat16: mean |diff| <= 0.05 nats).
4. ``schedule``: the learner's side of sync against thundersync at balance on the device.
   Rewards land in waves spread over a rollout stage as long as the best sync learner's
   busy time (rho = 1); sync's step is that stage plus its learner, thundersync's ends when
   its learner has consumed the last wave. The release trace is synthetic (no engine is
   involved), the learner work is real. It passes when the two updates are bitwise equal;
   the speedup and tail are reported, not judged.

Exit status: 0 when every section that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 5e-2
#: Engine vs learner log-probs: float32 engines agree to rounding; a bfloat16 engine's
#: logits carry ~3 significant digits.
LOGPROB_ATOL_FP32 = 1e-4
LOGPROB_MEAN_BF16 = 5e-2
#: The schedule section's model on CUDA: big enough that the learner is not launch-bound.
GPU_BENCH_MODEL = {
    "hidden_size": 1536,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "intermediate_size": 4096,
    "vocab_size": 32000,
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _device() -> str:
    import torch  # noqa: PLC0415

    return "cuda" if torch.cuda.is_available() else "cpu"


def _batch() -> list[Any]:
    from tests.helpers import random_batch  # noqa: PLC0415

    return random_batch(seed=11, vocab=1024, n_groups=4, group_size=3)


def _reference(policy_dir: Path) -> dict[str, Any]:
    """grad J of the batch by the plain float64 recipe, on the CPU (independent of the
    device under test)."""
    import torch  # noqa: PLC0415

    from tests.helpers import reference_grad_j  # noqa: PLC0415
    from thundersync_core.policy.io import load_model  # noqa: PLC0415

    model = load_model(policy_dir).to(torch.float64)  # type: ignore[arg-type]
    return reference_grad_j(model, _batch())[1]


def _error(reference: dict[str, Any], grads: dict[str, Any]) -> float:
    from tests.helpers import rel_diff  # noqa: PLC0415

    return rel_diff(reference, {n: g.detach().cpu() for n, g in grads.items()})


def _stream(model: Any, batch: list[Any]) -> Any:
    from thundersync_core.streaming import StreamingGRPOLearner, groups_of  # noqa: PLC0415

    learner = StreamingGRPOLearner(model, max_open_groups=2)
    learner.begin_batch(groups_of(batch))
    for traj in batch:
        learner.submit(traj)
    return learner.finish()


def check_learner(policy_dir: Path, device: str) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    from thundersync_core.parallel.fsdp import build_train_state  # noqa: PLC0415
    from thundersync_core.policy.io import load_model  # noqa: PLC0415

    reference = _reference(policy_dir)
    fp32 = _stream(load_model(policy_dir).to(device), _batch())  # type: ignore[arg-type]
    fp32_error = _error(reference, fp32.grad_objective)
    master = load_model(policy_dir).to(device)  # type: ignore[arg-type]
    state = build_train_state(
        master, sharding="replicated", lr=1e-5, device_type=device, compute_dtype=torch.bfloat16
    )
    result = _stream(state.model, _batch())
    state.clip(1e9, result.grad_objective, -1.0)
    grads = {n: -p.grad for n, p in master.named_parameters()}
    bitwise = all(torch.equal(grads[n], result.grad_objective[n]) for n in grads)
    bf16_error = _error(reference, grads)
    return {
        "ok": fp32_error <= FP32_TOLERANCE and 0 < bf16_error <= BF16_TOLERANCE and bitwise,
        "fp32_rel_error": fp32_error,
        "bf16_rel_error": bf16_error,
        "bf16_master_grad_is_fp32_accumulator": bitwise,
        "tolerances": {"fp32": FP32_TOLERANCE, "bf16": BF16_TOLERANCE},
    }


def check_worker(policy_dir: Path, out: Path, device: str) -> dict[str, Any]:
    """The learner role's own class at one rank, bfloat16 compute, on the device: a step,
    its publication (the float32 master), and the step record's memory figures."""
    import torch  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    from thundersync_core.config import LearnerResources, ResourcesConfig, TrainConfig  # noqa: PLC0415
    from thundersync_core.runtime.learner_worker import LearnerWorker  # noqa: PLC0415
    from thundersync_core.streaming import groups_of  # noqa: PLC0415

    config = TrainConfig(
        objective="grpo",
        schedule="thundersync",
        learner_dtype="bfloat16",
        max_open_groups=2,
        resources=ResourcesConfig(
            learner=LearnerResources(num_gpus=1.0 if device == "cuda" else 0.0, cores=()),
        ),
    )
    worker = LearnerWorker(policy_dir, config, publish_dir=out / "worker-publish")
    batch = _batch()
    worker.begin({g: (s.prompt_ids, s.size) for g, s in groups_of(batch).items()})
    for traj in batch:
        worker.submit(traj, None)
    record = worker.step(0)
    published = load_file(record["weights"])
    master = dict(worker.state.checkpoint_module().named_parameters())
    equal = all(torch.equal(t, master[n].detach().cpu()) for n, t in published.items())
    replica = {str(p.device.type) + ":" + str(p.dtype) for p in worker.model.parameters()}
    return {
        "ok": equal and {t.dtype for t in published.values()} == {torch.float32},
        "replica": sorted(replica),
        "published_is_master_fp32": equal,
        "grad_norm": record["grad_norm"],
        "peak_flops": record["peak_flops"],
        "peak_cuda_bytes": record.get("peak_cuda_bytes"),
    }


def _rank(rank: int, world: int, port: int, policy_dir: str, out_dir: str) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from thundersync_core.parallel.data_parallel import (  # noqa: PLC0415
        init_process_group,
        stream_rank_share,
    )
    from thundersync_core.parallel.fsdp import build_train_state  # noqa: PLC0415
    from thundersync_core.policy.io import load_model  # noqa: PLC0415
    from thundersync_core.streaming import StreamingGRPOLearner, groups_of  # noqa: PLC0415

    device = _device()
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    init_process_group(
        "nccl" if device == "cuda" else "gloo",
        rank=rank,
        world_size=world,
        address="127.0.0.1",
        port=port,
        timeout_s=120,
    )
    batch = _batch()
    result: dict[str, Any] = {"rank": rank}
    reference = _reference(Path(policy_dir)) if rank == 0 else None

    learner = StreamingGRPOLearner(load_model(policy_dir).to(device), max_open_groups=2)  # type: ignore[arg-type]
    stream_rank_share(learner, batch, groups_of(batch), rank=rank, world_size=world)
    grads = learner.finish().grad_objective
    if reference is not None:
        result["fp32_rel_error"] = _error(reference, grads)

    master = load_model(policy_dir).to(device)  # type: ignore[arg-type]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    state = build_train_state(
        master, sharding="fsdp2", lr=1e-5, device_type=device, compute_dtype=torch.bfloat16
    )
    learner = StreamingGRPOLearner(state.model, max_open_groups=2)  # type: ignore[arg-type]
    start = time.perf_counter()
    stream_rank_share(learner, batch, groups_of(batch), rank=rank, world_size=world)
    step = learner.finish()
    state.clip(1e9, step.grad_objective, -1.0)
    gathered = {
        name: -p.grad.full_tensor()  # type: ignore[union-attr]
        for name, p in state.checkpoint_module().named_parameters()
    }
    state.apply()
    published = Path(out_dir) / "fsdp2-published.safetensors"
    state.write_weights(published)
    if device == "cuda":
        torch.cuda.synchronize()
        result["fsdp2_peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    result["fsdp2_step_s"] = time.perf_counter() - start
    if reference is not None:
        result["fsdp2_bf16_rel_error"] = _error(reference, gathered)

    result |= _sharded_gradient_step(Path(policy_dir), batch, device, reference)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _sharded_gradient_step(
    policy_dir: Path, batch: list[Any], device: str, reference: Any
) -> dict[str, Any]:
    """Rank 0 reads the weights, every rank keeps its shard; the batch gradient is sharded
    over the ranks (reduce-scattered after each group) and becomes the master's gradient."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from thundersync_core.parallel.data_parallel import (  # noqa: PLC0415
        ShardedGradient,
        stream_rank_share,
    )
    from thundersync_core.parallel.fsdp import load_sharded_state  # noqa: PLC0415
    from thundersync_core.streaming import StreamingGRPOLearner, groups_of  # noqa: PLC0415

    state = load_sharded_state(policy_dir, lr=1e-5, device=device)
    learner = StreamingGRPOLearner(state.model, max_open_groups=2)  # type: ignore[arg-type]
    learner.sharded_grad = ShardedGradient(learner.params, dtype=torch.float32)
    rank, world = dist.get_rank(), dist.get_world_size()
    stream_rank_share(learner, batch, groups_of(batch), rank=rank, world_size=world)
    step = learner.finish()
    result: dict[str, Any] = {"sharded_grad_bytes": learner.accumulator_bytes()}
    state.clip_shards(1e9, step.grad_objective, -1.0)
    gathered = {
        name: -p.grad.full_tensor()  # type: ignore[union-attr]
        for name, p in state.checkpoint_module().named_parameters()
    }
    if reference is not None:
        result["sharded_grad_rel_error"] = _error(reference, gathered)
    return result


def check_ranks(policy_dir: Path, out: Path, device: str) -> dict[str, Any]:
    import torch  # noqa: PLC0415
    import torch.multiprocessing as mp  # noqa: PLC0415

    world = min(2, torch.cuda.device_count()) if device == "cuda" else 2
    mp.spawn(_rank, args=(world, _free_port(), str(policy_dir), str(out)), nprocs=world)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    first = ranks[0]
    return {
        "ok": first["fp32_rel_error"] <= FP32_TOLERANCE
        and 0 < first["fsdp2_bf16_rel_error"] <= BF16_TOLERANCE
        and first["sharded_grad_rel_error"] <= FP32_TOLERANCE,
        "world_size": world,
        "backend": "nccl" if device == "cuda" else "gloo",
        "ranks": ranks,
    }


def _logprob_gaps(model: Any, requests: list[Any], results: list[Any]) -> Any:
    """|learner - engine| log-prob of every token the engine sampled, the learner's on its
    current weights."""
    import torch  # noqa: PLC0415

    from thundersync_core.policy import scored_logprobs  # noqa: PLC0415

    diffs = []
    for request, result in zip(requests, results, strict=True):
        ids = list(request.prompt_ids) + list(result.token_ids)
        scored = [False] * len(request.prompt_ids) + [True] * len(result.token_ids)
        with torch.no_grad():
            ours, _ = scored_logprobs(model, torch.tensor([ids]), torch.tensor([scored]))
        diffs.append((ours - torch.tensor(result.logprobs, dtype=ours.dtype)).abs())
    return torch.cat(diffs)


def check_vllm(policy_dir: Path, out: Path, device: str) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    from thundersync_core.policy import load_model  # noqa: PLC0415
    from thundersync_core.rollout.engine import GenerationRequest, SamplingConfig  # noqa: PLC0415
    from thundersync_core.rollout.vllm_engine import VLLMEngine, vllm_available  # noqa: PLC0415
    from thundersync_core.streaming import SyncGRPOLearner, groups_of  # noqa: PLC0415

    if not vllm_available():
        return {"ok": None, "skipped": "vLLM is not installed here"}
    dtype = "bfloat16" if device == "cuda" else "float32"
    start = time.perf_counter()
    extra = {"gpu_memory_utilization": 0.3} if device == "cuda" else {}
    engine = VLLMEngine(policy_dir, dtype=dtype, max_model_len=512, **extra)  # type: ignore[arg-type]
    requests = [
        GenerationRequest(f"r{i}", tuple(range(3 + i, 20 + i)), 12, seed=i) for i in range(4)
    ]
    sampling = SamplingConfig()
    model = load_model(policy_dir)

    def worst(results: list[Any]) -> tuple[float, float]:
        gaps = _logprob_gaps(model, requests, results)
        return float(gaps.max()), float(gaps.mean())

    try:
        before = engine.generate(requests, sampling)
        agree_before = worst(before)
        from thundersync_core.batch import Segment, Trajectory  # noqa: PLC0415

        batch = [
            Trajectory(
                "g",
                r.request_id,
                requests[0].prompt_ids[:3],
                (Segment.action(o.token_ids),),
                float(i),
            )
            for i, (r, o) in enumerate(zip(requests, before, strict=True))
        ]
        learner = SyncGRPOLearner(model)
        learner.begin_batch(groups_of(batch))
        for traj in batch:
            learner.submit(traj)
        learner.step(torch.optim.SGD(model.parameters(), lr=0.02))
        published = out / "vllm-published.safetensors"
        from safetensors.torch import save_file  # noqa: PLC0415

        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(published))
        moved = float(_logprob_gaps(model, requests, before).mean())
        engine.load_weights(published, version=1)
        after = engine.generate(requests, sampling)
        agree_after = worst(after)
    finally:
        engine.close()
    versions = sorted({r.policy_version for r in after})
    # The step must move log-probs well past the tolerance, or a stale engine would pass.
    if dtype == "float32":
        ok = max(agree_before[0], agree_after[0]) <= LOGPROB_ATOL_FP32 < moved / 10
    else:
        ok = max(agree_before[1], agree_after[1]) <= LOGPROB_MEAN_BF16 < moved / 2
    return {
        "ok": ok and versions == [1],
        "dtype": dtype,
        "publication": "file",
        "logprob_max_mean_diff_before": agree_before,
        "logprob_max_mean_diff_after": agree_after,
        "versions_after": versions,
        "step_moved_logprobs_mean": moved,
        "seconds": time.perf_counter() - start,
    }


def _bench_batch(rng: random.Random, vocab: int, groups: int, size: int, on_gpu: bool) -> list[Any]:
    """Groups of two-turn trajectories (action, observation, action) with shared prompts."""
    from thundersync_core.batch import Segment, Trajectory  # noqa: PLC0415

    prompt_tokens, action_tokens = (512, 384) if on_gpu else (32, 24)

    def action() -> Segment:
        n = rng.randint(action_tokens // 2, action_tokens)
        return Segment.action([rng.randrange(vocab) for _ in range(n)])

    batch = []
    for g in range(groups):
        prompt = tuple(rng.randrange(vocab) for _ in range(prompt_tokens))
        for i in range(size):
            observation = Segment.observation([rng.randrange(vocab) for _ in range(64)])
            segments = (action(), observation, action())
            batch.append(Trajectory(f"g{g}", f"g{g}-{i:02d}", prompt, segments, rng.random()))
    return batch


def _release_waves(rng: random.Random, batch: list[Any], size: int) -> dict[str, list[Any]]:
    """Two release orders in waves of ``size``: members of a group land at random times
    (groups close late), or close together (siblings of one task take similar times, so
    groups close throughout the stage)."""
    shuffled = rng.sample(batch, len(batch))
    jitter = {t.trajectory_id: int(t.group_id[1:]) + 3 * rng.random() for t in batch}
    traces = {"random": shuffled, "grouped": sorted(batch, key=lambda t: jitter[t.trajectory_id])}
    return {k: [v[i : i + size] for i in range(0, len(v), size)] for k, v in traces.items()}


def _sync(on_gpu: bool) -> None:
    import torch  # noqa: PLC0415

    if on_gpu:
        torch.cuda.synchronize()


def check_schedule(device: str, repeats: int) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    from thundersync_core.policy import build_model  # noqa: PLC0415
    from thundersync_core.replay import relative_difference  # noqa: PLC0415
    from thundersync_core.streaming import StreamingGRPOLearner, groups_of  # noqa: PLC0415

    on_gpu = device == "cuda"
    model = build_model(
        "micro",
        seed=0,
        dtype=torch.bfloat16 if on_gpu else torch.float32,
        **(GPU_BENCH_MODEL if on_gpu else {}),
    ).to(device)  # type: ignore[arg-type]
    groups, size = (16, 8) if on_gpu else (4, 4)
    rng = random.Random(0)
    batch = _bench_batch(rng, model.config.vocab_size, groups, size, on_gpu)
    specs = groups_of(batch)
    ordered = sorted(batch, key=lambda t: t.trajectory_id)
    waves = _release_waves(rng, batch, size)
    traces = list(waves)

    def run(sources: list[list[Any]], releases: list[float] | None, order: str) -> Any:
        """(busy s, wall from the stage's start, result); waves wait for their release."""
        learner = StreamingGRPOLearner(model, max_open_groups=groups, order=order)  # type: ignore[arg-type]
        learner.begin_batch(specs)
        busy, t0 = 0.0, time.perf_counter()
        for k, sources_k in enumerate(sources):
            if releases is not None:
                time.sleep(max(0.0, releases[k] - (time.perf_counter() - t0)))
            s = time.perf_counter()
            learner.submit_many(sources_k, pack_tokens=8192)
            _sync(on_gpu)
            busy += time.perf_counter() - s
        s = time.perf_counter()
        result = learner.finish()
        _sync(on_gpu)
        busy += time.perf_counter() - s
        model.zero_grad(set_to_none=True)
        return busy, time.perf_counter() - t0, result

    run([ordered], None, "fixed")  # warm-up: kernels and the allocator
    sync_busy = statistics.median(run([ordered], None, "fixed")[0] for _ in range(repeats))
    stage = sync_busy  # balance: the rollout stage as long as sync's learner
    releases = [stage * (k + 1) / len(waves["random"]) for k in range(len(waves["random"]))]
    steps: dict[str, list[float]] = {"sync": [], **{k: [] for k in traces}}
    bitwise = {"sync_repeat": True, **dict.fromkeys(traces, True)}
    diff = dict.fromkeys(traces, 0.0)
    first = None
    for _ in range(repeats):
        busy, _, reference = run([ordered], None, "fixed")
        steps["sync"].append(stage + busy)
        want = reference.grad_objective
        first = first or want
        bitwise["sync_repeat"] &= all(torch.equal(first[n], want[n]) for n in want)
        for trace in traces:
            _, wall, result = run(waves[trace], releases, "fixed")
            steps[trace].append(wall)
            got = result.grad_objective
            bitwise[trace] &= all(torch.equal(got[n], want[n]) for n in want)
            diff[trace] = max(diff[trace], relative_difference(want, got))
    median = {k: statistics.median(v) for k, v in steps.items()}
    return {
        # Speedup and tail are measurements, not pass marks; the check is the update: the
        # same as sync's within bfloat16 rounding (bitwise where kernels allow, reported).
        "ok": max(diff.values()) <= BF16_TOLERANCE,
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "deterministic_kernels": torch.are_deterministic_algorithms_enabled(),
        "learner": "packed, fixed order (learner_pack_tokens 8192)",
        "batch": {"groups": groups, "group_size": size, "waves": len(releases)},
        "release_traces": "synthetic, waves evenly over a stage of sync's learner time: "
        "random (a group closes late) and grouped (siblings land together)",
        "sync_learner_busy_s": sync_busy,
        "step_s": median,
        "speedup": {k: median["sync"] / median[k] for k in traces},
        "tail_over_sync_learner": {k: (median[k] - stage) / sync_busy for k in traces},
        "bitwise_equal_to_sync": bitwise,
        "rel_diff_to_sync": diff,
        "repeats": repeats,
    }


def _section(name: str, run: Any) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        result = run()
    except Exception as exc:  # a check that crashes failed; the others still run
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    result["section_s"] = round(time.perf_counter() - start, 2)
    print(f"[gpu_check] {name}: ok={result['ok']} ({result['section_s']} s)", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check"))
    parser.add_argument("--no-vllm", action="store_true", help="skip the engine section")
    parser.add_argument("--bench-repeats", type=int, default=3)
    args = parser.parse_args()
    import torch  # noqa: PLC0415

    from thundersync_core.policy import build_model, build_tokenizer, save_policy  # noqa: PLC0415

    device = _device()
    if device == "cuda":
        # Bitwise comparisons need deterministic kernels (the embedding's backward adds
        # with atomics otherwise; cuBLAS needs this workspace setting), and attention's
        # fused backward kernels have none: the math kernel is used instead.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    args.out.mkdir(parents=True, exist_ok=True)
    policy_dir = args.out / "policy"
    model = build_model("micro", seed=3)
    save_policy(model, build_tokenizer(vocab_size=model.config.vocab_size), policy_dir)
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "cuda": device == "cuda",
        "torch": torch.__version__,
    }
    summary["learner"] = _section("learner", lambda: check_learner(policy_dir, device))
    summary["worker"] = _section("worker", lambda: check_worker(policy_dir, args.out, device))
    summary["ranks"] = _section("ranks", lambda: check_ranks(policy_dir, args.out, device))
    if args.no_vllm:
        summary["vllm"] = {"ok": None, "skipped": "--no-vllm"}
    else:
        summary["vllm"] = _section("vllm", lambda: check_vllm(policy_dir, args.out, device))
    summary["schedule"] = _section("schedule", lambda: check_schedule(device, args.bench_repeats))
    failed = [k for k, v in summary.items() if isinstance(v, dict) and v.get("ok") is False]
    summary["failed"] = failed
    text = json.dumps(summary)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
