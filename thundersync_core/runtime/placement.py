"""Ray start-up, actor placement with explicit resources, and core pinning."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

from thundersync_core.config import ResourcesConfig, RoleResources


def start_ray(resources: ResourcesConfig) -> None:
    """Start (or join) Ray with enough CPUs for the configured roles.

    ``RAY_ADDRESS`` set: join that cluster. Otherwise a local instance sized to the roles
    (at least the host's cores, so pinned roles are never refused).
    """
    import ray  # noqa: PLC0415

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        return
    wanted = resources.rollout.num_cpus + resources.learner.num_cpus + resources.teacher.num_cpus
    ray.init(
        num_cpus=max(int(wanted + 0.999), os.cpu_count() or 1),
        num_gpus=int(resources.rollout.num_gpus + resources.learner.num_gpus),
        include_dashboard=False,
        log_to_driver=False,
    )


def remote_role(cls: type, role: RoleResources, *, max_concurrency: int = 1) -> Any:
    """``cls`` as a Ray actor class with the role's resources."""
    import ray  # noqa: PLC0415

    return ray.remote(cls).options(
        num_cpus=role.num_cpus, num_gpus=role.num_gpus, max_concurrency=max_concurrency
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
