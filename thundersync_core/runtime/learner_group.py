"""The learner role over W ranks: Ray actors forming one torch.distributed process group.

``LearnerGroup`` is what the schedule drivers hold when ``resources.learner.ranks`` > 1: it
answers the same calls as ``LearnerWorker`` (begin, submit, submit_turn, submit_scored,
step, weights_and_version, save_checkpoint, version). It routes each group to a rank when
the group's first source arrives (``GroupAssigner``: least predicted work, deterministic in
the arrival order) and forwards every later source of the group there, without waiting.
Each ``LearnerRank`` streams its own sources through the single-device learner; at
``step`` every rank reaches the barrier, whose reducer sums the unscaled accumulators and
the normalising scalars over the group (exact: see ``parallel/data_parallel.py``), clips by
the global norm and takes one optimizer step (``parallel/fsdp.py``: replicated or FSDP2).
With ``policy.lora`` every rank applies the adapters with the run's seed before its state is
built, as the one-process learner does, so the ranks and that learner start identical.

Ticks: with ``learner_shared_groups`` every rank registers every group and landed
trajectories wait in a ``TickPlanner``; with the sharded gradient, OPD turns wait in a
``TurnTickPlanner`` (each routed to its group's rank as above). A dispatcher thread hands
the ranks the next tick (at most one source a rank) as soon as the last is done on every
rank, so what landed meanwhile goes together; ``step`` first waits for the ticks planned.

Rendezvous: the group asks rank 0 for a free port on its node; when every rank sits on one
node the address is 127.0.0.1, otherwise rank 0's node IP. The backend is NCCL when the
ranks hold GPUs, gloo otherwise. Every collective times out after ``COLLECTIVE_TIMEOUT_S``,
so a rank that dies inside the barrier fails the step instead of hanging it; a rank that
refuses the barrier tells the others in the barrier's first collective (``refusing_ranks``),
so every rank refuses at once. The ranks sit in one placement group, rank r in bundle r
(``runtime/placement.py``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from thundersync_core.batch import Trajectory, Turn
from thundersync_core.config import LearnerResources, TrainConfig
from thundersync_core.parallel.data_parallel import (
    GroupAssigner,
    ProcessGroupReducer,
    ShardedGradient,
    init_process_group,
    predicted_tokens,
)
from thundersync_core.parallel.shared_groups import (
    SharedGroupsGRPOLearner,
    TickEntry,
    TickPlanner,
    TurnTickPlanner,
)
from thundersync_core.policy.io import load_model, load_tokenizer
from thundersync_core.runtime.learner_worker import LearnerWorker, build_learner, learner_device
from thundersync_core.runtime.placement import Reservation, in_bundle, pin_to_cores, set_nice
from thundersync_core.streaming.base import LearnerRefusal

if TYPE_CHECKING:
    from thundersync_core.policy.lora import LoraSettings
    from thundersync_core.rollout.weight_sync import GroupAddress

#: A barrier waits for the slowest rank's queued sources; generous, but finite.
COLLECTIVE_TIMEOUT_S = 1800.0


def lora_settings(config: TrainConfig) -> LoraSettings | None:
    """The adapters ``policy.lora`` asks for (None: full fine-tuning)."""
    lora = config.policy.lora
    if lora is None:
        return None
    from thundersync_core.policy.lora import LoraSettings  # noqa: PLC0415

    return LoraSettings(lora.r, lora.alpha, lora.dropout, lora.target_modules)


def rank_cores(cores: tuple[int, ...], rank: int, world_size: int) -> tuple[int, ...]:
    """Rank ``rank``'s share of the learner's pinned cores (all of them when too few)."""
    if len(cores) < world_size:
        return cores
    return cores[rank::world_size]


class LearnerRank(LearnerWorker):
    """One rank: the single-device learner, a share of the barrier, a shard of the state.

    Built in two calls, because the rendezvous address is known only once rank 0 is placed:
    the constructor records the arguments, ``setup`` joins the group and loads the policy.
    """

    def __init__(
        self,
        model_dir: Path,
        config: TrainConfig,
        *,
        rank: int,
        world_size: int,
        publish_dir: Path,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
    ) -> None:
        # LearnerWorker.__init__ would build the optimizer before the process group
        # exists; ``setup`` sets the same attributes once it does.
        self.model_dir = Path(model_dir)
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.publish_dir = Path(publish_dir)
        self.timeout_s = timeout_s

    def setup(self, address: str, port: int, resume_from: Path | None) -> int:
        """Join the process group, load the policy (and checkpoint); returns the version."""
        from thundersync_core.parallel.dcp import load_group_checkpoint  # noqa: PLC0415
        from thundersync_core.parallel.fsdp import (  # noqa: PLC0415
            build_train_state,
            load_sharded_state,
        )

        res = self.config.resources.learner
        pin_to_cores(rank_cores(res.cores, self.rank, self.world_size))
        set_nice(res.nice, "resources.learner.nice")
        torch.manual_seed(self.config.seed)
        self.device = learner_device(self.config, f"learner rank {self.rank}")
        init_process_group(
            "nccl" if self.device == "cuda" else "gloo",
            rank=self.rank,
            world_size=self.world_size,
            address=address,
            port=port,
            timeout_s=self.timeout_s,
        )
        self.tokenizer = load_tokenizer(self.model_dir)
        compute_dtype = getattr(torch, self.config.learner_dtype)
        lora = lora_settings(self.config)
        if self.config.learner_sharding == "fsdp2":
            # Rank 0 reads the weights and the ranks take their shards: no rank holds a
            # whole float32 copy (with LoRA the frozen base is whole on every rank and only
            # the adapters' master is sharded).
            self.state = load_sharded_state(
                self.model_dir,
                lr=self.config.lr,
                device=self.device,
                compute_dtype=compute_dtype,
                lora=lora,
                lora_seed=self.config.seed,
            )
        else:
            master = load_model(self.model_dir).to(self.device)  # type: ignore[arg-type]
            if lora is not None:
                from thundersync_core.policy.lora import apply_lora  # noqa: PLC0415

                apply_lora(master, lora, seed=self.config.seed)
            self.state = build_train_state(
                master,
                sharding="replicated",
                lr=self.config.lr,
                device_type=self.device,
                compute_dtype=compute_dtype,
            )
        model = self.model = self.state.model
        self.optimizer = self.state.optimizer
        version = 0
        if resume_from is not None:
            record = load_group_checkpoint(
                Path(resume_from), module=self.state.checkpoint_module(), optimizer=self.optimizer
            )
            self.state.refresh_replica()
            version = int(record["policy_version"])
        self.learner = build_learner(self.config, model, version)
        self.learner.reducer = ProcessGroupReducer()
        if self.config.learner_sharded_gradient:
            self.learner.sharded_grad = ShardedGradient(
                self.learner.params, dtype=self.learner.accum_dtype
            )
        self._start_accounting()
        return version

    def add_group(self, group_id: str, spec: tuple[tuple[int, ...], int]) -> None:
        from thundersync_core.streaming.base import GroupSpec  # noqa: PLC0415

        self._guarded(lambda s: self.learner.add_groups({group_id: GroupSpec(*s)}), spec)

    def flush(self) -> None:
        """Every rank, after a group's last trajectory: the sharded batch gradient takes
        what the closed groups added (a collective; a rank that refused sends zeros)."""
        assert self.learner.sharded_grad is not None
        self.learner.sharded_grad.flush()

    def tick(self, entries: list[TickEntry], mine: list[Any]) -> None:
        """Every rank, the same ``entries`` (shared groups): this rank's trajectory, if the
        tick hands it one, then the tick's reductions and closes. OPD turns (``mine``: this
        rank's turn, its release time and its group's spec when new): the turn, then the
        sharded gradient's flush, which every rank takes even when its turn was refused."""
        if not isinstance(self.learner, SharedGroupsGRPOLearner):
            self._turn_tick(mine)
            return
        t0 = time.time()
        trajs = [traj for traj, _ in mine]
        self._guarded(lambda each: self.learner.run_tick(entries, each), trajs)
        for traj, release_s in mine:
            self._record(t0, traj.trajectory_id, release_s, traj.group_id)
            self._count_whole(traj)
        if not mine:  # the tick's collectives: busy time of this rank too
            self.intervals.append((t0, time.time()))

    def _turn_tick(self, mine: list[tuple[Turn, float | None, tuple | None]]) -> None:
        from thundersync_core.streaming.base import GroupSpec  # noqa: PLC0415

        assert self.learner.sharded_grad is not None
        refusal: Exception | None = None
        for turn, release_s, spec in mine:
            try:
                if spec is not None:
                    self.learner.add_groups({turn.group_id: GroupSpec(*spec)})
                self.submit_turn((turn, release_s))
            except (LearnerRefusal, ValueError) as exc:
                self._error = self._error or str(exc)
                refusal = exc
        t0 = time.time()
        self.learner.sharded_grad.flush()
        self.intervals.append((t0, time.time()))
        if refusal is not None:
            raise refusal

    def refusal(self) -> tuple[str, bool] | None:
        """The first refusal recorded while sources streamed in (checked before the barrier),
        and whether this rank refused only because another rank did."""
        return None if self._error is None else (self._error, self._error_is_peer)

    def save_checkpoint(self, root: str, step: int, extra: dict[str, Any]) -> str:
        from thundersync_core.parallel.dcp import save_group_checkpoint  # noqa: PLC0415

        path = save_group_checkpoint(
            Path(root),
            step=step,
            state=self.state,
            policy_version=self.learner.policy_version,
            sharding=self.config.learner_sharding,
            model_config=self.model.config,
            extra=extra,
            export_dtype=getattr(torch, self.config.checkpoint_export_dtype),
        )
        if self.rank == 0:
            self.tokenizer.save_pretrained(path / "model")  # type: ignore[attr-defined]
        return str(path)

    def state_bytes(self) -> dict[str, int]:
        return self.state.state_bytes() | {"accumulators": self.learner.accumulator_bytes()}

    # -- collective publication: rank 0 sends, every rank takes part in the gathers --------
    def join_weight_group(self, address: GroupAddress, *, dtype: str, bucket_bytes: int) -> int:
        """Rank 0 joins the publication group; the others only walk the weights with it
        (a sharded master is gathered one tensor at a time, a collective of every rank)."""
        if self.rank == 0:
            return super().join_weight_group(address, dtype=dtype, bucket_bytes=bucket_bytes)
        self.weight_layout()
        return self.rank

    def send_weights(self, verify: bool = False) -> dict[str, Any]:
        if self.rank == 0:
            return super().send_weights(verify)
        if self.learner.in_batch:
            raise LearnerRefusal(
                f"rank {self.rank}: refusing to publish weights version "
                f"{self.learner.policy_version}: a batch is in progress"
            )
        for _ in range(2 if verify else 1):  # rank 0 walks twice to checksum
            for _ in self.state.named_weights():
                pass
        return {}


