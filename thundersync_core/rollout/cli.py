"""``thundersync rollout``: real rollouts on a few tasks, written as a batch file."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Literal

from thundersync_core.rollout.engine import RolloutEngine


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "rollout",
        help="run real rollouts (engine + bash agent + sandbox + grader) on a task folder",
    )
    p.add_argument("--tasks", required=True, type=Path, help="folder of Harbor-format tasks")
    p.add_argument("--model", required=True, type=Path, help="Hugging Face causal-LM folder")
    p.add_argument("--n", default=4, type=int, help="trajectories per task (one group)")
    p.add_argument("--out", required=True, type=Path, help="batch file to write (JSONL)")
    p.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"])
    p.add_argument("--backend", default="local", choices=["local", "docker"])
    p.add_argument("--seed", default=0, type=int)
    p.add_argument("--max-turns", default=4, type=int)
    p.add_argument("--max-tokens-per-turn", default=64, type=int)
    p.add_argument("--limit", default=0, type=int, help="use only the first N tasks (0: all)")
    p.add_argument("--action-format", default="bash_block", choices=["bash_block", "tool_calls"])
    p.add_argument(
        "--enable-thinking", default=None, choices=["true", "false"],
        help="a thinking template's switch (default: the template's own)",
    )  # fmt: skip
    p.add_argument(
        "--agent-loop", default="rounds", choices=["rounds", "overlapped"],
        help="rounds: generate for every episode, then run their commands; overlapped: "
        "commands run while the engine generates for the episodes ready",
    )  # fmt: skip
    p.add_argument(
        "--sandbox-workers", default=8, type=int,
        help="threads running sandbox commands (and as many for graders)",
    )  # fmt: skip


def make_engine(
    kind: str,
    model_dir: Path,
    *,
    max_model_len: int = 4096,
    tensor_parallel_size: int = 1,
    lora_rank: int | None = None,
    engine_core: Literal["auto", "child", "inline"] = "child",
) -> RolloutEngine:
    """vLLM when asked for or, with ``auto``, when installed; else the transformers engine.
    ``lora_rank``: a vLLM engine with LoRA support for adapters of at most that rank.
    ``engine_core``: where vLLM's engine core runs (``rollout.engine_core``; ``inline`` and
    ``auto`` only in a process of the engine's own)."""
    from thundersync_core.rollout.hf_engine import HFEngine
    from thundersync_core.rollout.vllm_engine import VLLMEngine, vllm_available

    if kind == "vllm" or (kind == "auto" and vllm_available()):
        extra: dict[str, Any] = {}
        if tensor_parallel_size > 1:
            extra["tensor_parallel_size"] = tensor_parallel_size
        return VLLMEngine(
            model_dir,
            max_model_len=max_model_len,
            lora_rank=lora_rank,
            engine_core=engine_core,
            **extra,
        )
    if tensor_parallel_size > 1:
        raise ValueError(
            f"resources.rollout.tensor_parallel_size: {tensor_parallel_size} needs the vLLM "
            "engine (the transformers engine runs on one device)"
        )
    if lora_rank is not None:
        raise ValueError(
            "rollout.lora_publication: adapter needs the vLLM engine (rollout.engine: vllm); "
            "the transformers engine loads merged weights"
        )
    return HFEngine(model_dir)


def run(args: argparse.Namespace) -> int:
    from thundersync_core.batch import trajectory_to_json
    from thundersync_core.config import RolloutConfig
    from thundersync_core.policy.io import load_tokenizer
    from thundersync_core.rollout.agent import Agent, AgentConfig, EpisodeSpec
    from thundersync_core.rollout.chat import chat_format, sampling_config
    from thundersync_core.rollout.sandbox import open_sandbox
    from thundersync_core.rollout.sandbox.base import SandboxLimits
    from thundersync_core.rollout.tasks import load_terminal_tasks

    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    if args.sandbox_workers < 1:
        raise ValueError(f"--sandbox-workers must be >= 1, got {args.sandbox_workers}")
    tasks = load_terminal_tasks(args.tasks)
    if args.limit:
        tasks = tasks[: args.limit]
    tokenizer = load_tokenizer(args.model)
    engine = make_engine(args.engine, args.model)
    config = AgentConfig(max_turns=args.max_turns, max_tokens_per_turn=args.max_tokens_per_turn)
    limits = SandboxLimits(timeout_s=config.command_timeout_s)
    thinking = None if args.enable_thinking is None else args.enable_thinking == "true"
    rollout = RolloutConfig(action_format=args.action_format, enable_thinking=thinking)
    chat = chat_format(tokenizer, args.model, rollout)  # type: ignore[arg-type]
    agent = Agent(
        engine,
        tokenizer,  # type: ignore[arg-type]
        lambda: open_sandbox(args.backend, limits=limits),
        config=config,
        sampling=sampling_config(rollout, chat.stop_token_ids),
        base_seed=args.seed,
        chat=chat,
        max_workers=args.sandbox_workers,
        loop=args.agent_loop,
    )
    specs = [
        EpisodeSpec(task, group_id=task.task_id, trajectory_id=f"{task.task_id}/{i}")
        for task in tasks
        for i in range(args.n)
    ]
    start = time.perf_counter()
    try:
        trajectories = agent.run(specs)
    finally:
        agent.close()
        engine.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text("".join(trajectory_to_json(t) + "\n" for t in trajectories))
    tmp.replace(args.out)
    rewards = [t.reward for t in trajectories]
    reasons: dict[str, int] = {}
    for t in trajectories:
        reason = str((t.metadata or {}).get("finish_reason"))
        reasons[reason] = reasons.get(reason, 0) + 1
    print(
        json.dumps(
            {
                "out": str(args.out),
                "trajectories": len(trajectories),
                "tasks": len(tasks),
                "mean_reward": sum(rewards) / len(rewards),
                "finish_reasons": reasons,
                "engine": type(engine).__name__,
                "wall_s": time.perf_counter() - start,
            }
        )
    )
    return 0
