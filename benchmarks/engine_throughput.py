"""Generation throughput and weight-publication time: vLLM CPU vs the transformers engine.

Both engines serve the same tiny policy and the same requests (same seeds, same lengths,
no stop tokens so every request generates exactly ``--tokens``). Publication is timed end
to end through ``WeightPublisher``: write the learner's weights once, load them in place.

    python benchmarks/engine_throughput.py [--requests 32 --tokens 64]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from thundersync_core.policy import build_model, build_tokenizer, load_model, save_policy
from thundersync_core.rollout.engine import GenerationRequest, SamplingConfig, request_seed
from thundersync_core.rollout.hf_engine import HFEngine
from thundersync_core.rollout.vllm_engine import VLLMEngine, vllm_available
from thundersync_core.rollout.weights import WeightPublisher
from thundersync_core.streaming import SyncGRPOLearner


def measure(engine, requests, learner, publications: int) -> dict:
    engine.generate(requests[:2], SamplingConfig())  # warm-up
    start = time.perf_counter()
    results = engine.generate(requests, SamplingConfig())
    gen_s = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    publisher = WeightPublisher(learner, [engine])
    times = []
    for _ in range(publications):
        with torch.no_grad():
            next(learner.model.parameters()).add_(1e-3)
        learner.policy_version += 1
        times.append(publisher.publish().seconds)
    return {
        "engine": type(engine).__name__,
        "requests": len(requests),
        "generated_tokens": tokens,
        "generate_s": round(gen_s, 3),
        "tokens_per_s": round(tokens / gen_s, 1),
        "publication_s_mean": round(sum(times) / len(times), 4),
        "publication_s_max": round(max(times), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--publications", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "policy"
        model = build_model("tiny", seed=0)
        save_policy(model, build_tokenizer(vocab_size=model.config.vocab_size), model_dir)
        requests = [
            GenerationRequest(
                f"r{i}",
                tuple((7 * i + j) % 2000 + 3 for j in range(args.prompt_tokens)),
                args.tokens,
                request_seed(0, "bench", str(i), 0),
            )
            for i in range(args.requests)
        ]
        learner = SyncGRPOLearner(load_model(model_dir))
        rows = []
        if vllm_available():
            engine = VLLMEngine(model_dir, max_model_len=2048)
            rows.append(measure(engine, requests, learner, args.publications))
            engine.close()
        rows.append(measure(HFEngine(model_dir), requests, learner, args.publications))
    for row in rows:
        print(json.dumps(row))
    if len(rows) == 2:
        print(
            json.dumps(
                {
                    "throughput_ratio_vllm_over_hf": round(
                        rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"], 1
                    ),
                    "publication_s": {r["engine"]: r["publication_s_mean"] for r in rows},
                }
            )
        )


if __name__ == "__main__":
    main()
