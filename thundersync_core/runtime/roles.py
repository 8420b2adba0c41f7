"""The roles of a run as Ray actors: the one builder training and the bench use, and how
a role fault is told from any other error.

Each builder gives the actor the resources (and cores) the config names for its role. A
role fault is a role's process that died (SIGKILL, out of memory, a lost node) or the
engine inside the rollout role that died; training restarts the roles from the latest
checkpoint after one (``train.py``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from thundersync_core.config import LearnerResources, RoleResources, TrainConfig

if TYPE_CHECKING:
    from thundersync_core.runtime.placement import Reservation

__all__ = [
    "first_line",
    "give_engines_the_master",
    "named_roles",
    "reserve_roles",
    "role_fault",
    "start_learner",
    "start_roles",
    "start_rollout",
    "start_teacher",
    "stop_actors",
    "stop_roles",
]


def reserve_roles(
    config: TrainConfig, *, teacher: bool, learners: dict[str, LearnerResources] | None = None
) -> dict[str, Reservation | None]:
    """A placement group for each role (``learners``: several learners by name, as the bench
    runs), all reserved before any actor starts; one the cluster cannot place is refused
    naming the role, and what was reserved before it is given back."""
    from thundersync_core.runtime.placement import release, reserve  # noqa: PLC0415

    res = config.resources
    wanted: dict[str, RoleResources] = {"rollout": res.rollout}
    if learners:
        wanted |= {f"learner.{name}": role for name, role in learners.items()}
    else:
        wanted["learner"] = res.learner
    if teacher:
        wanted["teacher"] = res.teacher
    reserved: dict[str, Reservation | None] = {}
    try:
        for name, role in wanted.items():
            reserved[name] = reserve(name.split(".")[0], role, timeout_s=res.placement_timeout_s)
    except BaseException:
        release(reserved.values())
        raise
    return reserved


def start_rollout(
    config: TrainConfig,
    engine_dir: Path,
    pool: dict[str, Path],
    *,
    policy_version: int = 0,
    reservation: Reservation | None = None,
) -> Any:
    """The rollout worker (engine, agent, sandboxes, graders) serving ``engine_dir``."""
    from thundersync_core.runtime.placement import remote_role  # noqa: PLC0415
    from thundersync_core.runtime.rollout_worker import RolloutWorker  # noqa: PLC0415

    res = config.resources.rollout
    several = res.engines > 1
    # With several engines they hold the role's GPUs and CPUs as their own actors, one a
    # bundle; the worker (agent, sandboxes, graders) runs on the role's cores beside them.
    worker = res.model_copy(update={"num_cpus": 0.0, "num_gpus": 0.0}) if several else res
    return remote_role(
        RolloutWorker, worker, max_concurrency=2, reservation=None if several else reservation
    ).remote(
        engine_dir,
        pool,
        config.rollout,
        cores=res.cores,
        seed=config.seed,
        policy_version=policy_version,
        resources=res,
        placement=reservation if several else None,
        lora_rank=config.policy.lora.r if config.policy.lora is not None else None,
    )


def start_teacher(
    config: TrainConfig, teacher_dir: Path, *, reservation: Reservation | None = None
) -> Any:
    """The OPD teacher: a frozen model scoring turns."""
    from thundersync_core.runtime.placement import remote_role  # noqa: PLC0415
    from thundersync_core.runtime.teacher_worker import TeacherWorker  # noqa: PLC0415

    res = config.resources.teacher
    return remote_role(TeacherWorker, res, reservation=reservation).remote(
        teacher_dir, cores=res.cores, top_k=config.opd_teacher_top_k, num_gpus=res.num_gpus
    )


def start_learner(
    config: TrainConfig,
    policy_dir: Path,
    *,
    publish_dir: Path,
    resume_from: Path | None = None,
    resources: LearnerResources | None = None,
    reservation: Reservation | None = None,
) -> Any:
    """The learner: one worker, or a group facade over ``resources.learner.ranks`` ranks
    (rank r in bundle r of ``reservation``). ``resources`` overrides the config's (the
    bench gives two learners half each)."""
    from thundersync_core.runtime.learner_worker import LearnerWorker  # noqa: PLC0415
    from thundersync_core.runtime.placement import remote_role  # noqa: PLC0415

    res = resources or config.resources.learner
    if res.ranks > 1:
        from thundersync_core.runtime.learner_group import LearnerGroup  # noqa: PLC0415

        # The facade only routes sources; the ranks it starts hold the learner's resources.
        facade: RoleResources = res.model_copy(update={"num_cpus": 0.0, "num_gpus": 0.0})
        return remote_role(LearnerGroup, facade).remote(
            policy_dir,
            config,
            publish_dir=publish_dir,
            resume_from=resume_from,
            resources=res,
            placement=reservation,
        )
    return remote_role(LearnerWorker, res, reservation=reservation).remote(
        policy_dir, config, publish_dir=publish_dir, resume_from=resume_from
    )


def check_chat_format(config: TrainConfig, policy_dir: Path) -> None:
    """Refuse at start, before any role is placed, a policy whose chat template would not
    render the agent's episodes as the agent builds them (``rollout/chat.py``): the error
    names the first differing token. The rollout role builds the same format again."""
    from thundersync_core.policy.io import load_tokenizer  # noqa: PLC0415
    from thundersync_core.rollout.chat import chat_format  # noqa: PLC0415

    chat_format(load_tokenizer(policy_dir), Path(policy_dir), config.rollout)  # type: ignore[arg-type]


def start_roles(
    config: TrainConfig,
    *,
    publish_dir: Path,
    policy_dir: Path,
    teacher_dir: Path | None,
    pool: dict[str, Path],
    checkpoint: Path | None,
) -> tuple[Any, int, dict[str, Any]]:
    """Every role of a training run, from ``checkpoint`` when given (resume); returns the
    roles once each answers, the first step and the checkpoint's state."""
    import ray  # noqa: PLC0415

    from thundersync_core.perfmodel.memory import check_config_fits  # noqa: PLC0415
    from thundersync_core.schedules.base import Roles  # noqa: PLC0415

    check_config_fits(config, policy_dir)  # before anything is reserved or loaded
    check_chat_format(config, policy_dir)
    state: dict[str, Any] = {"step": 0, "policy_version": 0, "extra": {}}
    if checkpoint is not None:
        state = json.loads((checkpoint / "state.json").read_text())
        print(f"[resume] from {checkpoint} (step {state['step']})", flush=True)
    # Adapter publication: the engines serve the base weights, the adapter comes on top.
    adapters = config.rollout.lora_publication == "adapter"
    engine_dir = checkpoint / "model" if checkpoint is not None and not adapters else policy_dir
    reserved = reserve_roles(config, teacher=teacher_dir is not None)
    roles = Roles(None, None, None, reservations=list(reserved.values()))
    try:
        roles.learner = start_learner(
            config,
            policy_dir,
            publish_dir=publish_dir,
            resume_from=checkpoint,
            reservation=reserved["learner"],
        )
        roles.rollout = start_rollout(
            config,
            engine_dir,
            pool,
            policy_version=int(state["policy_version"]),
            reservation=reserved["rollout"],
        )
        if teacher_dir is not None:
            roles.teacher = start_teacher(config, teacher_dir, reservation=reserved["teacher"])
        # Wait for every role to be up, so step 0 measures training and not start-up.
        ray.get(
            [a.version.remote() for a in (roles.rollout, roles.learner)]
            + ([roles.teacher.ready.remote()] if roles.teacher else [])
        )
        if config.rollout.publication == "collective":
            join_publication_group(config, roles.learner, roles.rollout)
        if checkpoint is not None and (
            adapters or state.get("export_dtype", "float32") != "float32"
        ):
            give_engines_the_master(config, roles.learner, roles.rollout)
    except BaseException:
        stop_roles(roles)
        raise
    return roles, int(state["step"]), state


