"""The learner's memory model against what the code really holds, on small models.

Why a pass cannot be chance: every comparison is against bytes read off live objects (the
parameters of models built from the configs, the tensors autograd saved or kept, the
learner's and train state's own byte counters) and asks for equality, where a missing or
doubled term is off by a whole tensor. The peak resident set is checked by
``benchmarks/learner_memory.py`` (it needs fresh processes).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from thundersync_core.batch import Segment, Trajectory
from thundersync_core.parallel.fsdp import build_train_state
from thundersync_core.perfmodel.memory import (
    GB,
    LORA_TARGETS,
    LearnerLayout,
    LoraSpec,
    ModelShape,
    check_learner_memory,
    fits,
    memory_per_gpu,
)
from thundersync_core.policy import build_model
from thundersync_core.policy.logprobs import scored_logprobs
from thundersync_core.policy.lora import DEFAULT_TARGETS, LoraSettings, apply_lora
from thundersync_core.policy.presets import preset_config
from thundersync_core.streaming import GroupSpec, StreamingGRPOLearner, SyncGRPOLearner
from thundersync_core.streaming.prefix import SharedPrefix

HF_CONFIGS = Path(__file__).parents[2] / "configs" / "hf"
SMALL = {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96}


def _qwen3_untied() -> Qwen3Config:
    config = preset_config("micro")
    config.tie_word_embeddings = False
    return config


def _small_models() -> list[tuple[str, torch.nn.Module]]:
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
    return [
        ("micro (tied)", build_model("micro")),
        ("tiny (tied)", build_model("tiny")),
        ("qwen3 untied", Qwen3ForCausalLM(_qwen3_untied())),
        ("llama", LlamaForCausalLM(LlamaConfig(**SMALL, **heads))),
        (
            "llama biases",
            LlamaForCausalLM(LlamaConfig(**SMALL, **heads, attention_bias=True, mlp_bias=True)),
        ),
        (
            "llama tied",
            LlamaForCausalLM(LlamaConfig(**SMALL, **heads | {"tie_word_embeddings": True})),
        ),
        ("qwen2", Qwen2ForCausalLM(Qwen2Config(**SMALL, **heads))),
    ]


def test_parameter_count_equals_the_models_built_from_the_configs():
    for name, model in _small_models():
        shape = ModelShape.from_hf_config(model.config)
        params = list(model.parameters())
        assert shape.parameter_count == sum(p.numel() for p in params), name
        assert shape.parameter_tensors == len(params), name
        assert shape.largest_tensor == max(p.numel() for p in params), name


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-32b"])
def test_committed_hf_configs_match_a_model_built_on_the_meta_device(name):
    path = HF_CONFIGS / f"{name}.json"
    shape = ModelShape.from_hf_config(path)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**json.loads(path.read_text())))
    assert shape.parameter_count == sum(p.numel() for p in model.parameters())
    assert not shape.tie_word_embeddings
    assert shape.qk_norm
    assert shape.head_dim == 128
    # The public figures: 8.2 B and 32.8 B parameters.
    assert round(shape.parameter_count / 1e9, 1) == {"qwen3-8b": 8.2, "qwen3-32b": 32.8}[name]


def test_a_config_of_another_family_is_refused_by_name():
    with pytest.raises(ValueError, match="gpt2"):
        ModelShape.from_hf_config({"model_type": "gpt2", **SMALL, "num_attention_heads": 4})


# -- activations: the bytes autograd keeps ------------------------------------------------------
def _forward_saved_bytes(model, prefix_tokens: int, tokens: int) -> int:
    """Bytes of every tensor one scored forward saves for backward, or that its prompt
    cache holds, other than parameters and prompt proxies (distinct storages)."""
    vocab = model.config.vocab_size
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(vocab, (prefix_tokens + 1,), generator=gen).tolist()
    prefix = SharedPrefix(model, prompt[:-1]) if prefix_tokens else None
    skip |= {p.untyped_storage().data_ptr() for p in (prefix.proxies if prefix else [])}
    ids_1T = torch.tensor([[prompt[-1], *torch.randint(vocab, (tokens - 1,), generator=gen)]])
    scored_1T = torch.ones_like(ids_1T, dtype=torch.bool)
    scored_1T[0, 0] = False
    cache = prefix.cache() if prefix else None
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        scored_logprobs(model, ids_1T, scored_1T, past_key_values=cache)
    for layer in cache.layers if cache is not None else []:
        for t in (layer.keys, layer.values):
            keep(t)
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prefix_tokens", [0, 16])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_saved_activations_equal_the_formula(dtype, prefix_tokens, kv_heads):
    model = build_model("micro", num_attention_heads=4, num_key_value_heads=kv_heads, dtype=dtype)
    shape = ModelShape.from_hf_config(model.config)
    c = 4 if dtype == torch.float32 else 2
    tokens = 40
    expected = shape.saved_activation_bytes(c, tokens, prefix_tokens, scored_tokens=tokens - 1)
    assert _forward_saved_bytes(model, prefix_tokens, tokens) == expected


@pytest.mark.parametrize("prefix_tokens", [0, 16])
def test_saved_activations_of_a_llama_shape_equal_the_formula(prefix_tokens):
    config = LlamaConfig(
        **SMALL | {"vocab_size": 512}, num_attention_heads=4, num_key_value_heads=2
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    shape = ModelShape.from_hf_config(config)
    expected = shape.saved_activation_bytes(2, 40, prefix_tokens, scored_tokens=39)
    assert _forward_saved_bytes(model, prefix_tokens, 40) == expected


def _graph_bytes(roots: list[torch.Tensor], skip: set[int]) -> int:
    """Bytes of the roots and of every tensor saved by a node reachable from them."""
    storages = {r.untyped_storage().data_ptr(): r.untyped_storage().nbytes() for r in roots}
    seen, stack = set(), [r.grad_fn for r in roots]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            value = getattr(node, attr)
            for t in value if isinstance(value, tuple | list) else (value,):
                # 0-dim: a Python scale autograd wrapped (peft's alpha / r), 8 bytes, not
                # modelled (saved_tensors_hooks do not see them either).
                if not isinstance(t, torch.Tensor) or t.dim() == 0:
                    continue
                if t.untyped_storage().data_ptr() not in skip:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_open_groups_prompt_graph_equals_the_formula(dtype):
    model = build_model("micro", num_hidden_layers=3, num_attention_heads=4, dtype=dtype)
    prefix = SharedPrefix(model, list(range(1, 25)))
    kv_flat = prefix._kv_flat
    assert kv_flat is not None
    measured = _graph_bytes(kv_flat, {p.untyped_storage().data_ptr() for p in model.parameters()})
    shape = ModelShape.from_hf_config(model.config)
    assert measured == shape.prompt_graph_bytes(4 if dtype == torch.float32 else 2, 24)


@pytest.mark.parametrize("tied", [True, False])
def test_the_prompt_replay_reaches_the_modelled_parameters(tied):
    model = build_model("micro") if tied else Qwen3ForCausalLM(_qwen3_untied())
    prefix = SharedPrefix(model, list(range(1, 9)))
    grads = prefix.replay([torch.ones_like(p) for p in prefix.proxies], list(model.parameters()))
    reached = sum(g.numel() for g in grads if g is not None)
    assert reached == ModelShape.from_hf_config(model.config).replay_parameter_count()


# -- state terms against a tiny real learner ----------------------------------------------------
def _group(prompt_tokens: int) -> list[Trajectory]:
    prompt = tuple(range(1, prompt_tokens + 1))
    return [
        Trajectory("g0", f"g0-t{i}", prompt, (Segment.action([7 + i, 8, 9, 10]),), float(i))
        for i in range(2)
    ]


@pytest.mark.parametrize("release", ["trajectory", "group"])
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_state_terms_equal_the_learners_byte_counters(compute_dtype, release):
    model = build_model("micro", seed=1)
    dtype = torch.bfloat16 if compute_dtype == "bfloat16" else None
    state = build_train_state(model, sharding="replicated", lr=1e-3, compute_dtype=dtype)
    learner = StreamingGRPOLearner(state.model, max_open_groups=1, release=release)
    group = _group(prompt_tokens=9)
    layout = LearnerLayout(
        world_size=1,
        sharding="replicated",
        compute_dtype=compute_dtype,
        open_groups=1,
        release=release,
        tokens_per_backward=5,
        prefix_tokens=8,
        group_size=2,
    )
    estimate = memory_per_gpu(ModelShape.from_hf_config(model.config), layout)
    backward, barrier = estimate.phases["backward"], estimate.phases["barrier"]

    learner.begin_batch({"g0": GroupSpec(group[0].prompt_ids, 2)})
    learner.submit(group[0])
    # One group open: its two statistics (release="trajectory") or none (release="group").
    assert learner.live_statistics_bytes() == backward["group_statistics"]
    assert learner.accumulator_bytes() == backward["accumulator"]
    learner.submit(group[1])
    result = learner.finish()
    at_barrier = state.state_bytes()
    assert at_barrier["params"] == backward["replica"] + backward["master"]
    assert at_barrier["grads"] == barrier["replica_grads"]
    state.clip(1.0, result.grad_objective, -1.0)
    assert state.state_bytes()["grads"] == estimate.phases["optimizer_step"]["grads"]
    state.apply()
    assert state.state_bytes()["optimizer"] == backward["optimizer"]


def _live_gradient_bytes(
    monkeypatch: pytest.MonkeyPatch, learner: StreamingGRPOLearner
) -> dict[str, list[int]]:
    """Bytes of the learner's backward gradients still alive (held by the learner, not by
    this probe: weak references) as each backward starts and as each close starts."""
    import weakref  # noqa: PLC0415

    returned: list[weakref.ref[torch.Tensor]] = []
    seen: dict[str, list[int]] = {"backward": [], "close": []}
    closing = False
    grad, close = torch.autograd.grad, learner._close

    def live() -> int:
        return sum(t.numel() * t.element_size() for ref in returned if (t := ref()) is not None)

    def tracked_grad(*args, **kwargs):
        if closing:  # the prompt replay's, not a backward's
            return grad(*args, **kwargs)
        seen["backward"].append(live())
        grads = grad(*args, **kwargs)
        returned.extend(weakref.ref(g) for g in grads if g is not None)
        return grads

    def tracked_close(*args, **kwargs):
        nonlocal closing
        seen["close"].append(live())
        closing = True
        try:
            return close(*args, **kwargs)
        finally:
            closing = False

    monkeypatch.setattr(torch.autograd, "grad", tracked_grad)
    monkeypatch.setattr(learner, "_close", tracked_close)
    return seen


@pytest.mark.parametrize("release", ["trajectory", "group"])
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_held_gradients_equal_what_the_learner_keeps_alive(monkeypatch, compute_dtype, release):
    model = build_model("micro", seed=1)
    dtype = torch.bfloat16 if compute_dtype == "bfloat16" else None
    state = build_train_state(model, sharding="replicated", lr=1e-3, compute_dtype=dtype)
    learner = StreamingGRPOLearner(state.model, max_open_groups=1, release=release)
    prompt = tuple(range(1, 10))
    group = [
        # Rewards 0, 1, 4: no advantage is 0, so every trajectory takes a backward.
        Trajectory("g0", f"g0-t{i}", prompt, (Segment.action([7 + i, 8, 9, 10]),), i * i)
        for i in range(3)
    ]
    layout = LearnerLayout(
        compute_dtype=compute_dtype,
        open_groups=1,
        release=release,
        tokens_per_backward=5,
        prefix_tokens=8,
        group_size=3,
    )
    estimate = memory_per_gpu(ModelShape.from_hf_config(model.config), layout)
    held = estimate.phases["backward"]["held_gradients"]
    seen = _live_gradient_bytes(monkeypatch, learner)
    learner.begin_batch({"g0": GroupSpec(prompt, 3)})
    for traj in group:
        learner.submit(traj)
    # release="group" sums in place into the first backward's gradient: one gradient held
    # from the second backward on, never two; the per-trajectory path holds none, not even
    # the closing trajectory's at its close.
    assert seen["backward"] == [0, held, held]
    assert seen["close"] == [estimate.phases["group_close"]["held_gradients"]]
    assert seen["close"] == [estimate.phases["prompt_replay"]["held_gradients"]]
    assert (held > 0) == (release == "group")


def test_begin_batch_frees_the_last_accumulator_before_allocating_the_next(monkeypatch):
    import weakref  # noqa: PLC0415

    learner = StreamingGRPOLearner(build_model("micro", seed=1), max_open_groups=1)
    group = _group(prompt_tokens=9)
    learner.begin_batch({"g0": GroupSpec(group[0].prompt_ids, 2)})
    for traj in group:
        learner.submit(traj)
    learner.finish()
    last = [weakref.ref(t) for t in learner._grad_sum]
    alive_at_allocation: list[int] = []
    zeros_like = torch.zeros_like

    def tracked_zeros_like(*args, **kwargs):
        alive_at_allocation.append(sum(ref() is not None for ref in last))
        return zeros_like(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros_like", tracked_zeros_like)
    learner.begin_batch({"g1": GroupSpec(group[0].prompt_ids, 2)})
    monkeypatch.undo()
    assert alive_at_allocation
    assert set(alive_at_allocation) == {0}
    estimate = memory_per_gpu(
        ModelShape.from_hf_config(learner.model.config), LearnerLayout(compute_dtype="float32")
    )
    assert estimate.phases["begin_batch"]["accumulator"] == learner.accumulator_bytes()
    assert "accumulator_next" not in estimate.phases["begin_batch"]


# -- the refusal -------------------------------------------------------------------------------
def test_an_8b_layout_on_a_small_budget_is_refused_naming_every_term():
    shape = ModelShape.from_hf_config(HF_CONFIGS / "qwen3-8b.json")
    layout = LearnerLayout(world_size=8, sharding="fsdp2", open_groups=4, prefix_tokens=1024)
    estimate = memory_per_gpu(shape, layout)
    with pytest.raises(ValueError, match="does not fit") as refused:
        check_learner_memory(shape, layout, 180 * GB)
    message = str(refused.value)
    for name, n in estimate.terms.items():
        assert f"{name} {n / GB:.1f}" in message
    assert f"= {estimate.total_bytes / GB:.1f} GB against 180.0 GB per GPU" in message
    # The statistics of four open groups alone are 4 x 2 x 4 bytes x 8.2 B > 180 GB.
    assert estimate.terms["group_statistics"] > 180 * GB


def test_a_fitting_layout_is_accepted():
    shape = ModelShape.from_hf_config(HF_CONFIGS / "qwen3-8b.json")
    layout = LearnerLayout(
        world_size=8,
        sharding="fsdp2",
        release="group",
        tokens_per_backward=2048,
        prefix_tokens=512,
        lora=LoraSpec(rank=16),
    )
    check_learner_memory(shape, layout, 80 * GB)
    assert fits(shape, layout, 80 * GB)
    assert not fits(shape, layout, 10 * GB)


def test_a_config_whose_learner_does_not_fit_is_refused_at_start_naming_the_numbers(tmp_path):
    import shutil  # noqa: PLC0415

    from thundersync_core.config import TrainConfig  # noqa: PLC0415
    from thundersync_core.perfmodel.memory import check_config_fits, layout_of  # noqa: PLC0415

    folder = tmp_path / "qwen3-8b"
    folder.mkdir()
    hf_config = Path(__file__).parents[2] / "configs" / "hf" / "qwen3-8b.json"
    shutil.copy(hf_config, folder / "config.json")
    learner = {"num_gpus": 8, "ranks": 8, "gpu_memory_gb": 180}
    config = TrainConfig(
        learner_sharding="fsdp2",
        learner_dtype="bfloat16",
        max_open_groups=4,
        group_size=8,
        rollout={"max_total_tokens": 8192, "max_model_len": 9216, "max_tokens_per_turn": 512},
        resources={"learner": learner},
    )
    layout = layout_of(config)
    assert (layout.world_size, layout.sharding, layout.open_groups) == (8, "fsdp2", 4)
    assert (layout.tokens_per_backward, layout.prefix_tokens) == (8192, 1023)
    with pytest.raises(ValueError, match=r"gpu_memory_gb 180: the learner does not fit") as info:
        check_config_fits(config, folder)
    for term in ("group_statistics", "accumulator", "activations"):
        assert term in str(info.value)
    # Short backwards on a 1 TB device fit; so does any layout when no budget is given.
    roomy = config.model_copy(
        update={"resources": config.resources.model_copy(
            update={"learner": config.resources.learner.model_copy(update={"gpu_memory_gb": 1000})}
        )}
    )  # fmt: skip
    check_config_fits(roomy, folder)
    unchecked = TrainConfig(resources={"learner": {"num_gpus": 8, "ranks": 8}})
    check_config_fits(unchecked, folder)


# -- the sharded batch gradient (learner_sharded_gradient) ------------------------------------
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["micro (tied)", "qwen3 untied", "llama biases"])
def test_the_sharded_accumulator_is_rank_0s_rows_of_the_real_parameters(name, world):
    from thundersync_core.parallel.data_parallel import shard_rows  # noqa: PLC0415

    model = dict(_small_models())[name]
    shape = ModelShape.from_hf_config(model.config)
    params = list(model.parameters())
    assert sorted(shape.parameter_rows()) == sorted((p.shape[0], p[0].numel()) for p in params)
    per_rank = []
    for rank in range(world):
        rows = [shard_rows(p.shape[0], world, rank) for p in params]
        per_rank.append(
            sum(
                4 * (stop - start) * p[0].numel()
                for p, (start, stop) in zip(params, rows, strict=True)
            )
        )
    layout = LearnerLayout(world_size=world, sharding="fsdp2", sharded_gradient=True)
    estimate = memory_per_gpu(shape, layout)
    # Over 3 ranks most dims (64, 128, 1024) do not split evenly: rank 0 holds the most,
    # and the ranks together hold every row once.
    assert estimate.phases["begin_batch"]["accumulator"] == max(per_rank) == per_rank[0]
    assert sum(per_rank) == 4 * shape.parameter_count
    assert estimate.phases["prompt_replay"]["pending"] == 4 * shape.parameter_count


def test_pending_phases_by_release_follow_the_flush_points():
    """Pins the phases read off the learner: per trajectory, pending is live from a close's
    commit through the held sources that close admits, until the flush; per group, only
    from the commit to the flush."""
    shape = ModelShape.from_hf_config(preset_config("micro"))
    base = LearnerLayout(world_size=2, sharding="fsdp2", sharded_gradient=True, open_groups=2)
    by_trajectory = memory_per_gpu(shape, base).phases
    by_group = memory_per_gpu(shape, replace(base, release="group")).phases
    pending = 4 * shape.parameter_count
    for phase in ("backward", "group_close", "prompt_replay", "flush"):
        assert by_trajectory[phase]["pending"] == pending, phase
    assert by_group["backward"]["pending"] == by_group["group_close"]["pending"] == 0
    assert by_group["prompt_replay"]["pending"] == by_group["flush"]["pending"] == pending
    # Whole gradient: nothing pending, no flush. Shared groups: nothing pending; their
    # flush is a tick's reduction, holding the tick's gradient.
    phases = memory_per_gpu(shape, replace(base, sharded_gradient=False)).phases
    assert "flush" not in phases
    assert all(terms.get("pending", 0) == 0 for terms in phases.values())
    shared = memory_per_gpu(shape, replace(base, shared_groups=True)).phases
    assert all(terms["pending"] == 0 for name, terms in shared.items() if "pending" in terms)
    assert shared["flush"]["held_gradients"] == 2 * shape.parameter_count  # bfloat16
    with pytest.raises(ValueError, match="shared_groups needs"):
        LearnerLayout(world_size=2, sharding="fsdp2", shared_groups=True)
    with pytest.raises(ValueError, match="fsdp2"):
        LearnerLayout(world_size=2, sharded_gradient=True)


def test_layout_of_picks_up_the_sharded_gradient_from_the_config():
    from thundersync_core.config import TrainConfig  # noqa: PLC0415
    from thundersync_core.perfmodel.memory import layout_of  # noqa: PLC0415

    learner = {"num_gpus": 4, "ranks": 4}
    sharded = TrainConfig(
        learner_sharding="fsdp2", learner_sharded_gradient=True, resources={"learner": learner}
    )
    assert layout_of(sharded).sharded_gradient
    assert "sharded gradient" in layout_of(sharded).describe()
    whole = sharded.model_copy(update={"learner_sharded_gradient": False})
    assert not layout_of(whole).sharded_gradient
    shape = ModelShape.from_hf_config(HF_CONFIGS / "qwen3-8b.json")
    # At W = 4 the accumulator is a quarter: 24.6 GB of the 32.8 GB whole one saved.
    saved = (
        memory_per_gpu(shape, layout_of(whole)).phases["begin_batch"]["accumulator"]
        - memory_per_gpu(shape, layout_of(sharded)).phases["begin_batch"]["accumulator"]
    )
    assert saved == pytest.approx(3 / 4 * 4 * shape.parameter_count, rel=1e-4)
    # Shared groups: 1/W of each open group's two float32 statistics on every rank.
    shared = sharded.model_copy(update={"learner_shared_groups": True, "max_open_groups": 2})
    assert layout_of(shared).shared_groups
    statistics = memory_per_gpu(shape, layout_of(shared)).phases["backward"]["group_statistics"]
    kv = shape.prompt_kv_elements(layout_of(shared).prefix_tokens)
    rows = statistics / 2 - 8 * kv
    assert rows == pytest.approx(8 * shape.parameter_count / 4, rel=1e-3)


def test_shared_groups_are_refused_without_what_they_build_on():
    from pydantic import ValidationError  # noqa: PLC0415

    from thundersync_core.config import TrainConfig  # noqa: PLC0415

    learner = {"num_gpus": 2, "ranks": 2}
    for missing in (
        {"learner_sharded_gradient": False},
        {"grpo_release": "group"},
        {"learner_order": "fixed"},
        {"schedule": "sync", "sync_learner": "batched"},
    ):
        fields = {"learner_sharding": "fsdp2", "learner_sharded_gradient": True} | missing
        with pytest.raises(ValidationError, match=r"learner_shared_groups shares .* needs"):
            TrainConfig(learner_shared_groups=True, resources={"learner": learner}, **fields)


# -- LoRA: float32 adapters over a frozen base --------------------------------------------------
_Model = TypeVar("_Model", bound=torch.nn.Module)


def _with_adapters(
    model: _Model,
    rank: int,
    targets: tuple[str, ...] = LORA_TARGETS,
    base_dtype: torch.dtype = torch.float32,
) -> _Model:
    """``model`` with float32 adapters (B drawn, so every adapter gets a gradient) and its
    frozen base in ``base_dtype``, as ``build_train_state`` leaves a LoRA model at that
    compute dtype."""
    settings = LoraSettings(r=rank, alpha=2 * rank, target_modules=targets)
    apply_lora(model, settings, init_b_std=0.02)
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(base_dtype)
    return model


def test_the_modelled_lora_targets_are_apply_loras_defaults():
    assert LORA_TARGETS == DEFAULT_TARGETS


@pytest.mark.parametrize("targets", [LORA_TARGETS, ("q_proj", "v_proj"), ("down_proj",)])
@pytest.mark.parametrize("rank", [8, 64])
@pytest.mark.parametrize("name", ["micro (tied)", "tiny (tied)", "qwen3 untied", "llama biases"])
def test_lora_trainable_parameters_are_what_apply_lora_makes_trainable(name, rank, targets):
    model = _with_adapters(dict(_small_models())[name], rank, targets)
    shape = ModelShape.from_hf_config(model.config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert shape.lora_parameter_count(rank, targets) == sum(p.numel() for p in trainable)
    assert sorted(shape.lora_parameter_rows(rank, targets)) == sorted(
        (p.shape[0], p[0].numel()) for p in trainable
    )
    assert shape.lora_largest_tensor(rank, targets) == max(p.numel() for p in trainable)
    layout = LearnerLayout(compute_dtype="float32", lora=LoraSpec(rank, targets))
    counts = memory_per_gpu(shape, layout).counts
    assert counts["trainable_parameters"] == sum(p.numel() for p in trainable)
    assert counts["parameters"] == sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for p in trainable
    )


def test_the_small_presets_lora_parameters_equal_the_formula():
    model = _with_adapters(build_model("small"), 64)
    shape = ModelShape.from_hf_config(model.config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # small: h = 384, q = 384, kv = 128, f = 1152; r (in + out) summed over the seven.
    per_layer = 384 + 384 + 2 * (384 + 128) + 384 + 384 + 3 * (384 + 1152)
    assert trainable == shape.lora_parameter_count(64, LORA_TARGETS) == 6 * 64 * per_layer


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16 base"])
@pytest.mark.parametrize("prefix_tokens", [0, 16])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_lora_saved_activations_equal_the_formula(base_dtype, prefix_tokens, kv_heads):
    model = build_model("micro", num_attention_heads=4, num_key_value_heads=kv_heads)
    model = _with_adapters(model, 8, base_dtype=base_dtype)
    shape = ModelShape.from_hf_config(model.config)
    c = 4 if base_dtype == torch.float32 else 2
    expected = shape.saved_activation_bytes(
        c, 40, prefix_tokens, scored_tokens=39, lora=LoraSpec(8)
    )
    assert _forward_saved_bytes(model, prefix_tokens, 40) == expected
    # Cheaper than full fine-tuning's in float32 (frozen norms, head and embedding); dearer
    # over a bfloat16 base (each adapter's float32 copy of its input).
    full = shape.saved_activation_bytes(c, 40, prefix_tokens, scored_tokens=39)
    assert (expected < full) == (c == 4)


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16 base"])
def test_lora_saved_activations_of_a_llama_shape_equal_the_formula(base_dtype):
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = _with_adapters(LlamaForCausalLM(config), 4, base_dtype=base_dtype)
    shape = ModelShape.from_hf_config(config)
    c = 4 if base_dtype == torch.float32 else 2
    expected = shape.saved_activation_bytes(c, 40, 16, scored_tokens=39, lora=LoraSpec(4))
    assert _forward_saved_bytes(model, 16, 40) == expected


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16 base"])
@pytest.mark.parametrize("layers", [1, 3])
def test_a_lora_prompt_graph_equals_the_formula(base_dtype, layers):
    model = build_model("micro", num_hidden_layers=layers, num_attention_heads=4)
    model = _with_adapters(model, 4, base_dtype=base_dtype)
    prefix = SharedPrefix(model, list(range(1, 25)))
    kv_flat = prefix._kv_flat
    assert kv_flat is not None
    measured = _graph_bytes(kv_flat, {p.untyped_storage().data_ptr() for p in model.parameters()})
    shape = ModelShape.from_hf_config(model.config)
    c = 4 if base_dtype == torch.float32 else 2
    assert measured == shape.prompt_graph_bytes(c, 24, LoraSpec(4))


def test_the_lora_prompt_replay_reaches_the_modelled_adapters():
    model = _with_adapters(build_model("micro"), 4)
    prefix = SharedPrefix(model, list(range(1, 9)))
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = prefix.replay([torch.ones_like(p) for p in prefix.proxies], trainable)
    reached = sum(g.numel() for g in grads if g is not None)
    shape = ModelShape.from_hf_config(model.config)
    layout = LearnerLayout(compute_dtype="float32", prefix_tokens=8, lora=LoraSpec(4))
    # The last layer's q, o and MLP adapters feed nothing the prompt's keys depend on.
    assert 0 < reached < sum(p.numel() for p in trainable)
    assert memory_per_gpu(shape, layout).phases["prompt_replay"]["replay_gradient"] == 4 * reached


def _groups(n_groups: int, prompt_tokens: int) -> list[Trajectory]:
    """Every group's first trajectory, then every second: all ``n_groups`` are open at once."""
    prompt = tuple(range(1, prompt_tokens + 1))
    return [
        Trajectory(f"g{g}", f"g{g}-t{i}", prompt, (Segment.action([7 + i, 8, 9, 10]),), float(i))
        for i in range(2)
        for g in range(n_groups)
    ]


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_lora_state_terms_equal_the_learners_byte_counters(compute_dtype):
    model = _with_adapters(build_model("micro", seed=1), 4)
    dtype = torch.bfloat16 if compute_dtype == "bfloat16" else None
    state = build_train_state(model, sharding="replicated", lr=1e-3, compute_dtype=dtype)
    learner = StreamingGRPOLearner(state.model, max_open_groups=2)  # type: ignore[arg-type]
    batch = _groups(2, prompt_tokens=9)
    layout = LearnerLayout(
        compute_dtype=compute_dtype,
        open_groups=2,
        tokens_per_backward=5,
        prefix_tokens=8,
        group_size=2,
        lora=LoraSpec(4),
    )
    shape = ModelShape.from_hf_config(model.config)
    estimate = memory_per_gpu(shape, layout)
    backward, barrier = estimate.phases["backward"], estimate.phases["barrier"]
    adapters = sum(p.numel() for p in state.model.parameters() if p.requires_grad)

    learner.begin_batch({f"g{g}": GroupSpec(batch[0].prompt_ids, 2) for g in range(2)})
    for traj in batch[:2]:
        learner.submit(traj)
    # Two open groups, each two float32 buffers over the adapters and the prompt's keys.
    expected = 2 * 2 * 4 * (adapters + shape.prompt_kv_elements(8))
    assert learner.live_statistics_bytes() == backward["group_statistics"] == expected
    assert learner.accumulator_bytes() == backward["accumulator"] == 4 * adapters
    for traj in batch[2:]:
        learner.submit(traj)
    result = learner.finish()
    at_barrier = state.state_bytes()
    assert at_barrier["params"] == backward["base"] + backward["replica"] + backward["master"]
    assert at_barrier["grads"] == barrier["replica_grads"] == 4 * adapters
    state.clip(1.0, result.grad_objective, -1.0)
    assert state.state_bytes()["grads"] == estimate.phases["optimizer_step"]["grads"]
    state.apply()
    assert state.state_bytes()["optimizer"] == backward["optimizer"]


