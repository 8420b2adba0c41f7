"""The rollout role: an inference engine, the bash agent, sandboxes and graders.

``rollout`` is a generator: as a Ray actor method called with ``num_returns="streaming"``
it hands each event to the caller the moment it happens: a ``TurnReady`` after every
sampled action (OPD sends it to the teacher) and each graded ``Trajectory``. Every action
records the policy version of the weights that sampled it.

Weights arrive two ways. ``load_weights`` swaps them at once (between batches: sync,
thundersync, one-step-off) and is refused while a rollout is under way, so a batch that
must be sampled by one version never sees two. ``publish`` queues them and the agent swaps
them before its next generation round, mid-trajectory (pipeline's in-flight updates); the
actor runs with two threads so ``publish`` lands while ``rollout`` is streaming. ``settle``
applies a queued publication with no rollout under way (before an evaluation). By
collective, ``receive_weights`` takes a broadcast between batches and ``receive_in_flight``
at the next generation round (the engines drained, so no reply mixes two versions).

With ``rollout.lora_publication: adapter`` a publication is a LoRA adapter's folder, not a
weight file: the vLLM engines start with LoRA support for adapters of rank ``lora_rank``
and switch to each version's adapter (``load_adapter``) where they would load weights.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from thundersync_core.batch import Trajectory
from thundersync_core.config import RolloutConfig, RolloutResources
from thundersync_core.rollout.agent import Agent, AgentConfig, EpisodeSpec, TurnReady
from thundersync_core.rollout.chat import chat_format, sampling_config
from thundersync_core.rollout.engine import gone_processes
from thundersync_core.runtime.placement import check_cores, pin_to_cores
from thundersync_core.streaming.base import LearnerRefusal

if TYPE_CHECKING:
    from thundersync_core.rollout.weight_sync import GroupAddress, Layout
    from thundersync_core.runtime.placement import Reservation


@dataclass(frozen=True)
class RolloutSpec:
    """One trajectory to roll out: which task, its group, and the batch it trains in."""

    task_id: str
    group_id: str
    trajectory_id: str
    batch: int = 0


@dataclass
class _Broadcast:
    """A broadcast publication queued for the next round, and its waiting caller's answer."""

    version: int
    verify: bool
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[float, list[Any]] | None = None
    error: BaseException | None = None