def stop_roles(roles: Any) -> None:
    """Kill every role's actor and give their placement groups back."""
    stop_actors([actor for _name, actor in named_roles(roles)], roles.reservations)
    roles.reservations = []


def stop_actors(actors: Any, reservations: Any) -> None:
    """Kill ``actors`` (None and dead ones skipped), then release ``reservations``."""
    import ray  # noqa: PLC0415

    from thundersync_core.runtime.placement import release  # noqa: PLC0415

    for actor in actors:
        if actor is not None:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(actor)
    release(reservations)


#: Forming the publication group and each broadcast wait at most this long.
PUBLICATION_TIMEOUT_S = 600.0


def join_publication_group(config: TrainConfig, learner: Any, rollout: Any) -> int:
    """The learner (rank 0) and every engine worker form the publication group; returns its
    size. The group's address is the learner's node, its dtype the engines'."""
    import ray  # noqa: PLC0415

    from thundersync_core.rollout.weight_sync import GroupAddress  # noqa: PLC0415

    host = ray.get(learner.node_ip.remote())
    address = GroupAddress(
        backend="nccl" if config.resources.learner.num_gpus > 0 else "gloo",
        host=host,
        port=ray.get(learner.free_port.remote(host)),
        world_size=1 + ray.get(rollout.publication_workers.remote()),
        timeout_s=PUBLICATION_TIMEOUT_S,
    )
    layout = ray.get(learner.weight_layout.remote())
    dtype = ray.get(rollout.engine_dtype.remote())
    bucket = int(config.rollout.publication_bucket_mb * 2**20)
    ray.get(
        [
            learner.join_weight_group.remote(address, dtype=dtype, bucket_bytes=bucket),
            rollout.join_weight_group.remote(address, layout=layout, bucket_bytes=bucket),
        ]
    )
    return address.world_size


