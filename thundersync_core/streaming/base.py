"""Parts every learner shares: batch registration, source checks, the barrier, the step.

A learner trains one logical batch at a time:

    learner.begin_batch(groups)      # which groups (prompt, trajectory count) the batch holds
    learner.submit(...)              # sources, in any arrival order
    result = learner.finish()        # the barrier: scaled gradient into p.grad, once
    optimizer.step()                 # or learner.step(optimizer), which does both

Off-policy schedules (one-step-off, pipeline) construct a learner with ``max_lag`` > 0,
which admits sources sampled by up to ``max_lag`` earlier policy versions, and ``is_clip``,
which weights each scored token's term by the truncated importance ratio
w_t = min(pi_theta(y_t) / mu(y_t), is_clip) (held constant, sg) against the behaviour
log-probs the engine recorded. With ``max_lag`` = 0 and no ``is_clip`` (sync, thundersync)
every source must come from the policy being trained and the update is exact.

Gradients are accumulated unscaled in ``accum_dtype`` (float32, or float64 for float64
models). At the barrier the batch scalar c is applied once and p.grad receives the gradient
of the loss an optimizer minimises: -c * grad J for an objective that is maximised (GRPO),
c * grad L for one that is minimised (OPD). Nothing touches p.grad before the barrier.

Data-parallel learners (``thundersync_core/parallel``) set a ``reducer``: each rank holds
whole groups and accumulates their gradients unscaled; at the barrier the reducer sums the
accumulators and the scalars c depends on (group count, scored-token count, objective,
sources, importance statistics) over ranks, and c is computed from the global sums. The
result is the single-process update whatever the ranks' group counts. ``reducer=None``
(one process) leaves the barrier as it was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedModel

from thundersync_core.batch import Trajectory


class LearnerRefusal(RuntimeError):
    """The learner refused an input or a step; the message says which and why."""


class PeerRefusal(LearnerRefusal):
    """A rank refused a collective only because another rank did: that rank's refusal
    names the cause."""


@dataclass(frozen=True)
class GroupSpec:
    prompt_ids: tuple[int, ...]
    size: int
    #: The ids of the group's trajectories when the plan knows them before any lands
    #: (``size`` of them, or empty): what lets a learner fix a plan by the ids alone
    #: (``learner_chunks``), and a trajectory of the group under another id is refused.
    members: tuple[str, ...] = ()


@dataclass
class BatchResult:
    """``grad_objective`` is the gradient of the objective as stated (J or L), scaled by c."""

    objective: float
    grad_objective: dict[str, torch.Tensor]
    n_groups: int
    n_sources: int
    n_scored_tokens: int
    scale: float
    counters: dict[str, int] = field(default_factory=dict)
    #: OPD: the mean over scored tokens of log pi - q (the sampled reverse KL to the
    #: teacher, at the weights the gradient was taken at); None for GRPO.
    reverse_kl: float | None = None
    #: True when ``grad_objective`` holds this rank's ``Shard(0)`` rows of each gradient
    #: (a sharded batch gradient), not whole tensors; ``p.grad`` is then left unset.
    sharded: bool = False


class GradientShards(Protocol):
    """A batch gradient held as shards over ranks (``parallel.data_parallel.ShardedGradient``)."""

    shards: list[torch.Tensor]

    def reset(self) -> None: ...
    def add(self, grads: Sequence[torch.Tensor | None], coeff: float = 1.0) -> None: ...
    def flush(self) -> None: ...
    def nbytes(self) -> int: ...


class BarrierReducer(Protocol):
    """Sums a batch's unscaled accumulators (in place) and its scalars over learner ranks."""

    def all_reduce(self, grads: list[torch.Tensor], scalars: dict[str, float]) -> dict[str, float]:
        """Sum ``grads`` in place over ranks; return the summed ``scalars``."""
        ...

    def refusing_ranks(self, refused: bool, device: torch.device) -> list[int]:
        """Every rank says whether it refuses the barrier; all get the list of those that do."""
        ...


