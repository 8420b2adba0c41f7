"""One short check of the CUDA paths: the distributed learner (FSDP2, NCCL) and vLLM.

    python scripts/gpu_check.py [--out runs/gpu_check]

1. Learner: W = min(2, GPUs) ranks in an NCCL group stream a GRPO batch of the micro model
   through the data-parallel barrier. float32 + replicated: the reduced gradient against the
   plain one-process reference (tolerance 1e-5 relative to the max). fsdp2 with bfloat16
   compute when the GPU supports it: one full step (clip, sharded AdamW, replica refresh,
   streamed publication), with its peak CUDA memory per rank.
2. vLLM: the engine loads the policy, generates, reloads the learner's published weights
   and generates again.

Prints one JSON summary; exits 2 with a message when no CUDA device is present, 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NO_CUDA = (
    "gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); "
    "run it on a GPU node"
)
TOLERANCE = 1e-5


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank(rank: int, world: int, port: int, policy_dir: str, out_dir: str) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from tests.helpers import random_batch, reference_grad_j, rel_diff  # noqa: PLC0415
    from thundersync_core.parallel.data_parallel import (  # noqa: PLC0415
        init_process_group,
        stream_rank_share,
    )
    from thundersync_core.parallel.fsdp import build_train_state  # noqa: PLC0415
    from thundersync_core.policy.io import load_model  # noqa: PLC0415
    from thundersync_core.streaming import StreamingGRPOLearner, groups_of  # noqa: PLC0415

    torch.cuda.set_device(rank)
    init_process_group(
        "nccl", rank=rank, world_size=world, address="127.0.0.1", port=port, timeout_s=120
    )
    batch = random_batch(seed=11, vocab=1024, n_groups=4, group_size=3)
    model = load_model(Path(policy_dir)).to("cuda")
    learner = StreamingGRPOLearner(model, max_open_groups=2)
    stream_rank_share(learner, batch, groups_of(batch), rank=rank, world_size=world)
    grads = learner.finish().grad_objective
    result: dict[str, Any] = {"rank": rank}
    if rank == 0:
        reference_model = load_model(Path(policy_dir)).to("cuda")
        _, reference = reference_grad_j(reference_model, batch)
        result["fp32_rel_diff"] = rel_diff(reference, {k: v.float() for k, v in grads.items()})
    bf16 = torch.cuda.is_bf16_supported()
    compute = load_model(Path(policy_dir)).to("cuda").to(torch.bfloat16 if bf16 else torch.float32)
    torch.cuda.reset_peak_memory_stats()
    state = build_train_state(compute, sharding="fsdp2", lr=1e-5, device_type="cuda")
    learner = StreamingGRPOLearner(compute, max_open_groups=2)
    start = time.perf_counter()
    stream_rank_share(learner, batch, groups_of(batch), rank=rank, world_size=world)
    learner.finish()
    result["fsdp2_grad_norm"] = state.clip(1.0)
    state.apply()
    state.write_weights(Path(out_dir) / "published.safetensors")
    torch.cuda.synchronize()
    result |= {
        "fsdp2_compute_dtype": "bfloat16" if bf16 else "float32",
        "fsdp2_step_s": time.perf_counter() - start,
        "fsdp2_peak_cuda_bytes": torch.cuda.max_memory_allocated(),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def check_learner(policy_dir: Path, out: Path) -> dict[str, Any]:
    import torch  # noqa: PLC0415
    import torch.multiprocessing as mp  # noqa: PLC0415

    world = min(2, torch.cuda.device_count())
    mp.spawn(_rank, args=(world, _free_port(), str(policy_dir), str(out)), nprocs=world)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return {
        "world_size": world,
        "ranks": ranks,
        "fp32_exact": ranks[0]["fp32_rel_diff"] <= TOLERANCE,
    }


def check_vllm(policy_dir: Path, published: Path) -> dict[str, Any]:
    from thundersync_core.rollout.engine import GenerationRequest, SamplingConfig  # noqa: PLC0415
    from thundersync_core.rollout.vllm_engine import VLLMEngine, vllm_available  # noqa: PLC0415

    if not vllm_available():
        return {"ok": False, "error": "vLLM is not installed (the `gpu` extra)"}
    start = time.perf_counter()
    engine = VLLMEngine(policy_dir, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3)
    requests = [GenerationRequest(f"r{i}", (1, 2, 3, i + 4), 8, seed=i) for i in range(4)]
    try:
        before = engine.generate(requests, SamplingConfig())
        engine.load_weights(published, version=1)
        after = engine.generate(requests, SamplingConfig())
    finally:
        engine.close()
    return {
        "ok": all(len(r.token_ids) == 8 for r in before + after) and after[0].policy_version == 1,
        "seconds": time.perf_counter() - start,
        "tokens_before": [list(r.token_ids) for r in before[:2]],
        "tokens_after": [list(r.token_ids) for r in after[:2]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check"))
    args = parser.parse_args()
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        print(json.dumps({"cuda": False}))
        return 2
    from thundersync_core.policy import build_model, build_tokenizer, save_policy  # noqa: PLC0415

    args.out.mkdir(parents=True, exist_ok=True)
    policy_dir = args.out / "policy"
    model = build_model("micro", seed=3)
    save_policy(model, build_tokenizer(vocab_size=model.config.vocab_size), policy_dir)
    summary: dict[str, Any] = {"cuda": True, "device": torch.cuda.get_device_name(0)}
    summary["learner"] = check_learner(policy_dir, args.out)
    summary["vllm"] = check_vllm(policy_dir, args.out / "published.safetensors")
    print(json.dumps(summary))
    return 0 if summary["learner"]["fp32_exact"] and summary["vllm"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