def test_the_sync_learners_terms_equal_its_byte_counters():
    model = _with_adapters(build_model("micro", seed=1), 4)
    state = build_train_state(model, sharding="replicated", lr=1e-3)
    batch = _groups(2, prompt_tokens=9)
    row = len(batch[0].prompt_ids) + len(batch[0].response_ids)
    learner = SyncGRPOLearner(state.model, micro_batch_tokens=row)  # type: ignore[arg-type]
    layout = LearnerLayout(
        compute_dtype="float32", tokens_per_backward=5, prefix_tokens=8, lora=LoraSpec(4)
    )
    estimate = memory_per_gpu(
        ModelShape.from_hf_config(model.config), replace(layout, learner="sync")
    )
    assert set(estimate.phases) == {"begin_batch", "backward", "barrier", "optimizer_step"}
    learner.begin_batch({f"g{g}": GroupSpec(batch[0].prompt_ids, 2) for g in range(2)})
    for traj in batch:
        learner.submit(traj)
    assert learner.accumulator_bytes() == estimate.phases["backward"]["accumulator"]
    result = learner.finish()
    assert state.state_bytes()["grads"] == estimate.phases["barrier"]["replica_grads"]
    state.clip(1.0, result.grad_objective, -1.0)
    state.apply()
    assert state.state_bytes()["optimizer"] == estimate.phases["backward"]["optimizer"]


