"""Ray start-up, placement groups for the roles, actors with explicit resources, and core
pinning.

Each role that holds CPUs or GPUs reserves a Ray placement group before any actor starts:
one bundle per learner rank (or one for the one-process learner), one per engine (or one
for the rollout worker with its engine), one for the teacher; the role's ``placement``
strategy lays the bundles over the nodes (``pack`` by default: ranks share a node's
interconnect). A group the cluster cannot place within ``resources.placement_timeout_s`` is
refused naming the role, what it asked for and what the cluster has free.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from thundersync_core.config import (
    LearnerResources,
    ResourcesConfig,
    RoleResources,
    RolloutResources,
)


def node_id() -> str:
    """The Ray node this process runs on (inside an actor or the driver)."""
    import ray  # noqa: PLC0415

    return str(ray.get_runtime_context().get_node_id())


def start_ray(resources: ResourcesConfig) -> None:
    """Start (or join) Ray with enough CPUs and GPUs for the configured roles.

    ``RAY_ADDRESS`` set: join that cluster. Otherwise a local instance sized to the roles
    (at least the host's cores, so pinned roles are never refused) with the host's CUDA
    devices. Either way a request the cluster cannot place is refused here, naming the role
    and what is missing, instead of leaving its actor pending. Role output (prints, vLLM's
    engine lines) reaches the driver, and so its log file.
    """
    import ray  # noqa: PLC0415

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        else:
            gpus = _role_gpus(resources)
            host_gpus = _host_gpus() if gpus else 0
            if gpus > host_gpus:
                raise ValueError(
                    f"resources: the roles ask for {gpus:g} GPUs ({_gpu_split(resources)}) but "
                    f"this host has {host_gpus} CUDA device(s) and RAY_ADDRESS names no cluster"
                )
            wanted = sum(r.num_cpus for _, r in _roles(resources))
            ray.init(
                num_cpus=max(int(wanted + 0.999), os.cpu_count() or 1),
                num_gpus=host_gpus,
                include_dashboard=False,
                log_to_driver=True,
            )
    check_feasible(resources, _node_totals())


def _roles(resources: ResourcesConfig) -> list[tuple[str, RoleResources]]:
    return [
        ("rollout", resources.rollout),
        ("learner", resources.learner),
        ("teacher", resources.teacher),
    ]


def _role_gpus(resources: ResourcesConfig) -> float:
    return sum(r.num_gpus for _, r in _roles(resources))


def _gpu_split(resources: ResourcesConfig) -> str:
    return ", ".join(f"{name} {r.num_gpus:g}" for name, r in _roles(resources))


def _host_gpus() -> int:
    import torch  # noqa: PLC0415

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _node_totals() -> list[dict[str, float]]:
    """Each alive node's CPU and GPU totals."""
    import ray  # noqa: PLC0415

    return [
        {"CPU": float(n["Resources"].get("CPU", 0)), "GPU": float(n["Resources"].get("GPU", 0))}
        for n in ray.nodes()
        if n.get("Alive")
    ]


def check_feasible(resources: ResourcesConfig, nodes: Sequence[dict[str, float]]) -> None:
    """Refuse roles the cluster cannot place, naming the role and what is missing: an actor
    larger than every node, or GPUs over the cluster's total. (Ray would leave such an actor
    pending with no error.)"""
    total_gpus = sum(n["GPU"] for n in nodes)
    if _role_gpus(resources) > total_gpus + 1e-9:
        raise ValueError(
            f"resources: the roles ask for {_role_gpus(resources):g} GPUs "
            f"({_gpu_split(resources)}) but the cluster has {total_gpus:g}"
        )
    for name, role in _roles(resources):
        ranks = getattr(role, "ranks", 1) * getattr(role, "engines", 1)
        cpus, gpus = role.num_cpus / ranks, role.num_gpus / ranks
        if not any(n["CPU"] >= cpus - 1e-9 and n["GPU"] >= gpus - 1e-9 for n in nodes):
            parts = "engines" if name == "rollout" else "ranks"
            actor = f"each of its {ranks} {parts}" if ranks > 1 else "its actor"
            biggest = max(nodes, key=lambda n: (n["GPU"], n["CPU"]), default={"CPU": 0, "GPU": 0})
            raise ValueError(
                f"resources.{name}: {actor} needs {cpus:g} CPUs and {gpus:g} GPUs on one node; "
                f"the largest node has {biggest['CPU']:g} CPUs and {biggest['GPU']:g} GPUs"
            )


@dataclass(frozen=True)
class Reservation:
    """A role's placement group: ``count`` equal bundles, one per rank or engine."""

    role: str
    group: Any  # ray.util.placement_group.PlacementGroup
    count: int


def bundles_of(role: RoleResources) -> tuple[int, dict[str, float]]:
    """(number of bundles, one bundle's resources): a bundle per learner rank or per engine
    (one for a one-engine rollout role, whose worker holds the engine)."""
    count = 1
    if isinstance(role, LearnerResources):
        count = role.ranks
    elif isinstance(role, RolloutResources):
        count = role.engines
    bundle = {"CPU": role.num_cpus / count, "GPU": role.num_gpus / count}
    return count, {key: value for key, value in bundle.items() if value > 0}


def reserve(name: str, role: RoleResources, *, timeout_s: float) -> Reservation | None:
    """Reserve the role's bundles (None when it holds no CPUs or GPUs: nothing to place)."""
    import ray  # noqa: PLC0415
    from ray.util.placement_group import placement_group, remove_placement_group  # noqa: PLC0415

    count, bundle = bundles_of(role)
    if not bundle:
        return None
    group = placement_group(
        [dict(bundle) for _ in range(count)],
        strategy=role.placement.upper(),
        name=f"thundersync-{name}-{uuid.uuid4().hex[:8]}",
    )
    if not group.wait(timeout_seconds=timeout_s):
        remove_placement_group(group)
        free = ray.available_resources()
        raise ValueError(
            f"resources.{name}: {count} bundle(s) of {_amounts(bundle)} ({role.placement}) "
            f"could not be placed within {timeout_s:g} s (resources.placement_timeout_s); "
            f"the cluster has {_amounts({k: free.get(k, 0.0) for k in ('CPU', 'GPU')})} free"
        )
    return Reservation(name, group, count)


def release(reservations: Iterable[Reservation | None]) -> None:
    """Give the placement groups back (their actors end with them)."""
    from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

    for reservation in reservations:
        if reservation is not None:
            with contextlib.suppress(Exception):  # already gone with its cluster
                remove_placement_group(reservation.group)


def in_bundle(reservation: Reservation | None, index: int = 0) -> dict[str, Any]:
    """Actor options placing it in bundle ``index`` of ``reservation`` (none: Ray's default)."""
    if reservation is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

    if not 0 <= index < reservation.count:
        raise ValueError(
            f"{reservation.role}: bundle {index} asked of a group of {reservation.count}"
        )
    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=reservation.group, placement_group_bundle_index=index
        )
    }


