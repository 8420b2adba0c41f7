"""The agent's loops on one rollout core: rounds against overlapped, same episodes.

The embedded training step's rollout stage (``configs/train_embedded.yaml``: 16 groups of
8 from the prepared train pool, at most 32 episodes in flight, 3 turns of up to 64 tokens,
vLLM CPU, bubblewrap sandboxes, graders beside them) run by ``Agent.stream`` three ways,
alternating, ``--repeats`` times each on the same specs and seeds, everything pinned to
``--cores`` (the rollout role's core in the embedded layout): ``rounds``; ``overlapped,
batch calls`` (the engine's blocking batched call for the episodes ready, as for an engine
without continuous batching); ``overlapped, continuous`` (each request added to vLLM's
running batch the moment its episode is ready, results collected step by step). Printed
per loop: the stage's wall time (first set-up to last reward), the engine's busy time
(calls, or steps), the mean batch per call or step, the mean reward; then the wall ratios
against rounds. Needs the embedded pools and warm start (``make demo`` builds and caches
both under ``runs/``).

    python benchmarks/agent_loop.py [--repeats 3] [--out docs/bench/agent_loop.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from thundersync_core.config import RolloutConfig, load_config
from thundersync_core.policy.io import load_tokenizer
from thundersync_core.pools import load_pool, plan_step
from thundersync_core.rollout.agent import Agent, AgentConfig, EpisodeSpec, TurnReady
from thundersync_core.rollout.chat import chat_format, sampling_config
from thundersync_core.rollout.sandbox import SandboxLimits, open_sandbox
from thundersync_core.rollout.tasks import load_terminal_task
from thundersync_core.rollout.vllm_engine import VLLMEngine
from thundersync_core.runtime.placement import pin_to_cores

ROOT = Path(__file__).resolve().parents[1]


def _cached(pattern: str, what: str) -> Path:
    found = sorted((ROOT / "runs").glob(pattern))
    if not found:
        raise SystemExit(f"no {what} under runs/ ({pattern}): run `make demo` once, or pass it")
    return found[-1]


class TimedEngine:
    """The engine, its ``generate`` calls timed (a call: its requests and seconds)."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[int, float]] = []

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def generate(self, requests: Any, sampling: Any) -> Any:
        start = time.perf_counter()
        out = self.engine.generate(requests, sampling)
        self.calls.append((len(requests), time.perf_counter() - start))
        return out


class TimedSteppingEngine(TimedEngine):
    """The engine taking requests into its running batch; each step is timed as a call of
    the requests in the engine then."""

    def submit(self, request: Any, sampling: Any) -> None:
        self.engine.submit(request, sampling)

    def collect(self) -> Any:
        running = self.engine.unfinished
        start = time.perf_counter()
        out = self.engine.collect()
        self.calls.append((running, time.perf_counter() - start))
        return out

    def cancel(self) -> None:
        self.engine.cancel()


def run_once(agent: Agent, engine: TimedEngine, specs: list[EpisodeSpec], max_live: int) -> dict:
    engine.calls.clear()
    start = time.perf_counter()
    trajectories = [
        e for e in agent.stream(specs, max_live=max_live) if not isinstance(e, TurnReady)
    ]
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "generate_busy_s": sum(s for _, s in engine.calls),
        "generate_calls": len(engine.calls),
        "mean_batch": statistics.fmean(n for n, _ in engine.calls),
        "reward_mean": statistics.fmean(t.reward for t in trajectories),
        "actions": sum(len((t.metadata or {})["turn_versions"]) for t in trajectories),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "train_embedded.yaml")
    parser.add_argument("--prep-dir", type=Path, default=None)
    parser.add_argument("--policy", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cores", default="0", help="cores to pin to, comma-separated")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prep = args.prep_dir or _cached("prep-cache/prep-*", "prepared pools")
    policy = args.policy or _cached("warmstart-cache/policy-*", "warm-started policy")
    config = load_config(args.config)
    rollout: RolloutConfig = config.rollout
    pin_to_cores([int(c) for c in args.cores.split(",")])

    pool = load_pool(prep, "train", config.tasks.families)
    specs = [
        EpisodeSpec(load_terminal_task(pool[s.task_id]), s.group_id, s.trajectory_id)
        for s in plan_step(config, list(pool), 0)
    ]
    tokenizer = load_tokenizer(policy)
    vllm = VLLMEngine(policy, max_model_len=rollout.max_model_len)
    engines = {
        "rounds": TimedEngine(vllm),
        "overlapped, batch calls": TimedEngine(vllm),
        "overlapped, continuous": TimedSteppingEngine(vllm),
    }
    chat = chat_format(tokenizer, policy, rollout)  # type: ignore[arg-type]
    agent_config = AgentConfig.of(rollout)
    limits = SandboxLimits(timeout_s=rollout.command_timeout_s)
    agents = {
        name: Agent(
            engine,  # type: ignore[arg-type]
            tokenizer,  # type: ignore[arg-type]
            lambda: open_sandbox("local", limits=limits),
            config=agent_config,
            sampling=sampling_config(rollout, chat.stop_token_ids),
            chat=chat,
            base_seed=config.seed,
            max_workers=rollout.sandbox_workers,
            loop="rounds" if name == "rounds" else "overlapped",
        )
        for name, engine in engines.items()
    }
    max_live = rollout.max_live_episodes or len(specs)
    runs: dict[str, list[dict]] = {loop: [] for loop in agents}
    try:
        run_once(agents["rounds"], engines["rounds"], specs[:16], max_live)  # warm-up
        for repeat in range(args.repeats):
            for loop, agent in agents.items():
                result = run_once(agent, engines[loop], specs, max_live)
                runs[loop].append(result)
                print(
                    f"[{repeat}] {loop:24s} wall {result['wall_s']:6.2f} s, engine busy "
                    f"{result['generate_busy_s']:6.2f} s in {result['generate_calls']} calls "
                    f"or steps (mean batch {result['mean_batch']:.1f}), "
                    f"reward {result['reward_mean']:.3f}",
                    flush=True,
                )
    finally:
        for agent in agents.values():
            agent.close()
        vllm.close()
    summary = {
        loop: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for loop, results in runs.items()
    }
    rounds = summary["rounds"]["wall_s"]
    ratios = {loop: rounds / summary[loop]["wall_s"] for loop in summary if loop != "rounds"}
    print(
        f"median wall: rounds {rounds:.2f} s; "
        + "; ".join(
            f"{loop} {summary[loop]['wall_s']:.2f} s (rounds / it = {r:.2f})"
            for loop, r in ratios.items()
        )
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "command": "python benchmarks/agent_loop.py " + " ".join(sys.argv[1:]),
                    "episodes": len(specs),
                    "max_live": max_live,
                    "cores": args.cores,
                    "runs": runs,
                    "median": summary,
                    "rounds_over": ratios,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