def give_engines_the_master(config: TrainConfig, learner: Any, rollout: Any) -> None:
    """Load the learner's float32 weights into the engines, which started from a checkpoint's
    lower-precision export, or (adapter publication) from the base weights (a resume): the
    first step then samples what an uninterrupted run samples."""
    import ray  # noqa: PLC0415

    from thundersync_core.schedules.base import publish_weights  # noqa: PLC0415

    if config.rollout.publication == "collective":
        path, version = "", int(ray.get(learner.version.remote()))
    else:
        path, version = ray.get(learner.weights_and_version.remote())
    publish_weights(config, learner, rollout, version, path)


def role_fault(exc: BaseException, roles: Any, engine_fault: str | None = None) -> str | None:
    """What died, when ``exc`` says a role's process (or the engine inside the rollout
    role) is gone; None for any other error (a refused step, a bug: not retried).
    ``engine_fault`` is what the engine watchdog saw before it stopped the rollout role."""
    import ray  # noqa: PLC0415

    from thundersync_core.rollout.engine import EngineFailed  # noqa: PLC0415

    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
    if isinstance(cause, EngineFailed) or isinstance(exc, EngineFailed):
        return f"rollout engine failed: {first_line(cause)}"
    if not isinstance(cause, ray.exceptions.RayActorError):
        return None
    if engine_fault is not None:
        return f"rollout engine failed: {engine_fault}"
    dead = [name for name, actor in named_roles(roles) if not _answers(actor)]
    which = " and ".join(dead) if dead else "a"
    return f"the {which} role's process died ({first_line(cause)})"


def first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def named_roles(roles: Any) -> list[tuple[str, Any]]:
    named = [("rollout", roles.rollout), ("learner", roles.learner), ("teacher", roles.teacher)]
    return [(name, actor) for name, actor in named if actor is not None]


def _answers(actor: Any, timeout_s: float = 10.0) -> bool:
    import ray  # noqa: PLC0415

    try:
        ray.get(actor.pid.remote(), timeout=timeout_s)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
    return True