class LearnerGroup:
    """The learner role's facade over W ``LearnerRank`` actors (same calls as LearnerWorker)."""

    def __init__(
        self,
        model_dir: Path,
        config: TrainConfig,
        *,
        publish_dir: Path,
        resume_from: Path | None = None,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
        resources: LearnerResources | None = None,
        placement: Reservation | None = None,
    ) -> None:
        import ray  # noqa: PLC0415

        res = resources or config.resources.learner
        world = res.ranks
        self.ranks: list[Any] = [
            ray.remote(LearnerRank)
            .options(
                num_cpus=res.num_cpus / world,
                num_gpus=res.num_gpus / world,
                **in_bundle(placement, r),
            )
            .remote(
                model_dir,
                config,
                rank=r,
                world_size=world,
                publish_dir=publish_dir,
                timeout_s=timeout_s,
            )
            for r in range(world)
        ]
        nodes = ray.get([r.node_ip.remote() for r in self.ranks])
        address = "127.0.0.1" if len(set(nodes)) == 1 else nodes[0]
        port = ray.get(self.ranks[0].free_port.remote(address))
        versions = _get_all([r.setup.remote(address, port, resume_from) for r in self.ranks])
        if len(set(versions)) != 1:
            raise LearnerRefusal(f"learner ranks resumed at different versions: {versions}")
        self.assigner = GroupAssigner(world)
        self._groups: dict[str, tuple[tuple[int, ...], int]] = {}
        #: Trajectories routed per group in this batch (a sharded gradient is flushed by
        #: every rank after each group's last).
        self._routed: dict[str, int] = {}
        self._flush = config.learner_sharded_gradient
        self._error: str | None = None
        #: Shared groups: landed trajectories wait in the planner; a dispatcher thread hands
        #: out the next tick whenever the last one is done on every rank.
        self._shared = config.learner_shared_groups
        self._open_cap = (
            config.max_open_groups if config.schedule == "thundersync" else config.groups_per_step
        )
        self._planner: TickPlanner | TurnTickPlanner | None = None
        self._releases: dict[str, float | None] = {}
        self._ticking = False
        self._stalled = False
        self._cv = threading.Condition()
        #: OPD turns with the sharded gradient: ticks of one turn per rank, each followed
        #: by every rank's flush (whole trajectories still flush after each group).
        self._turn_ticks = config.objective == "opd" and config.learner_sharded_gradient
        if self._shared or self._turn_ticks:
            threading.Thread(target=self._dispatch_ticks, daemon=True).start()

    def pid(self) -> int:
        """The facade's process id (its ranks are owned by it and die with it)."""
        return os.getpid()

    def version(self) -> int:
        import ray  # noqa: PLC0415

        return int(ray.get(self.ranks[0].version.remote()))

    def node_ids(self) -> list[str]:
        """Each rank's Ray node, by rank."""
        return [n for ids in _get_all([r.node_ids.remote() for r in self.ranks]) for n in ids]

    def begin(self, groups: dict[str, tuple[tuple[int, ...], int]]) -> int:
        self.assigner.reset()
        self._groups = dict(groups)
        self._routed = {}
        self._error = None
        if self._shared:  # every rank registers every group
            sizes = {g: size for g, (_, size) in groups.items()}
            with self._cv:
                self._planner = TickPlanner(len(self.ranks), self._open_cap, sizes)
                self._releases = {}
                self._stalled = False
            versions = _get_all([r.begin.remote(groups) for r in self.ranks])
            return int(versions[0])
        if self._turn_ticks:
            with self._cv:
                self._planner = TurnTickPlanner(len(self.ranks))
                self._stalled = False
        versions = _get_all([r.begin.remote({}) for r in self.ranks])
        return int(versions[0])

    def submit(self, traj: Trajectory, release_s: float | None = None) -> None:
        if self._shared:
            self._plan(traj, release_s)
            return
        rank = self._route(traj)
        if rank is not None:
            rank.submit.remote(traj, release_s)
            self._routed[traj.group_id] = self._routed.get(traj.group_id, 0) + 1
            if self._flush and self._routed[traj.group_id] == self._groups[traj.group_id][1]:
                for each in self.ranks:  # queued behind each rank's sources, in this order
                    each.flush.remote()

    def submit_turn(self, scored: tuple[Turn, float]) -> None:
        if self._turn_ticks:
            turn, release_s = scored
            with self._cv:
                if self._error is not None or self._planner is None:
                    return
                rank, new, spec = self._assign(turn)
                assert isinstance(self._planner, TurnTickPlanner)
                self._planner.add(rank, (turn, release_s, spec if new else None))
                self._stalled = False
                self._cv.notify_all()
            return
        rank = self._route(scored[0])
        if rank is not None:
            rank.submit_turn.remote(scored)

    def submit_scored(self, scored: tuple[Trajectory, float]) -> None:
        self.submit(*scored)

    # -- shared groups: lockstep ticks ------------------------------------------------------
    def _plan(self, traj: Trajectory, release_s: float | None) -> None:
        with self._cv:
            if self._error is not None or self._planner is None:
                return
            assert isinstance(self._planner, TickPlanner)
            try:
                self._planner.add(traj)
            except LearnerRefusal as exc:
                self._error = str(exc)
                raise
            self._releases[traj.trajectory_id] = release_s
            self._stalled = False  # the dispatcher plans again before a step may go
            self._cv.notify_all()

    def _dispatch_ticks(self) -> None:
        """The dispatcher: the next tick as soon as the last is done on every rank (those
        that landed meanwhile go together, one per rank)."""
        while True:
            with self._cv:
                tick: list[tuple[TickEntry, Any]] = []
                while not tick:
                    planner = self._planner
                    if self._error is None and planner is not None and planner.pending:
                        tick = planner.next_tick()
                        self._stalled = not tick
                        if tick:
                            break
                    self._cv.notify_all()
                    self._cv.wait()
                self._ticking = True
                entries = [entry for entry, _ in tick]
                mine: list[list[Any]] = [[] for _ in self.ranks]
                for entry, source in tick:
                    if isinstance(source, Trajectory):  # shared groups: with its release
                        release_s = self._releases.pop(source.trajectory_id, None)
                        mine[entry.rank].append((source, release_s))
                    else:
                        mine[entry.rank].append(source)
            try:
                _get_all([r.tick.remote(entries, m) for r, m in zip(self.ranks, mine, strict=True)])
            except Exception as exc:  # every rank refused the tick, or one died: stop ticking
                with self._cv:
                    self._error = f"a tick failed: {exc}"
            finally:
                with self._cv:
                    self._ticking = False
                    self._cv.notify_all()

    def _drain_ticks(self) -> None:
        """Wait until every planned tick ran (or one failed, or the rest cannot go)."""
        with self._cv:
            while self._ticking or (
                self._error is None
                and self._planner is not None
                and self._planner.pending
                and not self._stalled
            ):
                self._cv.wait()

    def _route(self, source: Trajectory | Turn) -> Any:
        """The rank actor holding the source's group (chosen now for a new group)."""
        if self._error is not None:
            return None
        rank, new, spec = self._assign(source)
        if new:
            self.ranks[rank].add_group.remote(source.group_id, spec)
        return self.ranks[rank]

    def _assign(self, source: Trajectory | Turn) -> tuple[int, bool, tuple[tuple[int, ...], int]]:
        """(rank, newly assigned, the group's spec); refused for a group not in the batch."""
        spec = self._groups.get(source.group_id)
        if spec is None:
            self._error = (
                f"trajectory {source.trajectory_id!r}: group {source.group_id!r} is not "
                "registered in this batch"
            )
            raise LearnerRefusal(self._error)
        rank, new = self.assigner.assign(source.group_id, predicted_tokens(source), spec[1])
        return rank, new, spec

    def step(self, step: int) -> dict[str, Any]:
        import ray  # noqa: PLC0415

        if self._shared or self._turn_ticks:
            self._drain_ticks()
        # Refusals recorded while streaming are raised before any rank enters the barrier,
        # every rank's, the ranks that caused them first.
        refusals = [
            (peer, rank, error)
            for rank, found in enumerate(ray.get([r.refusal.remote() for r in self.ranks]))
            if found is not None
            for error, peer in [found]
        ]
        if refusals:
            said = "; ".join(f"rank {rank}: {error}" for _, rank, error in sorted(refusals))
            raise LearnerRefusal(f"step {step}: {said}")
        if self._error is not None:
            raise LearnerRefusal(f"step {step}: {self._error}")
        if self._shared:
            assert isinstance(self._planner, TickPlanner)
            if self._planner.pending:
                held = [t.trajectory_id for t in self._planner.waiting][:5]
                raise LearnerRefusal(
                    f"step {step}: not safe to step: trajectories {held} are held behind "
                    f"{len(self._planner.open_groups())} open group(s) still missing sources"
                )
            return merge_rank_metrics(_get_all([r.step.remote(step) for r in self.ranks]))
        unrouted = sorted(set(self._groups) - set(self.assigner.rank_of))
        if unrouted:
            raise LearnerRefusal(
                f"step {step}: not safe to step: {len(unrouted)} group(s) received no source: "
                f"{unrouted[:5]}"
            )
        return merge_rank_metrics(_get_all([r.step.remote(step) for r in self.ranks]))

    def weights_and_version(self) -> tuple[str, int]:
        path, version = _get_all([r.weights_and_version.remote() for r in self.ranks])[0]
        return str(path), int(version)

    # -- collective publication: rank 0 is the learner's member of the group ---------------
    def node_ip(self) -> str:
        import ray  # noqa: PLC0415

        return str(ray.get(self.ranks[0].node_ip.remote()))

    def free_port(self, address: str) -> int:
        import ray  # noqa: PLC0415

        return int(ray.get(self.ranks[0].free_port.remote(address)))

    def weight_layout(self) -> list[tuple[str, tuple[int, ...]]]:
        return list(_get_all([r.weight_layout.remote() for r in self.ranks])[0])

    def join_weight_group(self, address: GroupAddress, *, dtype: str, bucket_bytes: int) -> int:
        calls = [
            r.join_weight_group.remote(address, dtype=dtype, bucket_bytes=bucket_bytes)
            for r in self.ranks
        ]
        return int(_get_all(calls)[0])

    def send_weights(self, verify: bool = False) -> dict[str, Any]:
        return dict(_get_all([r.send_weights.remote(verify) for r in self.ranks])[0])

    def save_checkpoint(self, root: str, step: int, extra: dict[str, Any]) -> str:
        return str(_get_all([r.save_checkpoint.remote(root, step, extra) for r in self.ranks])[0])

    def state_bytes(self) -> list[dict[str, int]]:
        return _get_all([r.state_bytes.remote() for r in self.ranks])


