"""Several inference engines behind the one-engine protocol the agent uses.

With ``resources.rollout.engines`` > 1 the rollout role starts that many engines as their
own Ray actors (``EngineActor``: each with its share of the role's GPUs, or pinned to a
share of its cores) and hands the agent an ``EnginePool``. A generation round's requests
are split over the engines and run concurrently:

- a group stays on one engine (its shared prompt hits that engine's prefix cache);
- a group seen for the first time goes to the engine with the fewest requests in this
  round so far (then the fewest groups, then the lowest index), so the assignment depends
  only on the order of the round's requests;
- results come back in request order, each with the version of the engine that sampled
  it. Sampling is seeded per request, so a trajectory's tokens do not depend on which
  engine served it.

``load_weights`` (and ``load_adapter``, a LoRA policy's adapter on vLLM engines started
with ``lora_rank``) returns once every engine has the new weights and only then reports the
new version; the agent calls it between rounds, so no round is served by a mix of
versions. An engine that fails to load fails the call naming it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from thundersync_core.rollout.engine import (
    EngineFailed,
    GenerationRequest,
    GenerationResult,
    SamplingConfig,
    gone_processes,
)

if TYPE_CHECKING:
    from thundersync_core.rollout.weight_sync import GroupAddress
    from thundersync_core.runtime.placement import Reservation

__all__ = ["EngineActor", "EnginePool", "assign_requests", "start_engines"]


def _group_of(request: GenerationRequest) -> str:
    """The request's group; requests without one are their own group (by trajectory)."""
    return request.group_id or request.request_id.rsplit("/", 1)[0]


def assign_requests(
    requests: Sequence[GenerationRequest], n_engines: int, affinity: dict[str, int]
) -> list[int]:
    """The engine of each request; ``affinity`` (group -> engine) is read and extended."""
    load = [0] * n_engines
    groups = [sum(1 for e in affinity.values() if e == i) for i in range(n_engines)]
    chosen = []
    for request in requests:
        group = _group_of(request)
        if group not in affinity:
            affinity[group] = min(range(n_engines), key=lambda i: (load[i], groups[i], i))
            groups[affinity[group]] += 1
        engine = affinity[group]
        load[engine] += 1
        chosen.append(engine)
    return chosen


class EngineActor:
    """One engine in its own process (a Ray actor)."""

    def __init__(
        self,
        kind: str,
        model_dir: Path,
        *,
        max_model_len: int,
        tensor_parallel_size: int = 1,
        cores: tuple[int, ...] = (),
        index: int = 0,
        lora_rank: int | None = None,
        engine_core: Literal["auto", "child", "inline"] = "child",
    ) -> None:
        from thundersync_core.runtime.placement import pin_to_cores  # noqa: PLC0415

        pin_to_cores(cores)
        self.index = index
        from thundersync_core.rollout.cli import make_engine  # noqa: PLC0415

        self.engine = make_engine(
            kind,
            Path(model_dir),
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            lora_rank=lora_rank,
            engine_core=engine_core,
        )

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[GenerationResult]:
        return self.engine.generate(requests, sampling)

    def load_weights(self, path: str, version: int) -> int:
        self.engine.load_weights(Path(path), version)
        return self.engine.policy_version

    def load_adapter(self, path: str, version: int) -> int:
        self.engine.load_adapter(Path(path), version)  # type: ignore[attr-defined]
        return self.engine.policy_version

    def set_version(self, version: int) -> None:
        self.engine.policy_version = version

    def workers(self) -> int:
        """Ranks this engine takes in the publication group (its tensor-parallel workers)."""
        return int(getattr(self.engine, "workers", 1))

    def join_weight_group(self, address: GroupAddress, **kwargs: Any) -> list[int]:
        return list(self.engine.join_weight_group(address, **kwargs))  # type: ignore[attr-defined]

    def receive_weights(self, version: int, verify: bool) -> list[dict[str, Any]]:
        return list(self.engine.receive_weights(version, verify=verify))  # type: ignore[attr-defined]

    def node_id(self) -> str:
        from thundersync_core.runtime.placement import node_id  # noqa: PLC0415

        return node_id()

    def engine_pids(self) -> list[int]:
        """This actor's process and the engine's own (vLLM's engine core)."""
        pids = getattr(self.engine, "engine_pids", None)
        return [os.getpid(), *(pids() if callable(pids) else [])]

    def dead_processes(self) -> list[int]:
        """The engine's processes that are gone (asked on this actor's second thread, so it
        answers while a generation call hangs on a dead engine core)."""
        return gone_processes(self.engine_pids()[1:])

    def close(self) -> None:
        self.engine.close()


