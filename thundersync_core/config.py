"""The training-stage configuration: one YAML file = one experiment.

Pydantic models only; this module imports neither torch nor Ray nor vLLM, so orchestration
and CPU CI can load and validate a config cheaply. Layering: model defaults < the YAML file
< command-line overrides (``thundersync train --schedule ... --steps ...``); the resolved
config is written next to the run's metrics.

Roles and resources: each role (rollout, learner, teacher) is a Ray actor with explicit
resources. ``cores`` pins a role to fixed CPU cores (the embedded default: rollout on core
0, learner on core 1); on a cluster ``num_gpus`` places roles on GPUs and ``cores`` is left
empty. Device-hours count every device allocated to the run for its whole wall time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Schedule = Literal["sync", "thundersync", "async", "pipeline"]
Objective = Literal["grpo", "opd"]
SCHEDULES: tuple[Schedule, ...] = ("sync", "thundersync", "async", "pipeline")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: How a role's bundles (one per rank or engine) are laid over the nodes: Ray's placement
#: group strategies. ``pack`` fills a node before the next; ``strict_pack`` one node or
#: nothing; ``spread`` / ``strict_spread`` one bundle a node where possible / always.
Placement = Literal["pack", "strict_pack", "spread", "strict_spread"]


class RoleResources(_Strict):
    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=0.0, ge=0)
    #: CPU cores the role is pinned to (empty: not pinned).
    cores: tuple[int, ...] = ()
    #: The role's placement group strategy (a role holding no CPUs or GPUs has none).
    placement: Placement = "pack"


class LearnerResources(RoleResources):
    """The learner's resources in total; ``ranks`` > 1 splits them over a process group."""

    #: Learner ranks (Ray actors in one torch.distributed group: gloo on CPU, NCCL on GPU).
    #: ``num_cpus``, ``num_gpus`` and ``cores`` are divided evenly among them.
    ranks: int = Field(default=1, ge=1)
    #: Memory of one learner GPU in GB: when set (GRPO), a layout the learner memory model
    #: (``perfmodel/memory.py``) says does not fit is refused at start, naming every term.
    gpu_memory_gb: float = Field(default=0.0, ge=0)
    #: The learner's scheduling niceness (-20 to 19; None: left as Ray starts workers, 15
    #: on Linux), set on every thread of its process. On a core it shares with other
    #: processes (graders placed there by ``rollout.grader_cores``), the lower value gets
    #: the CPU first: at 15 apart the kernel weighs it ~28 to 1. Lowering it needs
    #: CAP_SYS_NICE (root); where refused, the learner says so and runs as started.
    nice: int | None = Field(default=None, ge=-20, le=19)


class RolloutResources(RoleResources):
    """The rollout role's resources in total; ``engines`` > 1 starts that many inference
    engines as their own Ray actors, each with an equal share of the GPUs and CPUs (and of
    ``cores``), and spreads the agent's requests over them (``rollout/engine_pool.py``)."""

    engines: int = Field(default=1, ge=1)
    #: GPUs one vLLM engine spans (tensor parallelism); vLLM only.
    tensor_parallel_size: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _gpus_cover_engines(self) -> RolloutResources:
        if self.num_gpus and self.num_gpus < self.engines * self.tensor_parallel_size:
            raise ValueError(
                f"resources.rollout: {self.engines} engine(s) x tensor_parallel_size "
                f"{self.tensor_parallel_size} need {self.engines * self.tensor_parallel_size} "
                f"GPUs; num_gpus is {self.num_gpus:g}"
            )
        return self


class ResourcesConfig(_Strict):
    rollout: RolloutResources = RolloutResources(cores=(0,))
    learner: LearnerResources = LearnerResources(cores=(1,))
    #: The OPD teacher is light next to generation; it shares the rollout core by default.
    teacher: RoleResources = RoleResources(num_cpus=0.0, cores=(0,))
    #: Devices counted for device-hours (0: the union of pinned cores, else num_cpus sums).
    devices: int = Field(default=0, ge=0)
    #: Learner peak FLOP/s for MFU (0: measured once at start with a float32 GEMM).
    learner_peak_flops: float = Field(default=0.0, ge=0)
    #: A role's placement group not placed within this many seconds is refused, naming
    #: the role and what the cluster has free (instead of a run pending for ever).
    placement_timeout_s: float = Field(default=120.0, gt=0)