def merge_rank_metrics(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One step record from W ranks: global numbers from rank 0 (the reduction made them
    equal), busy intervals and sources from every rank, work summed, peaks the largest
    rank's, memory per rank."""
    merged = dict(per_rank[0])
    for key in ("intervals", "releases", "services", "token_versions"):
        merged[key] = [item for record in per_rank for item in record[key]]
    merged["flops"] = sum(record["flops"] for record in per_rank)
    counters: dict[str, int] = {}
    for record in per_rank:
        for name, value in record["counters"].items():
            # A peak is the largest rank's; every other counter is work, summed.
            merge = max if name.startswith("peak_") else int.__add__
            counters[name] = merge(counters[name], value) if name in counters else value
    merged["counters"] = counters
    merged["peak_memory_bytes"] = max(record["peak_memory_bytes"] for record in per_rank)
    merged["peak_memory_per_rank_bytes"] = [record["peak_memory_bytes"] for record in per_rank]
    merged["rank_services"] = [record["services"] for record in per_rank]
    merged["learner_done_s"] = max(record["learner_done_s"] for record in per_rank)
    return merged


def _get_all(refs: list[Any]) -> list[Any]:
    """Results in order; the first rank to fail raises at once (the others may be blocked
    in a collective waiting for it)."""
    import ray  # noqa: PLC0415

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done[0])
    return ray.get(refs)


__all__ = ["COLLECTIVE_TIMEOUT_S", "LearnerGroup", "LearnerRank", "merge_rank_metrics"]