class _HasGroup(Protocol):
    @property
    def group_id(self) -> str: ...
    @property
    def prompt_ids(self) -> tuple[int, ...]: ...


def groups_of(
    trajectories: Sequence[_HasGroup], *, with_members: bool = False
) -> dict[str, GroupSpec]:
    """Group specs read off a complete batch (for replay and the sync reference);
    ``with_members``: each with its trajectories' ids (whole trajectories, one per id)."""
    sizes: dict[str, int] = {}
    prompts: dict[str, tuple[int, ...]] = {}
    members: dict[str, list[str]] = {}
    for traj in trajectories:
        sizes[traj.group_id] = sizes.get(traj.group_id, 0) + 1
        prompts.setdefault(traj.group_id, traj.prompt_ids)
        if with_members:
            members.setdefault(traj.group_id, []).append(traj.trajectory_id)  # type: ignore[attr-defined]
    return {g: GroupSpec(prompts[g], sizes[g], tuple(sorted(members.get(g, [])))) for g in sizes}


def _check_spec(group_id: str, spec: GroupSpec) -> None:
    if spec.size < 1 or not spec.prompt_ids:
        raise LearnerRefusal(f"group {group_id!r}: needs size >= 1 and a non-empty prompt")
    if spec.members and (len(spec.members) != spec.size or len(set(spec.members)) != spec.size):
        raise LearnerRefusal(
            f"group {group_id!r}: its planned trajectory ids must be {spec.size} distinct ids, "
            f"got {list(spec.members)[:8]}"
        )


def default_accum_dtype(model: PreTrainedModel) -> torch.dtype:
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)