class LoraConfig(_Strict):
    """LoRA adapters on the policy's linear layers (peft): W + (alpha / r) B A, only A and
    B train. B starts at zero (the policy starts as the base model), A seeded by ``seed``."""

    r: int = Field(ge=1)
    alpha: float = Field(gt=0)
    #: Must be 0: each forward would draw its own dropout mask, and the streamed update
    #: would no longer equal the sync one.
    dropout: float = Field(default=0.0, ge=0, le=0)
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )


class PolicyConfig(_Strict):
    #: A Hugging Face policy folder to start from; empty: a preset, warm-started.
    path: Path | None = None
    preset: str = "tiny"
    #: A teacher folder for OPD; empty: warm-started from the preset (more steps).
    teacher_path: Path | None = None
    #: Train LoRA adapters instead of every weight (empty: full fine-tuning). Engines and
    #: evaluation load the merged weights (engines may take the adapter instead:
    #: ``rollout.lora_publication``); checkpoints keep the adapter (``adapter/``).
    lora: LoraConfig | None = None


class WarmStartConfig(_Strict):
    enabled: bool = True
    steps: int = Field(default=300, ge=1)
    lr: float = Field(default=1e-3, gt=0)
    teacher_steps: int = Field(default=600, ge=1)
    #: The supervised steps' matrix products: ``bfloat16`` autocasts them (float32 weights,
    #: optimizer state and log-softmax), about 2x faster where the CPU or GPU has bf16.
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    #: The OPD teacher's start: ``preset``, a fresh model warm-started ``teacher_steps``;
    #: ``policy``, the policy's warm start continued for ``teacher_steps`` more steps.
    teacher_init: Literal["preset", "policy"] = "preset"
    #: Warm-start at this (smaller) preset, then grow the result into ``policy.preset``
    #: with the same function (``policy/grow.py``): new widths, heads and layers start
    #: writing nothing and train from there. Empty: warm-start at ``policy.preset``.
    preset: str | None = None
    #: A folder keeping warm starts by what makes them (starting weights, steps, lr, seed,
    #: families, the tasks' files, the warm-start code), so every run with the same ones
    #: reuses the first; empty: each run folder warm-starts its own.
    cache_dir: Path | None = None


class FrontierConfig(_Strict):
    """Train only on tasks the starting policy solves some of the time: those whose
    reference first action it samples with probability p in [min_p, max_p]
    (``warmstart/frontier.py``)."""

    min_p: float = Field(ge=0, le=1)
    max_p: float = Field(ge=0, le=1)

    @model_validator(mode="after")
    def _ordered(self) -> FrontierConfig:
        if self.min_p >= self.max_p:
            raise ValueError(f"min_p ({self.min_p}) must be below max_p ({self.max_p})")
        return self


class TasksConfig(_Strict):
    #: The output folder of ``thundersync prep`` (terminal/{train,dev}.parquet).
    prep_dir: Path = Path("runs/prep")
    #: Task families to train on (empty: all); toyterm ids are ``toyterm-<family>-NNNN``.
    families: tuple[str, ...] = ()
    #: Dev tasks evaluated before and after training (0: skip), and samples per task.
    dev_tasks: int = Field(default=16, ge=0)
    dev_samples: int = Field(default=2, ge=1)
    #: Task sources the policy or teacher already trained on, as ``warm-start --tasks`` takes
    #: them (e.g. another prep run's pools): a dev task repeating one of their instructions is
    #: left out of the dev measure.
    dev_exclude: tuple[Path, ...] = ()
    #: The ``summary.json`` of a run from the same starting weights, seed and rollout
    #: settings: its ``dev_before`` is this run's too, so it is not measured again (the
    #: schedules of one experiment share their warm start). Checked by ``dev_before.key``.
    dev_before_from: Path | None = None
    #: Also warm-start on the prep run's warm-start-only tasks (``terminal/warmstart.parquet``,
    #: written when the prep config has ``warm_start_pool``), when there are any.
    warm_start_pool: bool = True
    #: Keep only the train tasks the starting policy solves some of the time (a GRPO group
    #: whose rewards are all equal teaches nothing): see ``FrontierConfig``. None: all.
    frontier: FrontierConfig | None = None