def _amounts(resources: dict[str, float]) -> str:
    return ", ".join(f"{value:g} {key}" for key, value in resources.items()) or "nothing"


def remote_role(
    cls: type,
    role: RoleResources,
    *,
    max_concurrency: int = 1,
    reservation: Reservation | None = None,
) -> Any:
    """``cls`` as a Ray actor class with the role's resources (in the reservation's first
    bundle when given)."""
    import ray  # noqa: PLC0415

    return ray.remote(cls).options(
        num_cpus=role.num_cpus,
        num_gpus=role.num_gpus,
        max_concurrency=max_concurrency,
        **in_bundle(reservation),
    )


def check_cores(cores: Sequence[int], key: str) -> None:
    """Refuse cores this host does not have, naming the config ``key``."""
    available = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
    bad = [c for c in cores if c not in available]
    if bad:
        raise ValueError(f"{key}: cores {bad} do not exist on this host ({sorted(available)})")


def pin_to_cores(cores: Sequence[int]) -> None:
    """Pin this process (every thread it has, and what they spawn later) to ``cores``; size
    torch's pool to match.

    ``sched_setaffinity(0, ...)`` alone moves the calling thread only: a Ray actor already
    runs its executor and gRPC threads when ``__init__`` pins, and a grader or sandbox that
    such a thread starts would otherwise run on any core.
    """
    if not cores:
        return
    check_cores(cores, "resources")
    wanted = set(cores)
    os.sched_setaffinity(0, wanted)
    for tid in _thread_ids():
        # A thread may end meanwhile, or not be ours to move.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(tid, wanted)
    os.environ["OMP_NUM_THREADS"] = str(len(cores))
    # vLLM CPU binds its OpenMP threads itself; keep them on the role's cores.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores)
    import torch  # noqa: PLC0415

    torch.set_num_threads(len(cores))


def set_nice(nice: int | None, key: str) -> int:
    """Give every thread of this process the niceness ``nice`` (Linux keeps it per thread,
    and a thread started later takes its starter's); returns the niceness in effect.

    Where lowering it is not permitted (no CAP_SYS_NICE), prints a line naming ``key`` to
    stderr and leaves every thread as it was.
    """
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice is None:
        return current
    before: dict[int, int] = {}
    try:
        for tid in _thread_ids() or [0]:
            with contextlib.suppress(ProcessLookupError):  # a thread may end meanwhile
                before[tid] = os.getpriority(os.PRIO_PROCESS, tid)
                os.setpriority(os.PRIO_PROCESS, tid, nice)
    except PermissionError:
        for tid, was in before.items():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.setpriority(os.PRIO_PROCESS, tid, was)
        print(
            f"{key}: niceness {nice} not permitted here (lowering it needs CAP_SYS_NICE); "
            f"this process stays at {current}",
            file=sys.stderr,
            flush=True,
        )
        return current
    return nice


def _thread_ids() -> list[int]:
    """The kernel ids of this process's threads (Linux); empty where /proc is missing."""
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return []


def device_count(resources: ResourcesConfig) -> int:
    """Devices counted for device-hours: GPUs when roles hold any, else CPU cores."""
    if resources.devices:
        return resources.devices
    roles = (resources.rollout, resources.learner, resources.teacher)
    gpus = sum(r.num_gpus for r in roles)
    if gpus:
        return int(gpus + 0.999)
    pinned = {c for r in roles for c in r.cores}
    return len(pinned) if pinned else int(sum(r.num_cpus for r in roles) + 0.999)
