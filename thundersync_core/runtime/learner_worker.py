"""The learner role: one policy, one optimizer, the schedule's learner, one step per batch.

Calls run in submission order (the actor's mailbox is the work-conserving queue). Each call
records its busy interval; ``step`` runs the barrier, refuses a non-finite loss or gradient
(naming the step and, where the learner can, the source), clips, steps the optimizer once,
and writes the new weights for publication. Nothing is written before the step succeeds,
so a refused step leaves every checkpoint as it was.
"""

from __future__ import annotations

import math
import os
import resource
import shutil
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from thundersync_core.batch import Trajectory, Turn
from thundersync_core.checkpoint import load_checkpoint, save_checkpoint
from thundersync_core.config import TrainConfig
from thundersync_core.metrics import FlopLedger, measure_peak_flops, turn_token_versions
from thundersync_core.objectives.grpo import is_uniform
from thundersync_core.policy.io import load_model, load_tokenizer
from thundersync_core.policy.logprobs import SamplingFilter, set_policy_sampling
from thundersync_core.runtime.placement import pin_to_cores, set_nice
from thundersync_core.streaming import (
    StreamingGRPOLearner,
    StreamingOPDLearner,
    SyncGRPOLearner,
    SyncOPDLearner,
)
from thundersync_core.streaming.base import GroupSpec, LearnerBase, LearnerRefusal, PeerRefusal

if TYPE_CHECKING:
    from thundersync_core.rollout.weight_sync import GroupAddress


def build_learner(config: TrainConfig, model: torch.nn.Module, version: int) -> LearnerBase:
    """The learner each (objective, schedule) pair trains with.

    Sync and thundersync use the same per-source executor by default, so a comparison of
    the two measures the schedule alone (sync hands it every source after the last
    reward); ``sync_learner: batched`` gives sync the padded whole-batch learner instead.
    The learner's policy is the tempered softmax (``rollout.temperature``): its support is
    the whole vocabulary, so a token an older policy sampled never has probability 0. The
    sampler's top-k and top-p live in the behaviour log-probs only, where the off-policy
    schedules' importance weights correct toward the tempered policy.
    """
    set_policy_sampling(model, SamplingFilter(config.rollout.temperature))
    off_policy = config.schedule in ("async", "pipeline")
    lag = 0 if not off_policy else (1 if config.schedule == "async" else config.max_staleness)
    is_clip = config.is_clip if off_policy else None
    batched = config.schedule == "sync" and config.sync_learner == "batched"
    if config.objective == "grpo":
        if batched:
            return SyncGRPOLearner(model, loss_agg=config.loss_agg, policy_version=version)  # type: ignore[arg-type]
        cap = config.max_open_groups if config.schedule == "thundersync" else config.groups_per_step
        common: dict[str, Any] = {
            "loss_agg": config.loss_agg,
            "max_open_groups": cap,
            "policy_version": version,
            "max_lag": lag,
            "is_clip": is_clip,
        }
        if config.learner_shared_groups:  # ranks that share the open groups
            from thundersync_core.parallel.shared_groups import (  # noqa: PLC0415
                SharedGroupsGRPOLearner,
            )

            return SharedGroupsGRPOLearner(model, **common)  # type: ignore[arg-type]
        return StreamingGRPOLearner(
            model,  # type: ignore[arg-type]
            order=config.learner_order,
            release=config.grpo_release,
            chunks=config.learner_chunks,
            **common,
        )
    top_k = config.opd_teacher_top_k
    if batched:
        return SyncOPDLearner(model, policy_version=version, teacher_top_k=top_k)  # type: ignore[arg-type]
    return StreamingOPDLearner(
        model,  # type: ignore[arg-type]
        policy_version=version,
        max_lag=lag,
        is_clip=is_clip,
        teacher_top_k=top_k,
    )


def learner_device(config: TrainConfig, role: str = "learner") -> str:
    """``cuda`` when the learner holds GPUs (Ray shows the actor its own), else ``cpu``;
    refused when it holds GPUs it cannot see."""
    if config.resources.learner.num_gpus <= 0:
        return "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{role}: resources.learner.num_gpus is {config.resources.learner.num_gpus} but "
            "no CUDA device is visible to it "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r})"
        )
    return "cuda"


