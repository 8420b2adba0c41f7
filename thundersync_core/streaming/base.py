"""Parts every learner shares: batch registration, source checks, the barrier, the step.

A learner trains one logical batch at a time:

    learner.begin_batch(groups)      # which groups (prompt, size) the batch holds
    learner.submit(trajectory)       # once per trajectory, in any arrival order
    result = learner.finish()        # the barrier: gradient of J into p.grad, once
    optimizer.step()                 # or learner.step(optimizer), which does both

Gradients are accumulated in ``accum_dtype`` (float32, or float64 for float64 models) and
hold grad J; ``finish`` writes p.grad = -c * grad J, i.e. the gradient of the loss -J that
an optimizer minimises. Nothing touches p.grad before the barrier.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from thundersync_core.batch import Trajectory
from thundersync_core.objectives.grpo import LossAgg, batch_scale


class LearnerRefusal(RuntimeError):
    """The learner refused an input or a step; the message says which and why."""


@dataclass(frozen=True)
class GroupSpec:
    prompt_ids: tuple[int, ...]
    size: int


@dataclass
class BatchResult:
    objective: float
    grad_objective: dict[str, torch.Tensor]
    n_groups: int
    n_sources: int
    n_scored_tokens: int
    scale: float
    counters: dict[str, int] = field(default_factory=dict)


def groups_of(trajectories: Sequence[Trajectory]) -> dict[str, GroupSpec]:
    """Group specs read off a complete batch (for replay and the sync reference)."""
    sizes: dict[str, int] = {}
    prompts: dict[str, tuple[int, ...]] = {}
    for traj in trajectories:
        sizes[traj.group_id] = sizes.get(traj.group_id, 0) + 1
        prompts.setdefault(traj.group_id, traj.prompt_ids)
    return {g: GroupSpec(prompts[g], sizes[g]) for g in sizes}


def default_accum_dtype(model: PreTrainedModel) -> torch.dtype:
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)


class LearnerBase:
    """Batch bookkeeping, input checks and the barrier; subclasses do the gradient work."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        loss_agg: LossAgg = "seq-sum",
        accum_dtype: torch.dtype | None = None,
        policy_version: int = 0,
    ) -> None:
        batch_scale(loss_agg, 1, 1)  # validates the name early
        self.model = model
        self.loss_agg: LossAgg = loss_agg
        self.accum_dtype = accum_dtype or default_accum_dtype(model)
        self.policy_version = policy_version
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not self.named_params:
            raise LearnerRefusal("the model has no trainable parameters")
        self.params = [p for _, p in self.named_params]
        self.device = self.params[0].device
        self._groups: dict[str, GroupSpec] = {}
        self._seen: dict[str, set[str]] = {}
        self._param_versions: list[int] = []
        self._grad_sum: list[torch.Tensor] = []
        self._objective_sum = 0.0
        self._n_scored_tokens = 0
        self._n_sources = 0
        self._in_batch = False

    # -- batch lifecycle -------------------------------------------------------------------
    def begin_batch(self, groups: Mapping[str, GroupSpec]) -> None:
        if self._in_batch:
            raise LearnerRefusal("begin_batch called while a batch is in progress")
        for gid, spec in groups.items():
            if spec.size < 1 or not spec.prompt_ids:
                raise LearnerRefusal(f"group {gid!r}: needs size >= 1 and a non-empty prompt")
        self._groups = dict(groups)
        self._seen = {g: set() for g in groups}
        self._param_versions = [p._version for p in self.params]
        self._grad_sum = [torch.zeros_like(p, dtype=self.accum_dtype) for p in self.params]
        self._objective_sum = 0.0
        self._n_scored_tokens = 0
        self._n_sources = 0
        self._in_batch = True
        self._on_begin()

    def submit(self, traj: Trajectory) -> None:
        self._check_source(traj)
        self._seen[traj.group_id].add(traj.trajectory_id)
        self._n_sources += 1
        self._n_scored_tokens += traj.n_scored_tokens
        self._on_submit(traj)

    def finish(self) -> BatchResult:
        """The barrier: refuse unless safe, then write the scaled gradient into p.grad."""
        self._check_versions()
        self._check_complete()
        self._on_barrier()
        self.assert_safe_to_step()
        scale = batch_scale(self.loss_agg, len(self._groups), self._n_scored_tokens)
        grads = {}
        for (name, p), acc in zip(self.named_params, self._grad_sum, strict=True):
            acc.mul_(scale)
            grads[name] = acc
            p.grad = (-acc).to(p.dtype)
        self._in_batch = False
        return BatchResult(
            objective=scale * self._objective_sum,
            grad_objective=grads,
            n_groups=len(self._groups),
            n_sources=self._n_sources,
            n_scored_tokens=self._n_scored_tokens,
            scale=scale,
            counters=self._counters(),
        )

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

    def _check_complete(self) -> None:
        if not self._in_batch:
            raise LearnerRefusal("no batch in progress: call begin_batch first")
        missing = {
            g: f"{len(self._seen[g])}/{spec.size}"
            for g, spec in self._groups.items()
            if len(self._seen[g]) < spec.size
        }
        if missing:
            listed = ", ".join(f"{g} ({n})" for g, n in list(missing.items())[:5])
            raise LearnerRefusal(
                f"not safe to step: {len(missing)} group(s) still open, sources pending: {listed}"
            )

    # -- checks ----------------------------------------------------------------------------
    def _check_source(self, traj: Trajectory) -> None:
        tid = traj.trajectory_id
        if not self._in_batch:
            raise LearnerRefusal(f"trajectory {tid!r} submitted outside a batch")
        if not math.isfinite(traj.reward):
            raise LearnerRefusal(f"trajectory {tid!r}: reward {traj.reward} is not finite")
        if traj.policy_version != self.policy_version:
            raise LearnerRefusal(
                f"trajectory {tid!r} was generated by policy version {traj.policy_version}; "
                f"this batch trains version {self.policy_version}"
            )
        spec = self._groups.get(traj.group_id)
        if spec is None:
            raise LearnerRefusal(f"trajectory {tid!r}: group {traj.group_id!r} is not registered")
        if traj.prompt_ids != spec.prompt_ids:
            raise LearnerRefusal(f"trajectory {tid!r}: prompt differs from its group's prompt")
        seen = self._seen[traj.group_id]
        if tid in seen:
            raise LearnerRefusal(f"trajectory {tid!r} submitted twice")
        if len(seen) >= spec.size:
            raise LearnerRefusal(
                f"trajectory {tid!r}: group {traj.group_id!r} already has {spec.size} trajectories"
            )
        self._check_versions()

    def _check_versions(self) -> None:
        for (name, p), v in zip(self.named_params, self._param_versions, strict=True):
            if p._version != v:
                raise LearnerRefusal(
                    f"parameter {name!r} was modified after the batch began (version guard): "
                    "an update before the barrier would mix two policies in one gradient"
                )

    def _add_grads(self, grads: Sequence[torch.Tensor | None], coeff: float = 1.0) -> None:
        for acc, g in zip(self._grad_sum, grads, strict=True):
            if g is not None:
                acc.add_(g.to(self.accum_dtype), alpha=coeff)

    # -- subclass hooks --------------------------------------------------------------------
    def _on_begin(self) -> None:
        pass

    def _on_submit(self, traj: Trajectory) -> None:
        raise NotImplementedError

    def _on_barrier(self) -> None:
        pass

    def _pending_work(self) -> str:
        return ""

    def _counters(self) -> dict[str, int]:
        return {}