class LearnerBase:
    """Batch bookkeeping, source checks and the barrier; subclasses do the gradient work."""

    #: True when the objective is maximised (p.grad = -c * grad).
    maximise = True
    #: True for OPD: the batch result carries the sampled reverse KL.
    tracks_reverse_kl = False

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        accum_dtype: torch.dtype | None = None,
        policy_version: int = 0,
        max_lag: int = 0,
        is_clip: float | None = None,
    ) -> None:
        if max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {max_lag}")
        if is_clip is not None and not is_clip > 0:
            raise ValueError(f"is_clip must be > 0, got {is_clip}")
        self.model = model
        self.accum_dtype = accum_dtype or default_accum_dtype(model)
        self.policy_version = policy_version
        self.max_lag = max_lag
        self.is_clip = is_clip
        #: Sums the batch over learner ranks at the barrier (None: one process); set by
        #: the data-parallel layer after construction.
        self.reducer: BarrierReducer | None = None
        #: The batch gradient as shards over the ranks (set with ``reducer``): contributions
        #: go to it instead of the whole accumulator, flushed in step by every rank.
        self.sharded_grad: GradientShards | None = None
        self._global_groups: int | None = None
        #: Importance-weight statistics of the current batch (off-policy learners).
        self.is_stats = {"tokens": 0, "weight_sum": 0.0, "clipped": 0}
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not self.named_params:
            raise LearnerRefusal("the model has no trainable parameters")
        self.params = [p for _, p in self.named_params]
        self.device = self.params[0].device
        self._groups: dict[str, GroupSpec] = {}
        self._done: dict[str, set[str]] = {}
        self._param_versions: list[int] = []
        self._grad_sum: list[torch.Tensor] = []
        self._objective_sum = 0.0
        self._kl_sum = 0.0
        self._n_scored_tokens = 0
        self._n_sources = 0
        self._in_batch = False

    # -- batch lifecycle -------------------------------------------------------------------
    def begin_batch(self, groups: Mapping[str, GroupSpec]) -> None:
        if self._in_batch:
            raise LearnerRefusal("begin_batch called while a batch is in progress")
        for gid, spec in groups.items():
            _check_spec(gid, spec)
        self._groups = dict(groups)
        self._done = {g: set() for g in groups}
        self._param_versions = [p._version for p in self.params]
        self._grad_sum = []  # the last batch's is freed before this one's is allocated
        if self.sharded_grad is not None:
            self.sharded_grad.reset()
        else:
            self._grad_sum = [torch.zeros_like(p, dtype=self.accum_dtype) for p in self.params]
        self._objective_sum = 0.0
        self._kl_sum = 0.0
        self._n_scored_tokens = 0
        self._n_sources = 0
        self.is_stats = {"tokens": 0, "weight_sum": 0.0, "clipped": 0}
        self._global_groups = None
        self._in_batch = True
        self._on_begin()

    def add_groups(self, groups: Mapping[str, GroupSpec]) -> None:
        """Register more groups in the batch in progress (a rank is handed groups as their
        first source arrives)."""
        if not self._in_batch:
            raise LearnerRefusal(f"groups {sorted(groups)[:5]} added outside a batch")
        for gid, spec in groups.items():
            if gid in self._groups:
                raise LearnerRefusal(f"group {gid!r} is already registered in this batch")
            _check_spec(gid, spec)
            self._groups[gid] = spec
            self._done[gid] = set()

    def finish(self) -> BatchResult:
        """The barrier: refuse unless safe, then write the scaled gradient into p.grad.

        Over ranks, every rank first says whether it refuses, so one rank's refusal stops
        them all at once instead of leaving the others in the reduction until it times out.
        """
        if self.reducer is None:
            self._check_barrier()
        else:
            self._agree_on_barrier(self.reducer)
            if self.sharded_grad is not None:
                self.sharded_grad.flush()  # the last contributions; every rank flushes here
            self._reduce_over_ranks(self.reducer)
        scale = self._scale()
        sign = -1.0 if self.maximise else 1.0
        grads = {}
        if self.sharded_grad is not None:
            for (name, _), shard in zip(self.named_params, self.sharded_grad.shards, strict=True):
                grads[name] = shard.mul_(scale)
        else:
            for (name, p), acc in zip(self.named_params, self._grad_sum, strict=True):
                acc.mul_(scale)
                grads[name] = acc
                p.grad = (sign * acc).to(p.dtype)
        self._in_batch = False
        return BatchResult(
            objective=scale * self._objective_sum,
            grad_objective=grads,
            n_groups=self._n_groups(),
            n_sources=self._n_sources,
            n_scored_tokens=self._n_scored_tokens,
            scale=scale,
            counters=self._counters(),
            reverse_kl=(
                self._kl_sum / max(self._n_scored_tokens, 1) if self.tracks_reverse_kl else None
            ),
            sharded=self.sharded_grad is not None,
        )

    def _add_opd_terms(self, loss: torch.Tensor, log_ratio: torch.Tensor) -> None:
        """Add a turn's (or rows') loss and log-ratio sum, read back in one transfer."""
        objective, kl = torch.stack([loss.detach(), log_ratio]).tolist()
        self._objective_sum += objective
        self._kl_sum += kl

    def _check_barrier(self) -> None:
        self._check_versions()
        self._check_complete()
        self._on_barrier()
        self.assert_safe_to_step()

    def _agree_on_barrier(self, reducer: BarrierReducer) -> None:
        try:
            self._check_barrier()
        except Exception:
            reducer.refusing_ranks(True, self.device)
            raise
        refusing = reducer.refusing_ranks(False, self.device)
        if refusing:
            raise LearnerRefusal(
                f"learner rank(s) {refusing} refused the barrier (their errors say why); "
                "this rank's batch is not applied"
            )

    def _reduce_over_ranks(self, reducer: BarrierReducer) -> None:
        """Sum accumulators and scalars over ranks; the batch counters become the global ones."""
        totals = reducer.all_reduce(
            self._grad_sum,
            {
                "groups": float(self._local_group_count()),
                "sources": float(self._n_sources),
                "scored_tokens": float(self._n_scored_tokens),
                "objective": self._objective_sum,
                "kl": self._kl_sum,
                "is_tokens": float(self.is_stats["tokens"]),
                "is_weight_sum": float(self.is_stats["weight_sum"]),
                "is_clipped": float(self.is_stats["clipped"]),
            },
        )
        self._global_groups = round(totals["groups"])
        self._n_sources = round(totals["sources"])
        self._n_scored_tokens = round(totals["scored_tokens"])
        self._objective_sum = totals["objective"]
        self._kl_sum = totals["kl"]
        self.is_stats = {
            "tokens": round(totals["is_tokens"]),
            "weight_sum": totals["is_weight_sum"],
            "clipped": round(totals["is_clipped"]),
        }

    def _local_group_count(self) -> int:
        """Groups this rank adds to the batch's count at the barrier (its own)."""
        return len(self._groups)

    def _n_groups(self) -> int:
        """Groups in the batch: this learner's, or every rank's once the barrier reduced them."""
        return self._global_groups if self._global_groups is not None else len(self._groups)

    def step(self, optimizer: torch.optim.Optimizer) -> BatchResult:
        """Barrier, one optimizer step, and the policy version moves to k + 1."""
        result = self.finish()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.policy_version += 1
        return result

    def assert_safe_to_step(self) -> None:
        """Refuse while any group is open, a source is pending, or parameters changed."""
        self._check_versions()
        self._check_complete()
        busy = self._pending_work()
        if busy:
            raise LearnerRefusal(f"not safe to step: {busy}")

    def discard_batch(self) -> None:
        """Drop the batch in progress without writing any gradient (a timing pass): the
        parameters, the optimizer and the policy version are as before ``begin_batch``."""
        if not self._in_batch:
            raise LearnerRefusal("discard_batch called outside a batch")
        self._grad_sum = []
        self._groups = {}
        self._done = {}
        self._in_batch = False
        for p in self.params:
            p.grad = None
        self._on_begin()

    @property
    def in_batch(self) -> bool:
        """True between begin_batch and the barrier: parameters must not be published."""
        return self._in_batch

    def gradient_so_far(self) -> list[torch.Tensor]:
        """The unscaled gradient accumulated in this batch so far (copies; this rank's flushed
        shards when the gradient is sharded)."""
        if self.sharded_grad is not None:
            return [shard.clone() for shard in self.sharded_grad.shards]
        return [acc.clone() for acc in self._grad_sum]

    def counters_so_far(self) -> dict[str, int]:
        return self._counters()

    def accumulator_bytes(self) -> int:
        """Bytes of the batch gradient accumulator (one per trainable parameter; this rank's
        shards and what waits for the next flush when the gradient is sharded)."""
        if self.sharded_grad is not None:
            return self.sharded_grad.nbytes()
        return sum(acc.numel() * acc.element_size() for acc in self._grad_sum)

    # -- checks ----------------------------------------------------------------------------
    def _check_complete(self) -> None:
        if not self._in_batch:
            raise LearnerRefusal("no batch in progress: call begin_batch first")
        missing = {
            g: f"{len(self._done[g])}/{spec.size}"
            for g, spec in self._groups.items()
            if len(self._done[g]) < spec.size
        }
        if missing:
            listed = ", ".join(f"{g} ({n})" for g, n in list(missing.items())[:5])
            raise LearnerRefusal(
                f"not safe to step: {len(missing)} group(s) still open, sources pending: {listed}"
            )

    def _check_source(
        self, group_id: str, trajectory_id: str, prompt_ids: tuple[int, ...], version: int
    ) -> None:
        tid = trajectory_id
        if not self._in_batch:
            raise LearnerRefusal(f"trajectory {tid!r} submitted outside a batch")
        self._check_version(tid, version)
        spec = self._groups.get(group_id)
        if spec is None:
            raise LearnerRefusal(f"trajectory {tid!r}: group {group_id!r} is not registered")
        if prompt_ids != spec.prompt_ids:
            raise LearnerRefusal(f"trajectory {tid!r}: prompt differs from its group's prompt")
        if spec.members and tid not in spec.members:
            raise LearnerRefusal(
                f"trajectory {tid!r} is not one of group {group_id!r}'s planned trajectories"
            )
        done = self._done[group_id]
        if tid in done:
            raise LearnerRefusal(f"trajectory {tid!r} submitted twice")
        if len(done) >= spec.size:
            raise LearnerRefusal(
                f"trajectory {tid!r}: group {group_id!r} already has {spec.size} trajectories"
            )
        self._check_versions()

    def _check_version(self, source: str, version: int) -> None:
        if self.max_lag == 0 and version != self.policy_version:
            raise LearnerRefusal(
                f"trajectory {source!r} was generated by policy version {version}; "
                f"this batch trains version {self.policy_version}"
            )
        if not self.policy_version - self.max_lag <= version <= self.policy_version:
            raise LearnerRefusal(
                f"trajectory {source!r} was generated by policy version {version}; this batch "
                f"trains version {self.policy_version} and admits a lag of at most {self.max_lag}"
            )

    def _importance_weights(
        self, source: str, logprobs_N: torch.Tensor, behaviour: Sequence[float] | None
    ) -> torch.Tensor | None:
        """Truncated importance weights min(exp(log pi - log mu), is_clip), detached; or None."""
        if self.is_clip is None:
            return None
        if behaviour is None or len(behaviour) != logprobs_N.numel():
            got = "none" if behaviour is None else len(behaviour)
            raise LearnerRefusal(
                f"{source}: off-policy correction needs one behaviour log-prob per scored token "
                f"({logprobs_N.numel()}), got {got}"
            )
        behaviour_N = torch.tensor(behaviour, dtype=logprobs_N.dtype, device=logprobs_N.device)
        # Clamp the log-ratio before exp so a large mismatch cannot overflow to inf.
        log_ratio_N = (logprobs_N.detach() - behaviour_N).clamp(max=math.log(self.is_clip))
        weights_N = log_ratio_N.exp()
        self.is_stats["tokens"] += int(weights_N.numel())
        self.is_stats["weight_sum"] += float(weights_N.sum())
        self.is_stats["clipped"] += int((log_ratio_N >= math.log(self.is_clip)).sum())
        return weights_N

    def _accept_whole(self, traj: Trajectory) -> None:
        """Check and count a whole trajectory as one source that completes it."""
        self._check_source(traj.group_id, traj.trajectory_id, traj.prompt_ids, traj.policy_version)
        self._mark_done(traj.group_id, traj.trajectory_id)
        self._n_sources += 1
        self._n_scored_tokens += traj.n_scored_tokens

    def _mark_done(self, group_id: str, trajectory_id: str) -> None:
        self._done[group_id].add(trajectory_id)

    def _group_complete(self, group_id: str) -> bool:
        return len(self._done[group_id]) == self._groups[group_id].size

    def _check_versions(self) -> None:
        for (name, p), v in zip(self.named_params, self._param_versions, strict=True):
            if p._version != v:
                raise LearnerRefusal(
                    f"parameter {name!r} was modified after the batch began (version guard): "
                    "an update before the barrier would mix two policies in one gradient"
                )

    def _add_grads(self, grads: Sequence[torch.Tensor | None], coeff: float = 1.0) -> None:
        if self.sharded_grad is not None:
            self.sharded_grad.add(grads, coeff)
            return
        for acc, g in zip(self._grad_sum, grads, strict=True):
            if g is not None:
                acc.add_(g.to(self.accum_dtype), alpha=coeff)

    # -- subclass hooks --------------------------------------------------------------------
    def _scale(self) -> float:
        raise NotImplementedError

    def _on_begin(self) -> None:
        pass

    def _on_barrier(self) -> None:
        pass

    def _pending_work(self) -> str:
        return ""

    def _counters(self) -> dict[str, int]:
        return {}