@pytest.mark.parametrize("sharding", ["replicated", "fsdp2"])
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-32b"])
def test_streaming_lora_adds_two_adapter_buffers_per_open_group_to_the_sync_peak(
    name, compute_dtype, sharding
):
    """With no prompt the two learners' rows are the same tokens: streaming adds the open
    groups' statistics, two float32 adapter-sized buffers each, and nothing else."""
    shape = ModelShape.from_hf_config(HF_CONFIGS / f"{name}.json")
    for rank in (16, 64):
        adapter_bytes = 4 * shape.lora_parameter_count(rank, LORA_TARGETS)
        for k in (1, 2, 4, 8):
            layout = LearnerLayout(
                world_size=8,
                sharding=sharding,
                compute_dtype=compute_dtype,
                open_groups=k,
                tokens_per_backward=8192,
                lora=LoraSpec(rank),
            )
            streaming = memory_per_gpu(shape, layout)
            sync = memory_per_gpu(shape, replace(layout, learner="sync"))
            assert streaming.peak_phase == sync.peak_phase == "backward"
            assert streaming.terms["group_statistics"] == 2 * k * adapter_bytes
            assert streaming.total_bytes - sync.total_bytes == 2 * k * adapter_bytes
            # A prompt's keys and values are streamed too: the buffers cover them.
            prompted = memory_per_gpu(shape, replace(layout, prefix_tokens=1024))
            kv_bytes = 4 * shape.prompt_kv_elements(1024)
            assert prompted.phases["backward"]["group_statistics"] == 2 * k * (
                adapter_bytes + kv_bytes
            )