class LearnerWorker:
    def __init__(
        self,
        model_dir: Path,
        config: TrainConfig,
        *,
        publish_dir: Path,
        resume_from: Path | None = None,
    ) -> None:
        from thundersync_core.parallel.fsdp import build_train_state  # noqa: PLC0415

        pin_to_cores(config.resources.learner.cores)
        set_nice(config.resources.learner.nice, "resources.learner.nice")
        torch.manual_seed(config.seed)
        self.config = config
        self.device = learner_device(config)
        # The float32 master on the learner's device; a bfloat16 learner computes on a
        # replica cast from it (``MixedPrecisionState``), the optimizer steps the master.
        master = load_model(model_dir).to(self.device)  # type: ignore[arg-type]
        if config.policy.lora is not None:
            from thundersync_core.policy.lora import LoraSettings, apply_lora  # noqa: PLC0415

            lora = config.policy.lora
            apply_lora(
                master,
                LoraSettings(lora.r, lora.alpha, lora.dropout, lora.target_modules),
                seed=config.seed,
            )
        self.state = build_train_state(
            master,
            sharding="replicated",
            lr=config.lr,
            device_type=self.device,
            compute_dtype=getattr(torch, config.learner_dtype),
        )
        self.model = self.state.model
        self.optimizer = self.state.optimizer
        self.tokenizer = load_tokenizer(model_dir)
        version = 0
        if resume_from is not None:
            state = _load_any_checkpoint(
                Path(resume_from), self.state.checkpoint_module(), self.optimizer
            )
            self.state.refresh_replica()
            version = int(state["policy_version"])
        self.learner = build_learner(config, self.model, version)
        self.publish_dir = Path(publish_dir)
        self._start_accounting()

    def _start_accounting(self) -> None:
        """Publication folder, FLOP ledger, peak FLOP/s and an empty step record."""
        self.publish_dir.mkdir(parents=True, exist_ok=True)
        #: Adapter publication: the size of the last adapter written (rank 0).
        self.adapter_bytes: int | None = None
        self.ledger = FlopLedger(sum(p.numel() for p in self.model.parameters()))
        self.peak_flops = self.config.resources.learner_peak_flops or measure_peak_flops(
            device=self.device, dtype=self.config.learner_dtype
        )
        self._reset_step()

    def _reset_step(self) -> None:
        self.intervals: list[tuple[float, float]] = []
        self.releases: list[float] = []
        self.services: list[dict[str, Any]] = []
        self.token_versions: list[tuple[int, int]] = []
        self._groups_seen: set[str] = set()
        self._error: str | None = None
        self._error_is_peer = False  # refused only because another rank did
        self.ledger.reset()

    def pid(self) -> int:
        """This role's process id (roles.json in the run folder lists them)."""
        return os.getpid()

    def version(self) -> int:
        return self.learner.policy_version

    def node_ip(self) -> str:
        import ray  # noqa: PLC0415

        return str(ray.util.get_node_ip_address())

    def node_ids(self) -> list[str]:
        """The Ray node of each of the role's processes (one here; a rank each in a group)."""
        from thundersync_core.runtime.placement import node_id  # noqa: PLC0415

        return [node_id()]

    def free_port(self, address: str) -> int:
        with socket.socket() as sock:
            sock.bind((address, 0))
            return int(sock.getsockname()[1])

    # -- collective publication ------------------------------------------------------------
    def weight_layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """Names and shapes of the published weights, in publication order."""
        from thundersync_core.rollout.weight_sync import layout_of  # noqa: PLC0415

        return layout_of(self.state.named_weights())

    def join_weight_group(self, address: GroupAddress, *, dtype: str, bucket_bytes: int) -> int:
        """Rank 0 of the publication group; ``dtype`` is the engines'."""
        from thundersync_core.rollout.weight_sync import WeightGroup  # noqa: PLC0415

        self.publication = {
            "group": WeightGroup(address, rank=0),
            "layout": self.weight_layout(),
            "dtype": getattr(torch, dtype),
            "bucket_bytes": bucket_bytes,
        }
        return 0

    def send_weights(self, verify: bool = False) -> dict[str, Any]:
        """Broadcast the current weights to the engines; refused mid-batch, as a file
        publication is. Returns the bytes sent, the seconds, and (``verify``) a checksum."""
        from thundersync_core.rollout.weight_sync import checksum, send_weights  # noqa: PLC0415

        if self.learner.in_batch:
            raise LearnerRefusal(
                f"refusing to publish weights version {self.learner.policy_version}: a batch "
                "is in progress (between begin and its step)"
            )
        pub = self.publication
        t0 = time.time()
        sent = send_weights(
            pub["group"],
            self.state.named_weights(),
            pub["layout"],
            dtype=pub["dtype"],
            bucket_bytes=pub["bucket_bytes"],
            device=self.device,
        )
        report: dict[str, Any] = {"bytes": sent, "seconds": time.time() - t0}
        if verify:
            report["checksum"] = checksum(
                (n, t.to(pub["dtype"])) for n, t in self.state.named_weights()
            )
        return report

    # -- the batch -------------------------------------------------------------------------
    def begin(self, groups: dict[str, tuple[Any, ...]]) -> int:
        """Groups as (prompt ids, size[, planned trajectory ids])."""
        self._reset_step()
        self.learner.begin_batch({g: GroupSpec(*spec) for g, spec in groups.items()})
        return self.learner.policy_version

    def submit(self, traj: Trajectory, release_s: float | None = None) -> None:
        """A whole trajectory (GRPO; OPD with teacher scores under sync and one-step-off)."""
        t0 = time.time()
        self._guarded(self.learner.submit, traj)  # type: ignore[attr-defined]
        self._record(t0, traj.trajectory_id, release_s, traj.group_id)
        self._count_whole(traj)

    def _count_whole(self, traj: Trajectory) -> None:
        """FLOP ledger and token versions of a whole trajectory (its prompt once per group
        in the per-source learners, every row in the padded batch learners)."""
        prompt = len(traj.prompt_ids) if traj.group_id not in self._groups_seen else 0
        self._groups_seen.add(traj.group_id)
        batched = isinstance(self.learner, SyncGRPOLearner | SyncOPDLearner)
        tokens = len(traj.response_ids) + (len(traj.prompt_ids) if batched else prompt)
        self.ledger.add(forward=tokens, backward=tokens)
        self._count_versions(traj)

    def submit_many(self, sources: list[tuple[Trajectory, float | None]]) -> None:
        """Trajectories that landed while the learner was busy, with their release times:
        run as packs (``learner_pack_tokens``) by the per-source GRPO learner."""
        if not sources:
            return
        t0 = time.time()
        trajs = [traj for traj, _ in sources]
        pack_tokens = self.config.learner_pack_tokens
        self._guarded(
            lambda batch: self.learner.submit_many(batch, pack_tokens=pack_tokens),  # type: ignore[attr-defined]
            trajs,
        )
        t1 = time.time()
        self.intervals.append((t0, t1))
        share = (t1 - t0) / len(sources)  # a pack's time, shared evenly among its members
        for traj, release_s in sources:
            if release_s is not None:
                self.releases.append(release_s)
                self.services.append(
                    {
                        "id": traj.trajectory_id,
                        "group": traj.group_id,
                        "release_s": release_s,
                        "service_s": share,
                    }
                )
            self._count_whole(traj)

    def submit_turn(self, scored: tuple[Turn, float | None]) -> None:
        """One teacher-scored OPD turn (thundersync and pipeline)."""
        turn, release_s = scored
        t0 = time.time()
        self._guarded(self.learner.submit_turn, turn)  # type: ignore[attr-defined]
        self._record(t0, f"{turn.trajectory_id}#{turn.index}", release_s, turn.group_id)
        action = turn.action
        tokens = len(action.ids) if action is not None else 0
        prompt = len(turn.prompt_ids) if turn.group_id not in self._groups_seen else 0
        self._groups_seen.add(turn.group_id)
        # The turn's chunk forward and backward, and (at close) its replay.
        self.ledger.add(forward=2 * tokens + prompt, backward=2 * tokens + prompt)
        if action is not None:
            self.token_versions.append((turn.policy_version, sum(action.scored)))

    def submit_scored(self, scored: tuple[Trajectory, float]) -> None:
        """A whole trajectory with its teacher scores and the time they landed (OPD)."""
        self.submit(*scored)

    def _guarded(self, method: Any, source: Any) -> None:
        """Sources are sent without waiting for a reply: keep the first refusal for ``step``."""
        if self._error is not None:
            return
        try:
            method(source)
        except (LearnerRefusal, ValueError) as exc:
            self._error = str(exc)
            self._error_is_peer = isinstance(exc, PeerRefusal)
            raise

    def _record(self, t0: float, source: str, release_s: float | None, group: str) -> None:
        t1 = time.time()
        self.intervals.append((t0, t1))
        if release_s is not None:
            self.releases.append(release_s)
            self.services.append(
                {"id": source, "group": group, "release_s": release_s, "service_s": t1 - t0}
            )

    def _count_versions(self, traj: Trajectory) -> None:
        self.token_versions.extend(turn_token_versions(traj))

    def time_sources(
        self,
        groups: dict[str, tuple[Any, ...]],
        trajectories: list[Trajectory],
        stop_file: str | None = None,
    ) -> list[tuple[str, float, float]]:
        """Learner time of each trajectory, nothing kept: (id, start, end) per source, run
        in scratch batches that are dropped (weights, optimizer, version untouched).

        The sources run as the schedules' learner runs them: with packs
        (``learner_pack_tokens``) a group at a time through ``submit_many``, its time shared
        evenly among its trajectories (consecutive intervals; a group with equal rewards is
        left out, as the learner skips it), else one at a time. Without
        ``stop_file`` one pass; with it, passes repeat until that file exists (the bench's
        contention measurement keeps the learner working beside a rollout)."""
        if self.learner.in_batch:
            raise LearnerRefusal("time_sources called while a batch is in progress")
        if not trajectories:
            return []
        specs = {g: GroupSpec(*spec) for g, spec in groups.items()}
        pack_tokens = self.config.learner_pack_tokens if self.config.packs else 0
        units: list[list[Trajectory]] = [[traj] for traj in trajectories]
        if pack_tokens:
            members: dict[str, list[Trajectory]] = {}
            for traj in trajectories:
                members.setdefault(traj.group_id, []).append(traj)
            # A group whose rewards are all equal costs the packed learner nothing (no
            # advantage, no forward): it is not timed, and a pass of only such groups is empty.
            units = [m for m in members.values() if not is_uniform([t.reward for t in m])]
        if not units:
            return []
        times: list[tuple[str, float, float]] = []
        while True:
            self.learner.begin_batch(specs)
            try:
                for unit in units:
                    if stop_file is not None and os.path.exists(stop_file):
                        return times
                    t0 = time.time()
                    if pack_tokens:
                        self.learner.submit_many(unit, pack_tokens=pack_tokens)  # type: ignore[attr-defined]
                    else:
                        self.learner.submit(unit[0])  # type: ignore[attr-defined]
                    share = (time.time() - t0) / len(unit)
                    times += [
                        (traj.trajectory_id, t0 + k * share, t0 + (k + 1) * share)
                        for k, traj in enumerate(unit)
                    ]
            finally:
                self.learner.discard_batch()
            if stop_file is None:
                return times

    # -- the barrier and the step ----------------------------------------------------------
    def step(self, step: int) -> dict[str, Any]:
        t0 = time.time()
        version = self.learner.policy_version
        if self._error is not None:
            raise LearnerRefusal(f"step {step}: {self._error}")
        try:
            result = self.learner.finish()
        except LearnerRefusal as exc:
            raise LearnerRefusal(f"step {step}: {exc}") from None
        if not math.isfinite(result.objective):
            raise LearnerRefusal(f"step {step}: the batch loss is {result.objective} (not finite)")
        sign = -1.0 if self.learner.maximise else 1.0
        if result.sharded:  # the ranks' sharded batch gradient: FSDP2's master shards
            grad_norm = self.state.clip_shards(  # type: ignore[attr-defined]
                self.config.max_grad_norm, result.grad_objective, sign
            )
        else:
            grad_norm = self.state.clip(self.config.max_grad_norm, result.grad_objective, sign)
        if not math.isfinite(grad_norm):
            raise LearnerRefusal(f"step {step}: the gradient norm is {grad_norm} (not finite)")
        self.state.apply()
        self.learner.policy_version += 1
        learner_done_s = time.time()
        self.intervals.append((t0, learner_done_s))
        # Collective publication sends the weights when the schedule publishes: no file.
        path = self._write_weights() if self.config.rollout.publication == "file" else ""
        return {
            "step": step,
            "trained_version": version,
            "policy_version": self.learner.policy_version,
            "loss": result.objective if not self.learner.maximise else -result.objective,
            "objective": result.objective,
            "reverse_kl": result.reverse_kl,
            "grad_norm": grad_norm,
            "n_sources": result.n_sources,
            "n_scored_tokens": result.n_scored_tokens,
            "counters": result.counters,
            "is_stats": dict(self.learner.is_stats),
            "intervals": self.intervals,
            "releases": self.releases,
            "services": self.services,
            "barrier_s": learner_done_s - t0,
            "learner_done_s": learner_done_s,
            "flops": self.ledger.flops,
            "peak_flops": self.peak_flops,
            "token_versions": self.token_versions,
            **self._peak_memory(),
            "weights": str(path),
            **self._publication_record(),
        }

    def _peak_memory(self) -> dict[str, int]:
        """Peak resident memory of the process, and of the GPU where the learner runs on one."""
        peak = {"peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if self.device == "cuda":
            peak["peak_cuda_bytes"] = int(torch.cuda.max_memory_allocated())
        return peak

    def _save_weights(self, path: Path) -> None:
        # Every rank calls (a sharded master is gathered one tensor at a time).
        self.state.write_weights(path)

    def _write_weights(self) -> Path:
        version = self.learner.policy_version
        if self.config.rollout.lora_publication == "adapter":
            return self._write_adapter(version)
        path = self.publish_dir / f"policy-v{version:06d}.safetensors"
        self._save_weights(path)
        # Keep two versions: an in-flight update may still be reading the previous one.
        for old in sorted(self.publish_dir.glob("policy-v*.safetensors"))[:-2]:
            old.unlink(missing_ok=True)
        return path

    def _write_adapter(self, version: int) -> Path:
        """The policy's LoRA adapter in peft's format, a folder per version, written by rank
        0 (the adapters are whole on every rank: no collective); the last two are kept, as
        weight files are. Its size is the step record's ``publication_bytes``."""
        from thundersync_core.policy.lora import adapter_settings, save_adapter  # noqa: PLC0415

        folder = self.publish_dir / f"adapter-v{version:06d}"
        if not dist.is_initialized() or dist.get_rank() == 0:
            model = self._adapter_model()
            settings = adapter_settings(model)
            assert settings is not None  # _adapter_model returns a model with adapters
            save_adapter(model, settings, folder)
            self.adapter_bytes = sum(f.stat().st_size for f in folder.iterdir())
        for old in sorted(self.publish_dir.glob("adapter-v*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        return folder

    def _adapter_model(self) -> torch.nn.Module:
        """The model carrying the policy's float32 adapters: the master where it is one whole
        model, else the compute replica (which a sharded master refreshes in float32)."""
        from thundersync_core.policy.lora import adapter_settings  # noqa: PLC0415

        for model in (self.state.checkpoint_module(), self.model):
            adapters = [p for n, p in model.named_parameters() if ".lora_" in n]
            if adapter_settings(model) is not None and adapters:
                if any(p.dtype != torch.float32 for p in adapters):
                    raise ValueError(
                        "rollout.lora_publication: adapter: the learner's adapters are not "
                        "float32 where they are whole (use lora_publication: merged)"
                    )
                return model
        raise ValueError(
            "rollout.lora_publication: adapter: the learner's policy carries no LoRA "
            "adapters (policy.lora)"
        )

    def _publication_record(self) -> dict[str, int]:
        """Adapter publication: the bytes of the adapter just written (rank 0)."""
        written = self.adapter_bytes
        return {"publication_bytes": written} if written is not None else {}

    def weights_and_version(self) -> tuple[str, int]:
        """The current weights written for publication, and their version; refused between
        ``begin`` and the step, where a batch's gradients are still being summed."""
        if self.learner.in_batch:
            raise LearnerRefusal(
                f"refusing to publish weights version {self.learner.policy_version}: a batch "
                "is in progress (between begin and its step)"
            )
        return str(self._write_weights()), self.learner.policy_version

    # -- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, root: str, step: int, extra: dict[str, Any]) -> str:
        path = save_checkpoint(
            Path(root),
            step=step,
            model=self.state.checkpoint_module(),  # type: ignore[arg-type]
            optimizer=self.optimizer,
            policy_version=self.learner.policy_version,
            extra=extra,
            export_dtype=getattr(torch, self.config.checkpoint_export_dtype),
        )
        self.tokenizer.save_pretrained(path / "model")  # type: ignore[attr-defined]
        return str(path)


def _load_any_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """A one-process checkpoint, or a learner group's (DCP, written at any rank count)."""
    from thundersync_core.parallel.dcp import (  # noqa: PLC0415 - torch.distributed on demand
        is_group_checkpoint,
        load_group_checkpoint,
    )

    if is_group_checkpoint(path):
        return load_group_checkpoint(path, module=model, optimizer=optimizer)
    return load_checkpoint(path, model=model, optimizer=optimizer)  # type: ignore[arg-type]