class RolloutWorker:
    def __init__(
        self,
        model_dir: Path,
        task_roots: Mapping[str, Path],
        config: RolloutConfig,
        *,
        cores: tuple[int, ...] = (),
        seed: int = 0,
        policy_version: int = 0,
        resources: RolloutResources | None = None,
        placement: Reservation | None = None,
        lora_rank: int | None = None,
    ) -> None:
        pin_to_cores(cores)
        check_cores(config.grader_cores, "rollout.grader_cores")
        from thundersync_core.policy.io import load_tokenizer  # noqa: PLC0415
        from thundersync_core.rollout.cli import make_engine  # noqa: PLC0415
        from thundersync_core.rollout.engine_pool import start_engines  # noqa: PLC0415
        from thundersync_core.rollout.sandbox import SandboxLimits, open_sandbox  # noqa: PLC0415
        from thundersync_core.rollout.tasks import load_terminal_task  # noqa: PLC0415

        self.adapters = config.lora_publication == "adapter"
        if self.adapters and lora_rank is None:
            raise ValueError(
                "rollout.lora_publication: adapter: the rollout role needs the policy's LoRA "
                "rank (policy.lora.r) to start its engines with LoRA support"
            )
        engine_rank = lora_rank if self.adapters else None
        self.tasks = {tid: load_terminal_task(Path(root)) for tid, root in task_roots.items()}
        res = resources or RolloutResources()
        self.engine: Any
        if res.engines > 1:
            self.engine = start_engines(
                config.engine,
                Path(model_dir),
                engines=res.engines,
                tensor_parallel_size=res.tensor_parallel_size,
                num_gpus=res.num_gpus,
                num_cpus=res.num_cpus,
                cores=res.cores,
                max_model_len=config.max_model_len,
                policy_version=policy_version,
                placement=placement,
                lora_rank=engine_rank,
                engine_core=config.engine_core,
            )
        else:
            self.engine = make_engine(
                config.engine,
                Path(model_dir),
                max_model_len=config.max_model_len,
                tensor_parallel_size=res.tensor_parallel_size,
                lora_rank=engine_rank,
                engine_core=config.engine_core,
            )
            self.engine.policy_version = policy_version
        tokenizer = load_tokenizer(model_dir)
        agent_config = AgentConfig.of(config)
        limits = SandboxLimits(timeout_s=config.command_timeout_s)
        chat = chat_format(tokenizer, Path(model_dir), config)  # type: ignore[arg-type]
        self.agent = Agent(
            self.engine,
            tokenizer,  # type: ignore[arg-type]
            lambda: open_sandbox(
                config.backend,
                limits=limits,
                image=config.docker_image if config.backend == "docker" else None,
            ),
            config=agent_config,
            sampling=sampling_config(config, chat.stop_token_ids),
            chat=chat,
            base_seed=seed,
            grader_cores=config.grader_cores,
            max_workers=config.sandbox_workers,
            loop=config.agent_loop,
        )
        self._pending: tuple[Path, int] | _Broadcast | None = None
        self._engine_pids = self.engine_pids()
        self._lock = threading.Lock()
        self._rollouts = 0  # rollout streams under way
        self.weight_swaps: list[tuple[int, float, float]] = []

    # -- weights ---------------------------------------------------------------------------
    def load_weights(self, path: str, version: int) -> float:
        """Swap weights (with adapter publication: the adapter in the folder ``path``) now;
        returns when the engine has them. Refused while a rollout is under way: weights
        reach episodes in flight only through ``publish``."""
        with self._lock:
            if self._rollouts:
                raise LearnerRefusal(
                    f"refusing to load weights version {version} into the engine: a rollout "
                    f"is under way ({len(self.agent.in_flight_events())} episodes in flight, "
                    f"sampled by version {self.engine.policy_version}); publish() queues "
                    "weights for an in-flight update"
                )
            self._swap(Path(path), version)
        return time.time()

    # -- collective publication ------------------------------------------------------------
    def publication_workers(self) -> int:
        """Ranks the engines take in the publication group."""
        return int(getattr(self.engine, "workers", 1))

    def engine_dtype(self) -> str:
        return str(getattr(self.engine, "dtype", "float32"))

    def join_weight_group(
        self, address: GroupAddress, *, layout: Layout, bucket_bytes: int
    ) -> list[int]:
        """Every engine worker joins the learner's publication group (ranks from 1)."""
        join = getattr(self.engine, "join_weight_group", None)
        if join is None:
            raise ValueError(
                "rollout.publication: collective needs vLLM engines (rollout.engine: vllm); "
                f"the {type(self.engine).__name__} loads weights from a file"
            )
        return list(join(address, rank_offset=1, layout=layout, bucket_bytes=bucket_bytes))

    def receive_weights(self, version: int, verify: bool = False) -> tuple[float, list[Any]]:
        """Receive a broadcast publication now (called while the learner sends it); refused
        while a rollout is under way, as ``load_weights`` is. Returns the time the engines
        had it and each engine worker's report."""
        with self._lock:
            if self._rollouts:
                raise LearnerRefusal(
                    f"refusing to receive weights version {version}: a rollout is under way"
                )
            return self._receive(version, verify)

    def receive_in_flight(self, version: int, verify: bool = False) -> tuple[float, list[Any]]:
        """Receive a broadcast publication at the rollout's next generation round (the
        pipeline's in-flight update by collective; the learner sends it meanwhile), or at
        once when no rollout is under way. Returns as ``receive_weights`` does, once the
        engines have the weights: the driver waits about one round."""
        with self._lock:
            if not self._rollouts:
                return self._receive(version, verify)
            if self._pending is not None:
                raise LearnerRefusal(
                    f"refusing to queue weights version {version}: an earlier publication "
                    "has not reached the engines yet"
                )
            ticket = _Broadcast(version, verify)
            self._pending = ticket
        ticket.done.wait()
        if ticket.error is not None:
            raise ticket.error
        assert ticket.result is not None
        return ticket.result

    def publish(self, path: str, version: int) -> None:
        """Queue weights for the next generation round (in-flight update)."""
        with self._lock:
            self._pending = (Path(path), version)

    def settle(self) -> int:
        """Apply queued weights now (no rollout may be under way); the engine's version."""
        with self._lock:
            if self._rollouts:
                raise LearnerRefusal("settle: a rollout is under way")
            pending, self._pending = self._pending, None
            self._apply(pending)
        return self.engine.policy_version

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        self._apply(pending)

    def _apply(
        self, pending: tuple[Path, int] | _Broadcast | None, *, reraise: bool = True
    ) -> None:
        """Apply what was queued: a weight file, or a broadcast whose waiting caller is told
        the outcome (and, with ``reraise``, this thread too)."""
        if isinstance(pending, _Broadcast):
            try:
                pending.result = self._receive(pending.version, pending.verify)
            except BaseException as exc:
                pending.error = exc
                if reraise:
                    raise
            finally:
                pending.done.set()
        elif pending is not None:
            self._swap(*pending)

    def _receive(self, version: int, verify: bool) -> tuple[float, list[Any]]:
        t0 = time.time()
        reports = self.engine.receive_weights(version, verify=verify)
        self.weight_swaps.append((version, t0, time.time()))
        return time.time(), list(reports)

    def _swap(self, path: Path, version: int) -> None:
        t0 = time.time()
        if self.adapters:
            self.engine.load_adapter(path, version)
        else:
            self.engine.load_weights(path, version)
        self.weight_swaps.append((version, t0, time.time()))

    def pid(self) -> int:
        """This role's process id (roles.json in the run folder lists them)."""
        return os.getpid()

    def node_ids(self) -> dict[str, Any]:
        """The Ray node of this worker (agent, sandboxes, graders) and of each engine."""
        from thundersync_core.runtime.placement import node_id  # noqa: PLC0415

        here = node_id()
        engines = getattr(self.engine, "node_ids", None)
        return {"worker": here, "engines": list(engines()) if callable(engines) else [here]}

    def engine_pids(self) -> list[int]:
        """Processes of the engine apart from this one (vLLM's engine core; none for hf or
        an inline engine core)."""
        pids = getattr(self.engine, "engine_pids", None)
        return list(pids()) if callable(pids) else []

    def dead_engine_processes(self) -> list[int]:
        """The engine's processes (as started) that are gone. A generation call in flight
        when vLLM's engine core dies may never return, so the training stage asks this from
        outside the call (the actor's second thread)."""
        pool = getattr(self.engine, "dead_engine_processes", None)
        if callable(pool):
            return list(pool())
        return gone_processes(self._engine_pids)

    def version(self) -> int:
        return self.engine.policy_version

    # -- rollouts --------------------------------------------------------------------------
    def prompt_ids(self, task_id: str) -> tuple[int, ...]:
        return self.agent.prompt_ids(self.tasks[task_id].instruction)

    def rollout(
        self,
        specs: list[RolloutSpec],
        *,
        max_live: int | None = None,
        max_staleness: int | None = None,
        emit_turns: bool = False,
    ) -> Iterator[Trajectory | TurnReady]:
        """Roll out ``specs``, yielding events as they happen.

        With ``max_staleness`` set, a spec of batch b starts only once the engine's policy
        version is at least b - max_staleness (the pipeline's staleness bound); pending
        in-flight weights are applied before every round.
        """
        by_id = {s.trajectory_id: s for s in specs}
        episodes = [EpisodeSpec(self.tasks[s.task_id], s.group_id, s.trajectory_id) for s in specs]

        def admit(episode: EpisodeSpec) -> bool:
            if max_staleness is None:
                return True
            return self.engine.policy_version >= by_id[episode.trajectory_id].batch - max_staleness

        with self._lock:
            self._rollouts += 1
        try:
            for event in self.agent.stream(
                episodes,
                max_live=max_live,
                admit=admit,
                before_round=self._apply_pending,
                swap_pending=lambda: self._pending is not None,
            ):
                if isinstance(event, TurnReady) and not emit_turns:
                    continue
                yield event
        finally:
            with self._lock:
                self._rollouts -= 1
                last = None
                if not self._rollouts and isinstance(self._pending, _Broadcast):
                    last, self._pending = self._pending, None
            # A broadcast's caller waits for it: received here, as no round will come.
            self._apply(last, reraise=False)

    def in_flight_events(self) -> list[list[dict[str, Any]]]:
        """Event lists of the episodes under way (see ``Agent.in_flight_events``)."""
        return self.agent.in_flight_events()

    def engine_requests(self) -> list[int]:
        """Generation requests each engine has served (several engines; empty for one)."""
        return list(getattr(self.engine, "served", []))

    def engine_versions(self) -> list[list[int]]:
        """The policy versions each engine sampled with since the last call (several
        engines; empty for one)."""
        take = getattr(self.engine, "take_versions", None)
        return take() if callable(take) else []

    def memory_bytes(self) -> int:
        from thundersync_core.metrics import peak_rss_bytes  # noqa: PLC0415

        return peak_rss_bytes()

    def close(self) -> None:
        self.agent.close()
        self.engine.close()