class EnginePool:
    """The agent's engine: ``engines`` (EngineActor handles) behind one protocol."""

    def __init__(self, engines: Sequence[Any], *, policy_version: int = 0) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = list(engines)
        self.affinity: dict[str, int] = {}
        #: Requests each engine served (the step record's spread over engines).
        self.served = [0] * len(self.engines)
        #: Policy versions each engine sampled with since ``take_versions`` last asked.
        self.versions: list[set[int]] = [set() for _ in self.engines]
        self._version = policy_version
        self._call(lambda a: a.set_version.remote(policy_version), "set its version")
        #: Each engine's processes as started (what ``dead_engine_processes`` reports).
        self._known: list[list[int]] = self._call(lambda a: a.engine_pids.remote(), "start")

    @property
    def policy_version(self) -> int:
        return self._version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self._call(lambda a: a.set_version.remote(version), "set its version")
        self._version = version

    def _call(self, method: Any, what: str) -> list[Any]:
        """Call every engine at once; a failure names the engine."""
        return self._gather([method(actor) for actor in self.engines], what)

    def _gather(self, refs: list[Any], what: str) -> list[Any]:
        """Each engine's result, in engine order; a failure names the engine."""
        import ray  # noqa: PLC0415

        results = []
        for index, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                raise EngineFailed(f"engine {index} failed to {what}: {exc}") from exc
        return results

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingConfig
    ) -> list[GenerationResult]:
        import ray  # noqa: PLC0415

        chosen = assign_requests(requests, len(self.engines), self.affinity)
        shares: list[list[int]] = [[] for _ in self.engines]
        for position, engine in enumerate(chosen):
            shares[engine].append(position)
        refs = {
            engine: self.engines[engine].generate.remote([requests[p] for p in share], sampling)
            for engine, share in enumerate(shares)
            if share
        }
        results: list[GenerationResult | None] = [None] * len(requests)
        for engine, ref in refs.items():
            try:
                served = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                raise EngineFailed(f"engine {engine} failed to generate: {exc}") from exc
            self.served[engine] += len(served)
            self.versions[engine].update(r.policy_version for r in served)
            for position, result in zip(shares[engine], served, strict=True):
                results[position] = result
        return [r for r in results if r is not None]

    def take_versions(self) -> list[list[int]]:
        """The versions each engine sampled with since the last call (then forgotten)."""
        taken = [sorted(v) for v in self.versions]
        self.versions = [set() for _ in self.engines]
        return taken

    def load_weights(self, path: Path, version: int) -> None:
        """Every engine loads ``path``; the pool reports ``version`` only after all have."""
        versions = self._call(
            lambda a: a.load_weights.remote(str(path), version), f"load weights v{version}"
        )
        if set(versions) != {version}:
            raise EngineFailed(f"engines report versions {versions} after loading v{version}")
        self._version = version

    def load_adapter(self, path: Path, version: int) -> None:
        """Every engine switches to the adapter in ``path``; the pool reports ``version``
        only after all have."""
        versions = self._call(
            lambda a: a.load_adapter.remote(str(path), version), f"load adapter v{version}"
        )
        if set(versions) != {version}:
            raise EngineFailed(f"engines report versions {versions} after loading v{version}")
        self._version = version

    @property
    def workers(self) -> int:
        return sum(self._call(lambda a: a.workers.remote(), "answer"))

    def join_weight_group(
        self, address: GroupAddress, *, rank_offset: int, **kwargs: Any
    ) -> list[int]:
        """Every engine's workers join, engine i after the workers of engines before it."""
        sizes = self._call(lambda a: a.workers.remote(), "answer")
        refs = [
            actor.join_weight_group.remote(
                address, rank_offset=rank_offset + sum(sizes[:i]), **kwargs
            )
            for i, actor in enumerate(self.engines)
        ]
        ranks = self._gather(refs, "join the publication group")
        return [r for engine in ranks for r in engine]

    def receive_weights(self, version: int, *, verify: bool = False) -> list[dict[str, Any]]:
        """Every engine receives the broadcast; the pool reports ``version`` after all."""
        reports = self._call(
            lambda a: a.receive_weights.remote(version, verify), f"receive weights v{version}"
        )
        self._version = version
        return [dict(r, engine=i) for i, engine in enumerate(reports) for r in engine]

    def node_ids(self) -> list[str]:
        """Each engine's Ray node, by engine."""
        return [str(n) for n in self._call(lambda a: a.node_id.remote(), "answer")]

    def engine_pids(self) -> list[int]:
        """Every engine actor's process and the engine processes under it."""
        return [
            pid for pids in self._call(lambda a: a.engine_pids.remote(), "answer") for pid in pids
        ]

    def dead_engine_processes(self, timeout_s: float = 10.0) -> list[int]:
        """Engine processes that are gone: an engine's own (its actor checks them where
        they run), or an actor that does not answer (each of its known processes)."""
        import ray  # noqa: PLC0415

        dead: list[int] = []
        for actor, known in zip(self.engines, self._known, strict=True):
            try:
                dead.extend(ray.get(actor.dead_processes.remote(), timeout=timeout_s))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.extend(known)
        return dead

    def close(self) -> None:
        import ray  # noqa: PLC0415

        for actor in self.engines:
            # Closing: an engine that died is closed already.
            with contextlib.suppress(Exception):
                ray.get(actor.close.remote(), timeout=60)
            ray.kill(actor)


def start_engines(
    kind: str,
    model_dir: Path,
    *,
    engines: int,
    tensor_parallel_size: int,
    num_gpus: float,
    num_cpus: float,
    cores: tuple[int, ...],
    max_model_len: int,
    policy_version: int,
    placement: Reservation | None = None,
    lora_rank: int | None = None,
    engine_core: Literal["auto", "child", "inline"] = "child",
) -> EnginePool:
    """``engines`` EngineActors, each with its share of the rollout role's GPUs and CPUs
    (cores: engine i takes cores[i::engines], all of them when there are fewer cores than
    engines; engine i in bundle i of ``placement``), as one pool; ``lora_rank``: vLLM
    engines with LoRA support (``make_engine``); ``engine_core``: ``rollout.engine_core``."""
    import ray  # noqa: PLC0415

    from thundersync_core.runtime.placement import in_bundle  # noqa: PLC0415

    handles = [
        # Two threads: the dead-process check answers while a generation call is under way.
        ray.remote(EngineActor)
        .options(
            num_gpus=num_gpus / engines,
            num_cpus=num_cpus / engines,
            max_concurrency=2,
            **in_bundle(placement, i),
        )
        .remote(
            kind,
            model_dir,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            cores=cores[i::engines] if len(cores) >= engines else cores,
            index=i,
            lora_rank=lora_rank,
            engine_core=engine_core,
        )
        for i in range(engines)
    ]
    return EnginePool(handles, policy_version=policy_version)