def test_lora_holds_the_frozen_base_once_in_the_compute_dtype_and_no_optimizer_for_it():
    shape = ModelShape.from_hf_config(HF_CONFIGS / "qwen3-8b.json")
    adapters = shape.lora_parameter_count(16, LORA_TARGETS)
    for sharding, world in (("replicated", 1), ("fsdp2", 8)):
        layout = LearnerLayout(
            world_size=world,
            sharding=sharding,  # type: ignore[arg-type]
            compute_dtype="bfloat16",
            lora=LoraSpec(16),
        )
        terms = memory_per_gpu(shape, layout).phases["begin_batch"]
        assert terms["base"] == 2 * shape.parameter_count
        assert terms["master"] == -(-4 * adapters // world)
        assert terms["optimizer"] == -(-8 * adapters // world) + 4 * 2 * 7 * 36
        # The float32 adapters are their own master when replicated; fsdp2's replica keeps
        # them whole beside the sharded master.
        assert terms["replica"] == (0 if sharding == "replicated" else 4 * adapters)


def test_layout_of_picks_up_lora_from_the_config():
    from thundersync_core.config import TrainConfig  # noqa: PLC0415
    from thundersync_core.perfmodel.memory import layout_of  # noqa: PLC0415

    lora = {"r": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]}
    config = TrainConfig.model_validate({"policy": {"lora": lora}})
    assert layout_of(config).lora == LoraSpec(16, ("q_proj", "v_proj"))
    assert "lora r=16" in layout_of(config).describe()
    assert layout_of(TrainConfig()).lora is None


def test_the_flush_buckets_are_the_sharded_gradients():
    from thundersync_core.parallel.data_parallel import BUCKET_BYTES  # noqa: PLC0415
    from thundersync_core.perfmodel.memory import FLUSH_BUCKET_BYTES  # noqa: PLC0415

    assert FLUSH_BUCKET_BYTES == BUCKET_BYTES