class RolloutConfig(_Strict):
    engine: Literal["auto", "vllm", "hf"] = "auto"
    backend: Literal["local", "docker"] = "local"
    #: The Docker backend's image; made locally by ``thundersync sandbox build-image``.
    docker_image: str = "thundersync-sandbox:latest"
    max_turns: int = Field(default=3, ge=1)
    max_tokens_per_turn: int = Field(default=96, ge=1)
    max_total_tokens: int = Field(default=192, ge=1)
    max_model_len: int = Field(default=2048, ge=64)
    observation_tokens: int = Field(default=128, ge=16)
    command_timeout_s: float = Field(default=10.0, gt=0)
    temperature: float = Field(default=1.0, gt=0)
    #: Nucleus and top-k filters of the sampler (1.0 / 0: none). The behaviour log-probs
    #: the engines report are of the distribution sampled (temperature, then top-k, then
    #: top-p); the learner's policy is the tempered softmax over the whole vocabulary, and
    #: the off-policy schedules' importance weights correct toward it
    #: (``policy/logprobs.py``).
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    #: How the policy acts: ``bash_block``, a fenced bash block in its reply (observations
    #: come back as user messages); ``tool_calls``, its chat template's own tool-call
    #: syntax for a ``bash`` and a ``submit`` tool (observations as tool messages).
    action_format: Literal["bash_block", "tool_calls"] = "bash_block"
    #: The tool-call syntax: ``hermes`` (``<tool_call>{json}</tool_call>``, Qwen), ``json``
    #: (one ``{"name", "parameters"}`` object, Llama 3); ``auto``: hermes when the
    #: tokenizer has a ``<tool_call>`` token.
    tool_call_format: Literal["auto", "hermes", "json"] = "auto"
    #: A thinking template's switch (Qwen3's ``enable_thinking``), passed to the chat
    #: template; empty: not passed (the template's default). Actions are parsed after
    #: ``</think>``.
    enable_thinking: bool | None = None
    #: At start, render one episode through the chat template and refuse the run when the
    #: agent's token-by-token sequence differs from it (``rollout/chat.py``).
    template_check: bool = True
    #: Episodes in flight at once (0: the whole batch). Fewer makes rollout waves: a
    #: finished episode's slot goes to a waiting one, so rewards land throughout the stage.
    max_live_episodes: int = Field(default=0, ge=0)
    #: ``rounds``: every live episode's next action in one ``generate`` call, then their
    #: commands, in turns; ``overlapped``: commands run while the engine generates, each
    #: request joining vLLM's running batch as soon as its episode is ready (several engines
    #: or the transformers engine: one call for the episodes ready then). Overlapped
    #: batches depend on timing, and an engine's numerics may depend on its batch, so two
    #: runs of one policy may sample otherwise: ``rounds`` keeps sync and thundersync on
    #: the same tokens. New weights reach a one-engine overlapped rollout only while no
    #: request is in the engine.
    agent_loop: Literal["rounds", "overlapped"] = "rounds"
    #: Where vLLM's engine core runs: ``child``, a process of its own (vLLM's default; on
    #: a GPU it schedules the next step while the device computes); ``inline``, the
    #: rollout role's (or engine actor's) own process, which vLLM then sets up as its
    #: worker (on CPU: give the role one core); ``auto``: inline on CPU at
    #: tensor_parallel_size 1 in a role pinned to one core, else child. On CPU
    #: inline saves a second process taking turns with the role's on its cores: the
    #: embedded engine starts in 10 s (25 s as a child) and its rollout stage takes 11-12%
    #: less time, the same tokens. Inline, an engine failure is the role's process failing.
    engine_core: Literal["auto", "child", "inline"] = "auto"
    #: Threads running sandbox set-ups and commands, and as many for graders (each holds a
    #: sandbox's process while it runs); size it to the episodes in flight.
    sandbox_workers: int = Field(default=8, ge=1, le=1024)
    #: CPU cores the graders run on (their threads, and the verifier processes those
    #: start); empty: the rollout role's cores. On a small machine the learner's core is
    #: idle while sync rolls out, and grading is the rollout's most separable CPU work.
    grader_cores: tuple[int, ...] = ()
    #: How new weights reach the engines: ``file`` (a safetensors file under /dev/shm that
    #: each engine reads; one host) or ``collective`` (the learner broadcasts them to every
    #: engine worker over a torch.distributed group, gloo on CPU and NCCL on GPU, in the
    #: engine's dtype, in buckets of ``publication_bucket_mb``; vLLM engines). The
    #: pipeline's in-flight updates arrive at the rollout's next generation round.
    publication: Literal["file", "collective"] = "file"
    publication_bucket_mb: float = Field(default=64.0, gt=0)
    #: Collective publication: every engine checks, after loading, that each parameter's
    #: bytes are what the learner sent, and that what arrived hashes as what was sent; a
    #: difference fails the step naming the engine and parameter. Costs a hash of the model
    #: per step on both sides.
    verify_publication: bool = False
    #: How a LoRA policy (``policy.lora``) reaches the engines: ``merged``, the weights with
    #: each adapter merged in (any engine); ``adapter``, each version's adapter in peft's
    #: format, a new adapter in vLLM's LoRA support over the base weights, switched without
    #: restarting the engine (``rollout.engine: vllm``, ``publication: file``).
    lora_publication: Literal["merged", "adapter"] = "merged"


