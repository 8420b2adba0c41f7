"""Weight publication, file against collective, into one vLLM engine.

File: the learner writes the weights to a safetensors file (under /dev/shm where it
exists) one tensor at a time, and the engine's workers read it and load it in place.
Collective: the learner broadcasts the weights over a gloo (CPU) or NCCL (GPU) group to the
engine's workers, in buckets of ``--bucket-mb``, and they load them once all arrived. Each
publication is timed from the learner's start to the engine reporting the new version,
``--repeats`` times, alternating the two; the collective ones are verified (every loaded
parameter bitwise what was sent), and the engine's log-probs after each mode are compared
with the learner's own.

    python benchmarks/publication.py [--preset large] [--repeats 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from thundersync_core.parallel.fsdp import write_safetensors_streamed
from thundersync_core.policy import (
    build_model,
    build_tokenizer,
    save_policy,
    scored_logprobs,
)
from thundersync_core.rollout.engine import GenerationRequest, SamplingConfig
from thundersync_core.rollout.vllm_engine import VLLMEngine
from thundersync_core.rollout.weight_sync import (
    GroupAddress,
    WeightGroup,
    checksum,
    layout_of,
    send_weights,
)


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _agreement(engine: VLLMEngine, model: torch.nn.Module) -> float:
    """max |engine - learner| log-prob over a few sampled continuations."""
    requests = [
        GenerationRequest(f"r{i}", tuple(range(3 + i, 30 + i)), 8, seed=i) for i in range(3)
    ]
    worst = 0.0
    for request, result in zip(requests, engine.generate(requests, SamplingConfig()), strict=True):
        ids = list(request.prompt_ids) + list(result.token_ids)
        scored = [False] * len(request.prompt_ids) + [True] * len(result.token_ids)
        with torch.no_grad():
            ours, _ = scored_logprobs(model, torch.tensor([ids]), torch.tensor([scored]))
        theirs = torch.tensor(result.logprobs, dtype=ours.dtype)
        worst = max(worst, float((ours - theirs).abs().max()))
    return worst


def _receive_in_thread(
    engine: VLLMEngine, version: int, verify: bool
) -> tuple[list[Any], threading.Thread]:
    """The engine's receive (a blocking call into its workers) while this thread sends."""
    reports: list[Any] = []
    thread = threading.Thread(
        target=lambda: reports.extend(engine.receive_weights(version, verify=verify))
    )
    thread.start()
    return reports, thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="large")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="publication-"))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else root
    model = build_model(args.preset, seed=0)
    save_policy(model, build_tokenizer(vocab_size=model.config.vocab_size), root / "policy")
    engine = VLLMEngine(root / "policy", max_model_len=256)
    named = list(model.named_parameters())
    layout = layout_of(named)
    bucket = int(args.bucket_mb * 2**20)
    address = GroupAddress("gloo", host="127.0.0.1", port=_port(), world_size=2, timeout_s=300)
    joined: list[Any] = []
    rpc = threading.Thread(
        target=lambda: joined.append(
            engine.join_weight_group(address, rank_offset=1, layout=layout, bucket_bytes=bucket)
        )
    )
    rpc.start()
    group = WeightGroup(address, rank=0)
    rpc.join()
    times: dict[str, list[float]] = {"file": [], "collective": []}
    agreement: dict[str, float] = {}
    version, sent = 0, 0
    path = shm / f"publication-bench-{address.port}.safetensors"
    try:
        for _ in range(args.repeats):
            with torch.no_grad():  # a new version each time, as a step makes
                for _, p in named:
                    p.mul_(1.0001)
            version += 1
            t0 = time.perf_counter()
            write_safetensors_streamed(path, ((n, p.detach()) for n, p in named))
            engine.load_weights(path, version)
            times["file"].append(time.perf_counter() - t0)
            agreement["file"] = _agreement(engine, model)
            version += 1
            t0 = time.perf_counter()
            _, receiver = _receive_in_thread(engine, version, verify=False)
            sent = send_weights(group, named, layout, dtype=torch.float32, bucket_bytes=bucket)
            receiver.join()
            times["collective"].append(time.perf_counter() - t0)
            agreement["collective"] = _agreement(engine, model)
        # One more, verified (untimed): every loaded parameter is bitwise what was sent.
        version += 1
        reports, receiver = _receive_in_thread(engine, version, verify=True)
        send_weights(group, named, layout, dtype=torch.float32, bucket_bytes=bucket)
        receiver.join()
        expected = checksum((n, p.detach()) for n, p in named)
        verified = bool(reports) and all(
            r["checksum"] == expected and not r["differ"] for r in reports
        )
    finally:
        path.unlink(missing_ok=True)
        engine.close()
    median = {k: statistics.median(v) for k, v in times.items()}
    summary = {
        "preset": args.preset,
        "parameters": sum(p.numel() for _, p in named),
        "bytes": sent,
        "bucket_mb": args.bucket_mb,
        "file_s": median["file"],
        "collective_s": median["collective"],
        "collective_over_file": median["collective"] / median["file"],
        "all_s": times,
        "collective_verified_bitwise": verified,
        # Parameters compared bitwise after loading, and those vLLM keeps in another layout
        # (CPU: linear weights prepacked for its GEMM backend; vouched for by the checksum).
        "compared_parameters": reports[0]["compared"] if reports else 0,
        "opaque_parameters": len(reports[0]["opaque"]) if reports else 0,
        "logprob_max_diff_after": agreement,
        "device": "cpu (vLLM CPU, gloo)",
        "command": "python " + " ".join(["benchmarks/publication.py", *sys.argv[1:]]),
    }
    print(json.dumps(summary))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