class TrainConfig(_Strict):
    name: str = "embedded"
    seed: int = 0
    objective: Objective = "grpo"
    schedule: Schedule = "thundersync"
    steps: int = Field(default=4, ge=1)
    groups_per_step: int = Field(default=4, ge=1)
    group_size: int = Field(default=4, ge=1)
    lr: float = Field(default=1e-4, gt=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    loss_agg: Literal["seq-sum", "token-mean"] = "token-mean"
    #: Admission cap k: groups with live sufficient statistics (thundersync GRPO).
    max_open_groups: int = Field(default=4, ge=1)
    #: Pipeline: a batch's rollouts start only once the engine is at most this many
    #: versions behind the version that will train on them.
    max_staleness: int = Field(default=1, ge=0)
    #: Truncation of importance weights for the off-policy schedules.
    is_clip: float = Field(default=2.0, gt=0)
    #: OPD: 0 trains on the one-sample reverse-KL estimate at each sampled token (only the
    #: teacher's log-prob of that token travels); k > 0 has the teacher send its k most
    #: likely tokens per position and trains on the reverse KL over the whole vocabulary.
    opd_teacher_top_k: int = Field(default=0, ge=0)
    checkpoint_every: int = Field(default=2, ge=1)
    #: Checkpoints kept whole (weights, optimizer and RNG states: what a resume needs): the
    #: last N; 0 keeps every one. Older ones are removed, except those on
    #: ``checkpoint_keep_every``.
    checkpoint_keep_last: int = Field(default=0, ge=0)
    #: Older checkpoints whose step is a multiple of this keep their weights (``model/``)
    #: and state.json for evaluation (``eval cadence``); their optimizer and RNG states go.
    #: 0: none are kept past the last ``checkpoint_keep_last``.
    checkpoint_keep_every: int = Field(default=0, ge=0)
    #: The dtype of a checkpoint's Hugging Face weights (``model/``: what evaluation and
    #: the engines load). ``bfloat16`` halves them; the float32 master then travels beside
    #: them (``master.safetensors``, or the group checkpoint's DCP state), so a resume is
    #: still exact, and the resumed engines are given the master before the first step.
    checkpoint_export_dtype: Literal["float32", "bfloat16"] = "float32"
    #: Sync's learner: the same per-source executor as thundersync (the default, so the
    #: two differ only in schedule) or the padded whole-batch learner.
    sync_learner: Literal["per-source", "batched"] = "per-source"
    #: The per-source GRPO learner's float sums: ``arrival`` adds each trajectory's
    #: gradient as its reward lands; ``fixed`` still runs each backward then but sums in
    #: trajectory-id order, so a thundersync update is bitwise sync's, and a run resumed
    #: after a fault ends bitwise as the uninterrupted one (it holds one gradient per
    #: arrived trajectory of an open group, and per closed group until the barrier).
    learner_order: Literal["arrival", "fixed"] = "arrival"
    #: Trajectories that landed while the learner was busy go over together, and those
    #: that close their group run as one padded pack (one backward) of at most this many
    #: tokens; 0: one at a time. Applies to the per-source GRPO learner on one rank, under
    #: every schedule (``packs``; the off-policy ones weight each row's tokens as one at a
    #: time would); ignored elsewhere. With learner_order fixed a group runs once its last
    #: trajectory lands, in trajectory-id order, as packs.
    learner_pack_tokens: int = Field(default=0, ge=0)
    #: With packs and learner_order fixed: each group's planned trajectory ids cut into this
    #: many chunks; a chunk runs once its members have landed with two reward values (else
    #: at its group's close), one backward per reward value and pack, weighted by that
    #: value's advantage at the close. Sync runs the same chunks, so the update stays bitwise
    #: thundersync's; a group's first chunks then overlap its last rollouts. 1: whole groups.
    learner_chunks: int = Field(default=1, ge=1)
    #: When the per-source GRPO learner runs a trajectory's backward: ``trajectory`` as its
    #: reward lands (each open group holds two gradient-sized statistics, at most
    #: ``max_open_groups`` of them); ``group`` once its group's rewards are all in, with its
    #: final advantage, straight into the batch gradient (no per-group statistics: less
    #: memory, less overlap). Both give the same update.
    grpo_release: Literal["trajectory", "group"] = "trajectory"
    #: Roles (rollout with its engine, learner, teacher) restarted from the latest
    #: checkpoint when one dies mid-run, before the run stops naming the fault.
    max_role_restarts: int = Field(default=2, ge=0)
    #: With ``resources.learner.ranks`` > 1: ``replicated`` keeps the full model, gradient
    #: and optimizer on every rank; ``fsdp2`` shards master weights, gradients and optimizer
    #: state with FSDP2 beside a full compute replica (see ``parallel/fsdp.py``).
    learner_sharding: Literal["replicated", "fsdp2"] = "replicated"
    #: Over fsdp2 ranks: the batch gradient held 1/W per rank (each rank's rows of its
    #: FSDP2 shards) instead of whole on every rank; the ranks reduce-scatter what their
    #: closed groups added after each group's last trajectory (in step: a rank may wait
    #: there for the others), or, for OPD turns, after each lockstep tick of turns (one
    #: per rank). Saves 4 (W-1)/W bytes per parameter on every rank.
    learner_sharded_gradient: bool = False
    #: GRPO over fsdp2 ranks with the sharded gradient: every rank shares every open group,
    #: whose two statistics it holds 1/W of (instead of whole groups per rank, their
    #: statistics whole); landed trajectories go to the ranks in lockstep ticks, one per
    #: rank, and ``max_open_groups`` bounds the groups open over all ranks
    #: (``parallel/shared_groups.py``). Needs grpo_release: trajectory, learner_order:
    #: arrival.
    learner_shared_groups: bool = False
    #: The learner's compute dtype; ``bfloat16`` is mixed precision: the forward and
    #: backward run on a bfloat16 replica, the accumulators, master weights and optimizer
    #: stay float32 (at one rank and at several, either sharding).
    learner_dtype: Literal["float32", "bfloat16"] = "float32"
    policy: PolicyConfig = PolicyConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    tasks: TasksConfig = TasksConfig()
    rollout: RolloutConfig = RolloutConfig()
    resources: ResourcesConfig = ResourcesConfig()

    @model_validator(mode="after")
    def _lengths_fit(self) -> TrainConfig:
        if self.warm_start.preset is not None and self.policy.path is None:
            from thundersync_core.policy.grow import check_growth  # noqa: PLC0415

            check_growth(self.warm_start.preset, self.policy.preset)
        if self.rollout.max_tokens_per_turn > self.rollout.max_total_tokens:
            raise ValueError("rollout.max_tokens_per_turn must be <= rollout.max_total_tokens")
        if self.learner_sharded_gradient and (
            self.learner_sharding != "fsdp2" or self.resources.learner.ranks < 2
        ):
            raise ValueError(
                "learner_sharded_gradient shards the batch gradient over fsdp2 ranks: it "
                "needs learner_sharding: fsdp2 and resources.learner.ranks >= 2"
            )
        if self.learner_shared_groups and not (
            self.objective == "grpo"
            and self.learner_sharded_gradient
            and self.grpo_release == "trajectory"
            and self.learner_order == "arrival"
            and not (self.schedule == "sync" and self.sync_learner == "batched")
        ):
            raise ValueError(
                "learner_shared_groups shares open GRPO groups' statistics over the ranks: it "
                "needs objective: grpo, learner_sharded_gradient: true, grpo_release: trajectory, "
                "learner_order: arrival and (under sync) sync_learner: per-source"
            )
        if self.learner_chunks > 1 and not (
            self.learner_pack_tokens
            and self.objective == "grpo"
            and self.resources.learner.ranks == 1
            and self.learner_order == "fixed"
            and self.grpo_release == "trajectory"
        ):
            raise ValueError(
                f"learner_chunks: {self.learner_chunks} needs the packed per-source GRPO "
                "learner (learner_pack_tokens > 0, objective grpo, one learner rank) with "
                "learner_order: fixed and grpo_release: trajectory"
            )
        if self.learner_order == "fixed" and self.objective != "grpo":
            raise ValueError(
                "learner_order: fixed orders the per-source GRPO learner's sums; "
                "objective opd sums in arrival order (use learner_order: arrival)"
            )
        return self

    @model_validator(mode="after")
    def _lora_publication_fits(self) -> TrainConfig:
        if self.rollout.lora_publication != "adapter":
            return self
        if self.policy.lora is None:
            raise ValueError(
                "rollout.lora_publication: adapter publishes the policy's LoRA adapter: it "
                "needs policy.lora (full fine-tuning publishes the weights)"
            )
        if self.rollout.engine != "vllm":
            raise ValueError(
                "rollout.lora_publication: adapter needs rollout.engine: vllm (vLLM's LoRA "
                f"support), got {self.rollout.engine!r}; the transformers engine loads merged "
                "weights (lora_publication: merged)"
            )
        if self.rollout.publication != "file":
            raise ValueError(
                "rollout.lora_publication: adapter writes each version's adapter to a folder "
                "the engines read: it needs rollout.publication: file"
            )
        return self

    @property
    def packs(self) -> bool:
        """Whether the learner runs packs: ``learner_pack_tokens`` set, and the per-source
        GRPO learner (any schedule; not sync's batched learner) on one rank (elsewhere
        sources go over one at a time)."""
        return bool(
            self.learner_pack_tokens
            and self.objective == "grpo"
            and not (self.schedule == "sync" and self.sync_learner == "batched")
            and self.resources.learner.ranks == 1
        )

    @property
    def learner_label(self) -> str:
        """What this schedule's learner is, in the config's terms: ``batched`` (sync's
        padded whole-batch learner) or ``per-source``, with its packs and summation order."""
        if self.schedule == "sync" and self.sync_learner == "batched":
            return "batched"
        label = "per-source"
        if self.packs:
            label += f", packs <= {self.learner_pack_tokens} tokens"
        if self.objective == "grpo" and self.learner_order == "fixed":
            label += ", id order"
        if self.packs and self.learner_chunks > 1:
            label += f", {self.learner_chunks} chunks a group"
        return label

    @property
    def batch_size(self) -> int:
        return self.groups_per_step * self.group_size


def load_config(path: Path | None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults < YAML file < overrides (dotted keys, e.g. ``{"rollout.engine": "hf"}``)."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--config {path}: no such file")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"--config {path}: the top level must be a mapping")
        data = loaded
        _resolve_paths(data, path.parent)
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for depth, key in enumerate(parents):
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
            if not isinstance(node, dict):
                above = ".".join(parents[: depth + 1])
                raise ValueError(f"override {dotted}: {above} is a value, not a section")
        node[leaf] = value
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "config"
        source = f"--config {path}" if path is not None else "config"
        raise ValueError(f"{source}: field {where}: {first['msg']}") from None


def _resolve_paths(data: dict[str, Any], base: Path) -> None:
    """Relative paths in a config file are relative to the file's folder."""
    for section, key in [
        ("tasks", "prep_dir"),
        ("policy", "path"),
        ("policy", "teacher_path"),
        ("warm_start", "cache_dir"),
    ]:
        value = (data.get(section) or {}).get(key)
        if isinstance(value, str) and not Path(value).is_absolute():
            data[section][key] = str((base / value).resolve())
    excluded = (data.get("tasks") or {}).get("dev_exclude")
    if isinstance(excluded, list):
        data["tasks"]["dev_exclude"] = [
            str((base / v).resolve()) if isinstance(v, str) and not Path(v).is_absolute() else v
            for v in excluded
        ]


def dump_config(config: TrainConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
